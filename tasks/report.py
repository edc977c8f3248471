"""Step 9: the run's Prefect artifacts: a summary with its pictures, each picture as an artifact of
its own (shown on the run's Artifacts tab without opening the summary), per-class metrics, links
to the outputs. The pictures are also saved with the outputs, under ``<output prefix>/charts/``."""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_image_artifact,
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NONE

from backends.blob import container_client
from core.config import PipelineConfig, hide_credentials
from core.data_versions import DataVersion
from core.links import output_link
from core.run import output_prefix
from core.text import code_fence, markdown_text
from registry.promotion import Decision
from tasks.charts import confusion_png, curves_png
from tasks.cost import cost_markdown
from tasks.provision import StagedData
from tasks.steps import StepRecord
from tasks.train_and_score import Scored

if TYPE_CHECKING:
    from tasks.tracking import TrackingSummary


def config_markdown(config: PipelineConfig, source: str) -> list[str]:
    """The config the run used, whole, and where it came from. It holds no secret: credentials
    are named (an environment variable, a Prefect block), never given; a SAS pasted into a URL
    field by mistake is still shown without its signature."""
    import yaml

    from backends.azure.access import redact

    text = redact(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, width=100))
    shown = markdown_text(hide_credentials(source))
    return ["## Config", "", f"From {shown}.", "", *code_fence(text.rstrip(), "yaml")]


def tracking_lines(tracking: TrackingSummary | None) -> list[str]:
    """The summary's lines on MLflow: where the run and its experiment's runs are, and each
    repair of the registry (a stale ``champion`` alias moved, ...)."""
    if tracking is None:
        return []
    lines = []
    if tracking.run_link:
        runs = (
            f", among [the experiment's runs]({tracking.runs_link})" if tracking.runs_link else ""
        )
        lines += [f"Tracked in MLflow: [the run's page]({tracking.run_link}){runs}.", ""]
    if tracking.notes:
        lines += ["MLflow put back in line with the champion record:", ""]
        lines += [f"- {markdown_text(note)}" for note in tracking.notes] + [""]
    return lines


def summary_markdown(
    run_id: str,
    steps: list[StepRecord],
    scored: Scored,
    decision: Decision,
    data: StagedData,
    config: PipelineConfig | None = None,
    config_source: str = "",
    cost: dict[str, Any] | None = None,
    charts: Charts | None = None,
    version: DataVersion | None = None,
    tracking: TrackingSummary | None = None,
) -> str:
    """``tracking``: the run's page on the MLflow server and the experiment's runs (a tracking
    URI never carries a credential: the config refuses one), and what the run put back in line
    with the champion record there."""
    metrics, score = scored.metrics, scored.score
    lines = [
        f"# Retrain {run_id}",
        "",
        f"**Test accuracy {score['accuracy']:.4f}** on {score['num_images']} images; "
        f"{'**promoted**' if decision.promoted else 'not promoted'}: "
        f"{markdown_text(decision.reason)}.",
        "",
        *tracking_lines(tracking),
        *charts_markdown(charts or Charts()),
        "",
        "## Data",
        "",
        *data_lines(version),
        f"{data.files} files staged (their digest `{data.version}`): "
        f"{data.downloaded} downloaded, {data.unchanged} unchanged.",
        "",
        *steps_markdown(steps),
    ]
    lines += ["", *training_markdown(steps, metrics)]
    lines += ["", *epochs_markdown(steps, metrics)]
    lines += ["", *cost_markdown(cost)]
    if config is not None:
        lines += [*config_markdown(config, config_source)]
    return "\n".join(lines)


def steps_markdown(steps: list[StepRecord]) -> list[str]:
    """Each step's status and time in a table, and what it found in a list below it. The
    Prefect UI draws a table's columns at fixed widths and cuts a cell's text at its edge, never
    wrapping it: the details (paths, links, digests) in a column of their own showed a few
    words of each. A list item wraps."""
    lines = [
        "## Steps",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
        *(f"| {s.step} | {s.status} | {s.seconds:.2f} |" for s in steps),
    ]
    found = []
    for s in steps:
        details = ", ".join(
            f"{k}={v}" for k, v in s.details.items() if not isinstance(v, (dict, list))
        )
        if details:
            found.append(f"- `{s.step}`: {markdown_text(details)}")
    if found:
        lines += ["", "What each step found:", "", *found]
    return lines


def data_lines(version: DataVersion | None) -> list[str]:
    """Which data version the run trained, and why that one."""
    if version is None:
        return []
    return [
        f"Trained on {markdown_text(version.describe())} ({markdown_text(version.chosen)}).",
        "",
    ]


