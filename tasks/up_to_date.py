"""Between the data gate and provisioning: is there anything to train?

A nightly run over unchanged data would otherwise allocate a pool, stage nothing new, "resume"
a finished checkpoint, export the same model and score it again: GPU nodes paid to do nothing.
When the data version the gate validated, the code and image versions and the training settings
all equal those of the last run that trained on the same data root (``registry/last_run.py``),
or of any earlier run that trained exactly them, and that run's model is still there, the run is
*up to date*: it ends before anything is provisioned, and its summary says which run and data
version it matched, and which model serves the data root (its champion, which is not the
matched run's model when that one was not promoted). ``force`` trains anyway. So each data
version is trained once however many runs ask for it: the relay's, the sensor's, the nightly's
and a person's.

A run decides this while it holds its pool, and holds the pool until its own record is written
(``flows/retrain.py``): a second run of the same inputs that waited for the pool finds the first
one's record, instead of the one before it, and does not train the same data again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from backends.blob import container_client
from backends.image import content_tag
from backends.share import collect_files, file_sha256, tree_digest
from backends.target import PROJECT_ROOT
from backends.taskspec import NOT_SHAPING_THE_MODEL, training_task_digest
from core.config import PipelineConfig
from core.data_versions import DataVersion
from core.links import output_link
from core.run import Run
from core.text import markdown_text
from registry.champion import champion_for
from registry.last_run import LastRun, blob_exists, read_last_run, read_trained, write_last_run
from registry.layout import LAST_RUN
from registry.migrate import migrate_legacy_records
from tasks.provision import SCRIPT_PACKAGES
from tasks.steps import Done, StepRecord, step
from tasks.validate import Validated

# What a fingerprint's fields are called in a sentence.
FIELD_NAMES = {
    "data_version": "data version",
    "code_version": "code version",
    "task": "training task (what the nodes run: backends/taskspec.py)",
    "image": "training image",
    "processes": "number of training processes",
}


def fingerprint(config: PipelineConfig, data_version: str) -> dict[str, Any]:
    """Everything the trained model depends on: the data (the gate's listing: each blob's name,
    size, ETag and MD5), the code the nodes run (the same digest upload-scripts reports), the
    training task that code is started with, the training image, the settings (but those that
    change no weight, such as the timeline) and the world size (the learning rate scales with
    it).

    A retrain that follows the champion (``training.follow_champion``) is compared without its
    starting weights: the champion is this pipeline's own output, so a version the champion was
    already trained on with the same code and recipe is up to date, not a new input each time a
    run is promoted. A starting point named explicitly (``init_from``) is an input like the
    data."""
    if config.training.follow_champion:
        training = dataclasses.replace(config.training, init_from=None)
        config = config.model_copy(update={"training": training})
    files = collect_files(PROJECT_ROOT, SCRIPT_PACKAGES)
    settings = dataclasses.asdict(config.training)
    for name in (*NOT_SHAPING_THE_MODEL, "follow_champion"):
        settings.pop(name, None)
    return {
        "data_version": data_version,
        "code_version": tree_digest({rel: file_sha256(path) for rel, path in files.items()}),
        "task": training_task_digest(config),
        "image": content_tag(PROJECT_ROOT),
        # As JSON would store it, so a record read back compares equal.
        "training": json.loads(json.dumps(settings, default=str)),
        "processes": config.pool.nodes * config.pool.processes_per_node,
    }


def _data_label(data: dict[str, Any] | None, listing: Any) -> str:
    """A data version as a person reads it: its name (or root) and its listing's digest."""
    if not data:
        return str(listing)
    name = data.get("version") or f"{data.get('root') or '(container)'} (no versions)"
    return f"{name} (listing {listing})"


def differences(
    last: dict[str, Any],
    current: dict[str, Any],
    data: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
) -> list[str]:
    """What changed since ``last``, in words (empty when nothing did); ``data``: the data
    version records (before, now), which name the versions."""
    changed = []
    settings = current.get("training") != last.get("training")
    for name, value in current.items():
        before = last.get(name)
        if name == "task" and settings:
            continue  # the settings changed the task's command line: they are named below
        if name == "data_version" and before != value:
            changed.append(
                f"data version {_data_label(data[0], before)} -> {_data_label(data[1], value)}"
            )
        elif name == "training" and isinstance(before, dict):
            for field, setting in value.items():
                if before.get(field) != setting:
                    changed.append(f"training.{field} {before.get(field)!r} -> {setting!r}")
        elif before != value:
            changed.append(f"{FIELD_NAMES.get(name, name)} {before} -> {value}")
    return changed


def _same(current: dict[str, Any], run: LastRun, data: dict[str, Any] | None) -> str:
    return (
        f"data version {_data_label(data, current['data_version'])}, code version "
        f"{current['code_version']}, training image and settings are those of run "
        f"{run.run_id} (finished {run.finished_at}, test accuracy {run.accuracy:.4f}), whose "
        f"model {run.model} exists; nothing was provisioned. Run with force=true to train "
        "anyway"
    )


