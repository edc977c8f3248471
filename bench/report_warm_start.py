"""The warm-start section of docs/performance.md (``bench/warm_start.py``'s results)."""

from __future__ import annotations

from typing import Any

HEADING = "## Warm start against from scratch (`bench/warm_start.py`)"


def _reached(run: dict[str, Any]) -> str:
    if run.get("reached_epoch") is None:
        return "not reached"
    return f"epoch {run['reached_epoch']}, {run['reached_cpu_seconds']:.0f} CPU-s"


def _seed_table(s: dict[str, Any]) -> list[str]:
    rows = [
        f"Seed {s['seed']}: v1's model {s['v1_accuracy']:.3f} on v1's test split "
        f"({s['v1_cpu_seconds']:.0f} CPU-s); the target: {s['target']:.3f}.",
        "",
        "| run | test accuracy after each epoch | reaches the target | CPU-s, whole run |",
        "|---|---|---|---:|",
    ]
    for name, run in s["runs"].items():
        curve = " ".join(f"{a:.3f}" for a in run["accuracy"])
        rows.append(f"| {name} | {curve} | {_reached(run)} | {run['cpu_seconds'][-1]:.0f} |")
    return [*rows, ""]


def _summary(r: dict[str, Any]) -> list[str]:
    """Per variant: over the seeds, how often and when it reached scratch's final accuracy."""
    names = list(r["seeds"][0]["runs"])
    lines = [
        "| run | seeds reaching the target | epochs to reach it, per seed | CPU-s to reach it, "
        "per seed | final accuracy minus the target, per seed |",
        "|---|---:|---|---|---|",
    ]
    for name in names:
        runs = [s["runs"].get(name) for s in r["seeds"]]
        found = [(run, s) for run, s in zip(runs, r["seeds"], strict=True) if run is not None]
        hit = [run for run, _ in found if run["reached_epoch"] is not None]
        epochs = ", ".join(str(run["reached_epoch"] or "-") for run, _ in found)
        cpu = ", ".join(
            f"{run['reached_cpu_seconds']:.0f}" if run["reached_cpu_seconds"] else "-"
            for run, _ in found
        )
        margin = ", ".join(f"{run['accuracy'][-1] - s['target']:+.3f}" for run, s in found)
        lines.append(f"| {name} | {len(hit)}/{len(found)} | {epochs} | {cpu} | {margin} |")
    return [*lines, ""]


def _cost(r: dict[str, Any]) -> list[str]:
    c = r["cost"]
    share = r["epoch_share"]
    lines = [
        f"On paper: {c['images']:,} images, ResNet-50, {c['h100_images_per_sec']:,} images/s "
        f"per H100, {c['scaling']:.0%} scaling across a node's GPUs, warm: {share:.2f} of "
        f"scratch's epochs. Prices: {c['price_source']}.",
        "",
        "| node | $/hour | start | epochs | hours | cost per nightly run |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in c["rows"]:
        lines.append(
            f"| {row['size']} ({row['gpus']} GPU) | {row['price_per_hour']:.2f} | "
            f"{row['start']} | {row['epochs']:g} | {row['hours']:.2f} | "
            f"${row['cost']:,.0f} |"
        )
    return [*lines, ""]


def warm_start(r: dict[str, Any]) -> list[str]:
    return [
        HEADING,
        "",
        f"Machine: {r['machine']}. Method: {r['method']}; seeds "
        f"{', '.join(str(s['seed']) for s in r['seeds'])}. The trainer's default when starting "
        f"from weights: the `{r['default_variant']}` run. How it measures and how to read it: "
        "[benchmarks.md](benchmarks.md#warm-start-against-from-scratch).",
        "",
        *_summary(r),
        *(line for s in r["seeds"] for line in _seed_table(s)),
        *_cost(r),
    ]


FLOW_HEADING = "## Warm start through the flow, as the nightly runs it (`bench/warm_start_flow.py`)"


def warm_start_flow(r: dict[str, Any]) -> list[str]:
    """The flow's side by side: per dataset and seed, scratch's and the warm run's epochs and
    test accuracy on v2 (no training setting given: fitted to the data, stopped early)."""
    flow = r["flow"]
    lines = [
        FLOW_HEADING,
        "",
        "Local target, 2 training processes, no training setting given (input size and epoch "
        "cap fitted to the data, early stopping on the val split or a held-out slice). Per "
        "dataset and seed: v1 from scratch (the champion), v2 as the nightly trains it "
        "(`follow_champion`: the champion's weights and recipe, a third of the fewer of its "
        "epochs and scratch's cap), v2 from scratch. Test accuracy is the flow's score on "
        "v2's test split.",
        "",
        "| dataset | seed | input px | v1 test acc. | scratch: epochs (kept), test acc. | "
        "warm: epochs (kept), test acc. | warm epochs / scratch's | warm reached scratch |",
        "|---|---:|---:|---:|---|---|---:|---|",
    ]
    for run in flow["runs"]:
        s, w = run["scratch"], run["warm"]
        lines.append(
            f"| {run['dataset']} | {run['seed']} | {s['input_size']} | "
            f"{run['v1']['test_accuracy']:.3f} | {s['epochs_trained']} ({s['kept_epoch']}), "
            f"{s['test_accuracy']:.3f} | {w['epochs_trained']} ({w['kept_epoch']}), "
            f"{w['test_accuracy']:.3f} | {run['epoch_share']:.2f} | "
            f"{'yes' if run['reached'] else 'no'} |"
        )
    share = flow["max_epoch_share"]
    lines += [
        "",
        f"Largest share of scratch's epochs a warm run took: "
        f"{share:.2f}; warm runs that reached scratch's final test accuracy: "
        f"{flow['reached']} of {len(flow['runs'])}."
        if share is not None
        else "No run.",
        "",
    ]
    return lines
