"""Step 9: the run's Prefect artifacts: a summary, per-class metrics, links to the outputs."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from backends.promotion import Decision
from core.config import PipelineConfig
from tasks.cost import cost_markdown
from tasks.provision import StagedData
from tasks.steps import StepRecord
from tasks.train_and_score import Scored


def config_markdown(config: PipelineConfig, source: str) -> list[str]:
    """The config the run used, whole, and where it came from. It holds no secret: credentials
    are named (an environment variable, a Prefect block), never given; a SAS pasted into a URL
    field by mistake is still shown without its signature."""
    import yaml

    from backends.azure.access import redact

    text = redact(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, width=100))
    return ["## Config", "", f"From {source}.", "", "```yaml", text.rstrip(), "```"]


def summary_markdown(
    run_id: str,
    steps: list[StepRecord],
    scored: Scored,
    decision: Decision,
    data: StagedData,
    config: PipelineConfig | None = None,
    config_source: str = "",
    cost: dict[str, Any] | None = None,
) -> str:
    metrics, score = scored.metrics, scored.score
    lines = [
        f"# Retrain {run_id}",
        "",
        f"**Test accuracy {score['accuracy']:.4f}** on {score['num_images']} images; "
        f"{'**promoted**' if decision.promoted else 'not promoted'}: {decision.reason}.",
        "",
        "## Data",
        "",
        f"{data.files} files, version `{data.version}`: "
        f"{data.downloaded} downloaded, {data.unchanged} unchanged.",
        "",
        "## Steps",
        "",
        "| step | status | seconds | details |",
        "|---|---|---|---|",
    ]
    for s in steps:
        details = ", ".join(
            f"{k}={v}" for k, v in s.details.items() if not isinstance(v, (dict, list))
        )
        lines.append(f"| {s.step} | {s.status} | {s.seconds:.2f} | {details} |")
    lines += ["", *epochs_markdown(steps, metrics)]
    lines += ["", *cost_markdown(cost)]
    if config is not None:
        lines += [*config_markdown(config, config_source)]
    return "\n".join(lines)


def epochs_markdown(steps: list[StepRecord], metrics: dict[str, Any]) -> list[str]:
    """The epochs this run trained and their throughput; none when it trained none (a resumed,
    finished checkpoint): figures from an earlier run would read as this run's."""
    training = next((s for s in steps if s.step == "run-training"), None)
    ran = set(training.details.get("epochs_run") or []) if training else set()
    if not ran:
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
) -> str:
    score = scored.score
    create_markdown_artifact(
        summary_markdown(run_id, steps, scored, decision, data, config, config_source, cost),
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
    for name in ("model.pt", "metrics.json", "score.json", "logs/stdout.txt"):
        # A key per output, so the artifacts list tells the links apart (each run adds a
        # version of the same four keys: the latest is the current run's).
        create_link_artifact(
            f"{outputs_url}/{name}",
            link_text=name,
            key=f"output-{name.replace('.', '-').replace('/', '-').replace('_', '-').lower()}",
            description=f"retrain {run_id}: {name}",
        )
    return outputs_url