def decide(
    current: dict[str, Any],
    last: LastRun | None,
    unusable: str | None,
    model_exists: bool,
    force: bool,
    earlier: LastRun | None = None,
    data: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """(up to date, why), the reason written for the person reading the run's summary.
    ``earlier``: a run before the last that trained exactly ``current``, whose model exists;
    ``data``: this run's data version record, which names it."""
    if force:
        return False, "force is set: training again whatever the last run was"
    if last is not None and not differences(last.fingerprint, current) and model_exists:
        return True, _same(current, last, data)
    if earlier is not None:
        return True, _same(current, earlier, data)
    if last is None:
        return False, unusable or (
            f"no earlier trained run on this data root (its {LAST_RUN} does not exist yet)"
        )
    changed = differences(last.fingerprint, current, (last.data, data))
    if changed:
        return False, f"changed since run {last.run_id}: {'; '.join(changed)}"
    return False, f"the model of run {last.run_id} ({last.model}) no longer exists"


@dataclass(frozen=True)
class UpToDate:
    """Whether the run has anything to train, why, and what it is compared by."""

    fresh: bool  # True: nothing to train
    why: str
    fingerprint: dict[str, Any]
    last: LastRun | None  # the run whose model is in use when fresh; else the last trained run
    data: DataVersion


@step("check-up-to-date")
def check_up_to_date(config: PipelineConfig, data: Validated, force: bool) -> Done[UpToDate]:
    """Compare this run with the runs that trained. ``data`` is what the gate validated (the
    version, and the digest of the listing it pinned), so it is known before anything is
    staged."""
    outputs = container_client(config.output, config.retries.storage_retries)
    base, root = config.output.prefix, config.data.root
    migrate_legacy_records(outputs, base, root, get_run_logger().info)
    current = fingerprint(config, data.listing_version)
    record = data.version.as_record()
    last, unusable = read_last_run(outputs, base, root)
    exists = last is not None and blob_exists(outputs, last.model)
    earlier = None
    if not force and not (last is not None and exists and last.fingerprint == current):
        earlier = read_trained(outputs, base, root, current)
        if earlier is not None and not blob_exists(outputs, earlier.model):
            earlier = None
    fresh, why = decide(current, last, unusable, exists, force, earlier, record)
    matched = (earlier or last) if fresh else last
    get_run_logger().info("%s: %s", "up to date" if fresh else "training", why)
    return Done(
        True,
        UpToDate(fresh, why, current, matched, data.version),
        {
            "up_to_date": fresh,
            "data_version": data.version.label,
            "listing": current["data_version"],
            "code_version": current["code_version"],
            "last_run": last.run_id if last else None,
            "matched_run": matched.run_id if fresh and matched else None,
        },
    )


def remember_run(
    config: PipelineConfig,
    run: Run,
    current: dict[str, Any],
    accuracy: float,
    data: DataVersion | None = None,
) -> None:
    """Called last, once a run's outcome is known (scored, promoted or not, reported): the next
    run compares with it."""
    outputs = container_client(config.output, config.retries.storage_retries)
    write_last_run(
        outputs,
        config.output.prefix,
        config.data.root,
        LastRun(
            run_id=run.id,
            fingerprint=current,
            model=f"{run.output_prefix}/model.pt",
            outputs=run.output_prefix,
            accuracy=accuracy,
            finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
            data=data.as_record() if data else None,
        ),
    )


@task(name="report", cache_policy=NONE)
def report_up_to_date(
    run_id: str,
    steps: list[StepRecord],
    check: UpToDate,
    config: PipelineConfig,
    config_source: str,
) -> dict[str, Any]:
    """The summary of a run that trained nothing: why, and where the current model is. No epoch
    table or throughput: nothing was measured."""
    from tasks.report import config_markdown

    last = check.last
    assert last is not None  # up to date means a last run matched
    outputs = container_client(config.output, config.retries.storage_retries)
    root = config.data.root
    serving = champion_for(outputs, config.output.prefix, root)
    champion = serving.champion
    if champion is not None:
        link = output_link(config.output, outputs, champion.model)
        in_use = (
            f"The model in use is the champion of {markdown_text(root.where)}: "
            f"[{markdown_text(champion.model)}]({link}) from run "
            f"{markdown_text(champion.run_id)} ({champion.metric} {champion.value:.4f})."
        )
        if champion.run_id != last.run_id:
            in_use += (
                f" Run {markdown_text(last.run_id)}, whose data, code and settings these are, "
                "was not promoted: its model is not the one in use."
            )
    else:
        why = f"its record is damaged ({serving.damaged})" if serving.damaged else "none yet"
        in_use = (
            f"No model serves {markdown_text(root.where)}: its champion record "
            f"({markdown_text(serving.blob)}) is {markdown_text(why)}."
        )
    used = f"{champion.model.rsplit('/', 1)[0]}/" if champion else f"{last.outputs}/"
    outputs_url = output_link(config.output, outputs, used)
    lines = [
        f"# Retrain {run_id}: up to date",
        "",
        f"**Nothing to train.** {markdown_text(check.why)}.",
        "",
        in_use,
        "",
        f"**Data:** {markdown_text(check.data.describe())} ({markdown_text(check.data.chosen)}); "
        f"the gate's listing `{check.fingerprint['data_version']}`.",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
        *(f"| {s.step} | {s.status} | {s.seconds:.2f} |" for s in steps),
        "",
        "Estimated cost: 0 node-minutes (no pool was provisioned).",
        "",
        *config_markdown(config, config_source),
    ]
    create_markdown_artifact(
        "\n".join(lines), key="retrain-summary", description=f"retrain {run_id}: up to date"
    )
    return {
        "run_id": run_id,
        "up_to_date": True,
        # The model in use: the data root's champion (the matched run's when there is none).
        "accuracy": champion.score("accuracy") if champion else last.accuracy,
        "promoted": False,
        "reason": f"up to date with run {last.run_id}",
        "matched_run": last.run_id,
        "champion_run": champion.run_id if champion else None,
        "data_version": check.data.version,
        "data": check.data.as_record(),
        "outputs": outputs_url,
        "steps": [s.as_dict() for s in steps],
        "cost": {"rented": False, "total_node_minutes": 0.0, "why": "no pool was provisioned"},
    }