def early_stop_sentence(stop: dict[str, Any]) -> str:
    """How long the training ran, what it watched, and which epoch's model it kept."""
    trained, cap, kept = stop.get("epochs_trained"), stop.get("epoch_cap"), stop.get("kept_epoch")
    if stop.get("split") is None:
        return (
            f"No early stop ({stop.get('why')}): {trained} of {cap} epochs trained; the model is "
            "the last epoch's."
        )
    metric, best = stop.get("metric"), stop.get("best_value")
    shown = f" ({metric} {best:.4f})" if isinstance(best, int | float) else ""
    watched = f"the {metric} on {stop.get('why')}"
    if stop.get("stopped_early"):
        return (
            f"Stopped early after epoch {trained} of at most {cap}: {watched} had not improved "
            f"for {stop.get('patience')} epochs. The model kept is epoch {kept}'s{shown}."
        )
    return (
        f"Trained {trained} of at most {cap} epochs, watching {watched}. The model kept is "
        f"epoch {kept}'s{shown}."
    )


def training_markdown(steps: list[StepRecord], metrics: dict[str, Any]) -> list[str]:
    """The settings fitted to the data, each with why, and where the training stopped."""
    lines: list[str] = []
    fit = next((s for s in steps if s.step == "fit-to-data"), None)
    fitted = fit.details.get("settings") if fit else None
    if fitted:
        lines += ["Fitted to the data:", "", *(f"- {markdown_text(str(x))}" for x in fitted), ""]
    stop = metrics.get("early_stopping")
    if isinstance(stop, dict):
        lines.append(markdown_text(early_stop_sentence(stop)))
    return ["## Training", "", *lines] if lines else []


def epochs_run(steps: list[StepRecord]) -> set[int]:
    """The epochs this run trained (none when it resumed a finished checkpoint)."""
    training = next((s for s in steps if s.step == "run-training"), None)
    return set(training.details.get("epochs_run") or []) if training else set()


def epochs_markdown(steps: list[StepRecord], metrics: dict[str, Any]) -> list[str]:
    """The epochs this run trained and their throughput; none when it trained none (a resumed,
    finished checkpoint): figures from an earlier run would read as this run's."""
    ran = epochs_run(steps)
    if not ran:
        training = next((s for s in steps if s.step == "run-training"), None)
        resumed = training.details.get("resumed_from_epoch") if training else None
        return [
            "## Epochs",
            "",
            f"No epoch was trained in this run: it resumed the finished checkpoint of epoch "
            f"{resumed}, and the model was exported from it. Throughput was not measured.",
        ]
    lines = [
        "## Epochs",
        "",
        "| epoch | train loss | train accuracy | val accuracy | images/s |",
        "|---|---|---|---|---|",
    ]
    for e in metrics["epochs"]:
        if e["epoch"] not in ran:
            continue  # trained before the checkpoint this attempt resumed: not measured here
        val = f"{e['val_accuracy']:.4f}" if "val_accuracy" in e else "-"
        lines.append(
            f"| {e['epoch']} | {e['train_loss']:.4f} | {e['train_accuracy']:.4f} | {val} "
            f"| {e['images_per_sec']:.0f} |"
        )
    return [
        *lines,
        "",
        f"{metrics['world_size']} training processes, {metrics['images_per_sec']:.0f} "
        f"images/s in total, {metrics['images_per_sec_per_worker']:.0f} per worker.",
    ]


CHART_TITLES = {
    "curves.png": "loss and accuracy per epoch",
    "confusion.png": "confusion matrix on the test split",
}


@dataclass(frozen=True)
class Charts:
    """The run's pictures by file name, and those that could not be drawn, with why."""

    drawn: dict[str, bytes] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)


def draw_charts(scored: Scored, steps: list[StepRecord]) -> Charts:
    """The run's pictures, by file name. No curves for a run that trained no epoch: like the
    epochs table, they would show figures an earlier run measured as this run's.

    A picture that cannot be drawn (whatever the reason: the figures it needs are malformed,
    matplotlib fails on some text) is left out and named, with why: the figures themselves are
    already recorded (metrics.json, score.json, the summary's tables), and a picture of them
    must never fail a run whose model is trained, scored and promoted."""
    score = scored.score
    wanted: dict[str, Callable[[], bytes]] = {}
    if epochs_run(steps) and scored.metrics.get("epochs"):
        wanted["curves.png"] = lambda: curves_png(scored.metrics["epochs"])
    wanted["confusion.png"] = lambda: confusion_png(score["confusion_matrix"], score["class_names"])
    charts = Charts()
    for name, draw in wanted.items():
        try:
            charts.drawn[name] = draw()
        except Exception as exc:  # any failure: the picture is left out, and named
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            charts.left_out[name] = (
                f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            )
    return charts


def charts_markdown(charts: Charts) -> list[str]:
    """The pictures embedded in the summary as ``data:`` URIs (the Prefect UI shows them): a link
    to the copy in private Blob storage would only open with a signature, and artifacts never
    carry one. A picture left out is named, with why."""
    lines: list[str] = []
    for name, png in charts.drawn.items():
        lines += [embedded(name, png), ""]
    if charts.drawn:
        saved = " and ".join(f"`charts/{name}`" for name in charts.drawn)
        lines.append(f"The pictures are saved with the run's outputs as {saved}.")
    for name, why in charts.left_out.items():
        title = CHART_TITLES.get(name, name)
        lines += ["", f"The {title} could not be drawn ({markdown_text(why)}): left out."]
    return lines


def embedded(name: str, png: bytes) -> str:
    """A picture as Markdown that carries its own bytes (a ``data:`` URI)."""
    title = CHART_TITLES.get(name, name)
    return f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})"


def chart_key(name: str) -> str:
    """The artifact key of a picture: ``chart-curves``, ``chart-confusion``."""
    return f"chart-{name.rsplit('.', 1)[0]}"


def chart_artifact(config: PipelineConfig, run_id: str, name: str, png: bytes, link: str) -> None:
    """A picture as an artifact of its own, so the run's Artifacts tab lists it beside the
    summary. With ``output.links_url`` it is an image artifact of the copy in the run's outputs
    (the gateway serves it); without, a link to private Blob storage would show a broken image
    (it needs a sign-in, and no artifact carries a signature), so the picture is embedded in a
    Markdown artifact instead."""
    title = f"retrain {run_id}: {CHART_TITLES.get(name, name)}"
    if config.output.links_url:
        create_image_artifact(link, key=chart_key(name), description=title)
    else:
        create_markdown_artifact(embedded(name, png), key=chart_key(name), description=title)


def upload_charts(config: PipelineConfig, run_id: str, charts: dict[str, bytes]) -> list[str]:
    """Each picture into the run's outputs, next to the model and metrics it was drawn from."""
    from azure.storage.blob import ContentSettings

    outputs = container_client(config.output, config.retries.storage_retries)
    prefix = output_prefix(config.output.prefix, run_id)
    names = []
    for name, png in charts.items():
        blob = f"{prefix}/charts/{name}"
        outputs.upload_blob(
            blob, png, overwrite=True, content_settings=ContentSettings(content_type="image/png")
        )
        names.append(blob)
    return names


def link_description(config: PipelineConfig, run_id: str, name: str) -> str:
    """How a link opens, and the command that gets the file without it. The UI renders a
    description as Markdown: each command is a code span, so it shows as typed (outside one,
    ``<the config>`` would be read as an HTML tag and vanish)."""
    how = (
        "opens while `python -m cli.models --config <the config> serve` runs"
        if config.output.links_url
        else "needs the storage account's sign-in (set output.links_url and run "
        "`python -m cli.models --config <the config> serve` for links that open)"
    )
    what = name or "the run's outputs folder"
    get = (
        f"; to download it: `python -m cli.models --config <the config> download --run "
        f"{run_id} --file {name}`"
        if name
        else ""
    )
    return f"retrain {run_id}: {what}. The link {how}{get}"


@task(name="report", cache_policy=NONE)
def report(
    run_id: str,
    steps: list[StepRecord],
    scored: Scored,
    decision: Decision,
    data: StagedData,
    outputs_url: str,
    config: PipelineConfig,
    config_source: str,
    cost: dict[str, Any] | None = None,
    version: DataVersion | None = None,
    tracking: TrackingSummary | None = None,
) -> str:
    """``tracking``: the run's MLflow page and the experiment's runs, linked from the summary,
    and what the run repaired in MLflow's registry."""
    score = scored.score
    charts = draw_charts(scored, steps)
    for name, why in charts.left_out.items():
        get_run_logger().warning("report: %s could not be drawn, left out: %s", name, why)
    outputs = container_client(config.output, config.retries.storage_retries)
    drawn = charts.drawn
    for name, blob in zip(drawn, upload_charts(config, run_id, drawn), strict=True):
        link = output_link(config.output, outputs, blob)
        chart_artifact(config, run_id, name, drawn[name], link)
    create_markdown_artifact(
        summary_markdown(
            run_id,
            steps,
            scored,
            decision,
            data,
            config,
            config_source,
            cost,
            charts,
            version,
            tracking,
        ),
        key="retrain-summary",
        description=f"retrain {run_id}",
    )
    create_table_artifact(
        [
            {"class": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}}
            for name, m in score["per_class"].items()
        ],
        key="per-class-metrics",
        description="precision, recall and F1 on the test split",
    )
    prefix = output_prefix(config.output.prefix, run_id)
    for name in ("model.pt", "metrics.json", "score.json", "logs/stdout.txt", ""):
        # A key per output, so the artifacts list tells the links apart (each run adds a
        # version of the same keys: the latest is the current run's).
        create_link_artifact(
            output_link(config.output, outputs, f"{prefix}/{name}"),
            link_text=name or "all of the run's outputs",
            key=f"output-{name.replace('.', '-').replace('/', '-').replace('_', '-').lower()}"
            if name
            else "outputs",
            description=link_description(config, run_id, name),
        )
    return outputs_url
