"""Render the benchmarks' JSON results as ``docs/performance.md``.

Every sentence with a number is computed from the results, so the page cannot drift from what
was measured. GPU results (``docs/bench-gpu/*.json``) are kept in the repository because most
machines that run ``make bench`` have no GPU; they are shown with their own machine and date.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_RESULTS = ROOT / "docs" / "bench-gpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return f"{pages * size / 2**30:.0f} GiB"
    except (ValueError, OSError):
        return "unknown memory"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, {_memory_gib()}; {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}, torch {_version('torch')}, "
        f"prefect {_version('prefect')}, azure-storage-blob {_version('azure-storage-blob')}, "
        f"horovod {_version('horovod')}"
    )


def _per_sec(n: float) -> str:
    return f"{n:,.1f}" if n < 10 else f"{n:,.0f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def staging(r: dict[str, Any]) -> list[str]:
    rows = [
        "| part | files | size | staging step | naive sequential | `cp -r` (ceiling) "
        "| staging / naive | staging / `cp -r` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in [*r["parts"].items(), ("all", r["total"])]:
        cells = [
            f"{p[k]['seconds']:.2f} s ({_per_sec(p[k]['files_per_sec'])} files/s, "
            f"{p[k]['mb_per_sec']:,.0f} MB/s)"
            for k in ("staging", "naive_sequential", "cp_r")
        ]
        rows.append(
            f"| {name} | {p['files']:,} | {_mb(p['bytes'])} | {' | '.join(cells)} "
            f"| {p['staging_over_naive']:.2f}x | {p['staging_fraction_of_cp']:.3f} |"
        )
    same, changed, pack = r["resync_unchanged"], r["resync_one_percent"], r["first_pack"]
    return [
        "## Staging: Blob to the data folder (`bench/staging.py`)",
        "",
        f"Method: {r['method']}. Each figure is one pass in the same run, in this order: the",
        "staging step's sync, the naive loop (`list_blobs`, then `download_blob().readall()` per",
        "blob, one at a time), then `cp -r` of the staged folder. 'staging / naive' is how many",
        "times faster the step is; 'staging / `cp -r`' is the fraction of the local-copy ceiling",
        "it reaches.",
        "",
        *rows,
        "",
        *_cpu_bound(r),
        f"Packing the small images into shards (first time): {pack['images']:,} images decoded "
        f"in {pack['seconds']:.2f} s ({pack['images'] / max(pack['seconds'], 1e-9):,.0f} "
        f"images/s), {pack['shards']} shard file(s), {_mb(pack['bytes'])}.",
        "",
        "| incremental re-sync (the whole dataset) | seconds | downloaded | shards |",
        "|---|---:|---:|---|",
        f"| nothing changed | {same['seconds']:.2f} | {same['downloaded']} | {same['shards']} |",
        f"| 1% of the small files changed ({changed['changed_blobs']} blobs) "
        f"| {changed['seconds']:.2f} | {changed['downloaded']} | repacked in "
        f"{changed['pack_seconds']:.2f} s: {changed['decoded']} decoded, "
        f"{changed['reused']:,} rows reused |",
        "",
    ]


def _cpu_bound(r: dict[str, Any]) -> list[str]:
    """Where the small files' time goes: the client's own CPU per file against the wall."""
    small = r["parts"]["small"]
    cpu = small.get("client_cpu_ms_per_file")
    if not cpu:
        return []
    wall = 1000 / small["staging"]["files_per_sec"]
    return [
        f"Small files: the storage client alone spends {cpu['staging']:.2f} ms of CPU per "
        f"file in the staging step and {cpu['naive_sequential']:.2f} ms in the naive loop, "
        f"against {wall:.2f} ms of wall time per file for the step on {r.get('cores', '?')} "
        "cores that Azurite shares. The transfer is bound by per-request CPU (the SDK's "
        "request pipeline, the emulator's request handling), not by bytes; the step's extra "
        f"{cpu['staging'] - cpu['naive_sequential']:.2f} ms is its own work per file and its "
        f"{r['workers']} threads contending for one interpreter lock, and threads gain only "
        "what CPU is left to overlap. On Azure a request also waits on the network, which the "
        "step's threads overlap and the naive loop does not.",
        "",
    ]


def loading(r: dict[str, Any], heading: str) -> list[str]:
    rates = r["images_per_sec"]
    columns = list(next(iter(rates.values())))
    rows = [
        "| read from | start-up (`open_dataset`) | "
        + " | ".join(c.replace("workers_", "loader workers: ") for c in columns)
        + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for name, per in rates.items():
        rows.append(
            f"| {name} | {r['open_seconds'][name]:.2f} s | "
            + " | ".join(f"{per[c]:,.0f} images/s" for c in columns)
            + " |"
        )
    lines = [
        heading,
        "",
        f"Machine: {r['machine']}. Method: {r['method']}.",
        "",
        *rows,
        "",
        f"Shards deliver {r['shards_over_loose']}x the images/s of loose files (best loader "
        f"setting of each), and start {r['open_loose_over_shards']}x faster (loose start-up "
        f"decodes every image to find damaged ones; packing already did). Packing cost "
        f"{r['pack']['seconds']:.2f} s ({r['pack']['images_per_sec']:,.0f} images/s), once per "
        "data version.",
    ]
    if "gpu" in r:
        g = r["gpu"]
        lines += [
            "",
            f"What the GPU consumes: {g['model']} on {g['device']} trains "
            f"{g['images_per_sec']:,.0f} images/s at this size on batches already on the device; "
            f"loose files feed {max(rates['loose'].values()) / g['images_per_sec']:.2f} of that, "
            f"shards {max(rates['shards'].values()) / g['images_per_sec']:.2f}.",
        ]
    return [*lines, ""]


def trainer(r: dict[str, Any], heading: str) -> list[str]:
    return [
        heading,
        "",
        f"Machine: {r['machine']}. Method: {r['method']}.",
        "",
        "| read from | training images/s | wall (start-up and evaluation included) |",
        "|---|---:|---:|",
        *(
            f"| {name} | {r[name]['images_per_sec']:,.0f} | {r[name]['wall_seconds']:.1f} s |"
            for name in ("loose", "shards")
        ),
        "",
        f"Shards train at {r['shards_over_loose_images_per_sec']}x the images/s of loose files; "
        f"the loose run takes {r['loose_over_shards_wall']}x the wall time. Test loss "
        f"{r['loose']['test_loss']:.3g} from loose files, {r['shards']['test_loss']:.3g} from "
        f"shards; {_sameness(r)}.",
        "",
    ]


def _sameness(r: dict[str, Any]) -> str:
    if "identical_samples" in r:
        return (
            f"{r['identical_samples']} of {r['samples_checked']} random training samples "
            "checked are bit-identical in both copies"
        )
    return "the two runs ended with bit-identical test losses" if r.get("same_test_loss") else ""


def pipeline(r: dict[str, Any]) -> list[str]:
    runs = {"first run": r["first_run"], "re-run, nothing changed": r["rerun_unchanged"]}
    rows = ["| | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]

    def row(label: str, fmt: Any) -> None:
        # An up-to-date re-run has no training DAG: its cells for those figures are "-".
        cells = []
        for v in runs.values():
            try:
                cells.append(fmt(v))
            except (KeyError, TypeError):
                cells.append("-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    row("wall (flow run start to end)", lambda v: f"{v['wall_seconds']:.2f} s")
    row("sum of step times", lambda v: f"{v['sum_of_steps_seconds']:.2f} s")
    row("critical path", lambda v: f"{v['critical_path_seconds']:.2f} s")
    row(
        "orchestration overhead (wall - critical path)",
        lambda v: (
            f"{v['orchestration_overhead_seconds']:.2f} s "
            f"({100 * v['overhead_fraction_of_wall']:.1f}%)"
        ),
    )
    row(
        "steps 2-5: summed / span / speed-up",
        lambda v: (
            f"{v['steps_2_to_5']['sum_seconds']:.2f} / "
            f"{v['steps_2_to_5']['span_seconds']:.2f} s / {v['steps_2_to_5']['speedup']}x"
        ),
    )
    row(
        "outside the flow run (API start, set-up)",
        lambda v: f"{v['outside_flow_run_seconds']:.2f} s",
    )
    steps = list(r["first_run"]["steps"])
    for step in steps:
        row(f"step: {step}", lambda v, s=step: f"{v['steps'][s]:.2f} s")
    slowest = max(r["rerun_unchanged"]["steps"].items(), key=lambda kv: kv[1])
    first, again = r["first_run"]["wall_seconds"], r["rerun_unchanged"]["wall_seconds"]
    up_to_date = (
        f"The re-run with nothing changed was up to date: it ended after the data gate, with "
        f"no pool, staging, training or scoring, in {again / first:.2f}x the first run's wall "
        "time. "
        if r["rerun_unchanged"].get("up_to_date")
        else ""
    )
    start = r["startup"]
    return [
        "## The pipeline (`bench/pipeline.py`)",
        "",
        f"Method: {r['method']}. The critical path is the longest chain through the flow's DAG",
        "(validate, then scripts / data / image / pool concurrently, then train, score, promote,",
        "release, report) with the measured step durations.",
        "",
        *rows,
        "",
        f"Critical path of the first run: {' -> '.join(r['first_run']['critical_path'])}. "
        f"{up_to_date}The slowest step of the re-run is {slowest[0]} ({slowest[1]:.2f} s).",
        "",
        f"Start-up: `python -m flows.retrain --help` takes {start['help_seconds']:.2f} s against "
        f"{start['import_prefect_seconds']:.2f} s for `import prefect` alone "
        f"({start['help_over_import_prefect']}x) and {start['bare_python_seconds']:.2f} s for "
        "a bare interpreter; heavy libraries loaded by the flow module: "
        f"{', '.join(start['heavy_modules_loaded_by_flow_module']) or 'none'}.",
        "",
    ]


def train_throughput(r: dict[str, Any]) -> list[str]:
    if "images_per_sec_per_gpu" in r:
        return [
            f"- {r['machine']}: {r['method']}; {r['gpus']} GPU(s): "
            f"{r['images_per_sec_per_gpu']:,.0f} +- {r['images_per_sec_per_gpu_ci95']:,.0f} "
            f"images/s per GPU, {r['images_per_sec_total']:,.0f} in total.",
            "",
        ]
    return [
        f"Method: {r['method']}.",
        "",
        "| loop | images/s | ratio |",
        "|---|---:|---:|",
        f"| plain PyTorch, one process | {r['plain_images_per_sec']:,.0f} | 1 |",
        f"| trainer under `horovodrun -np 1` | {r['horovod_np1_images_per_sec']:,.0f} | "
        f"{r['horovod_np1_over_plain']:.3f} of plain |",
        f"| trainer under `horovodrun -np 2` | {r['horovod_np2_images_per_sec']:,.0f} | "
        f"{r['horovod_np2_over_np1']:.3f} of np 1 |",
        "",
    ]


def nodes(r: dict[str, Any]) -> list[str]:
    heading = ["## Training across hosts (`bench/nodes.py`)", ""]
    if "not_run" in r:
        return [*heading, f"Not measured on this machine: {r['not_run']}.", ""]
    rows = [
        "| shape | training images/s | launch overhead | coordination command | wall (trainer) "
        "| test accuracy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in r["shapes"].items():
        rows.append(
            f"| {name} | {v['images_per_sec']:,.0f} | {v['launch_overhead_seconds']:.2f} s "
            f"| {v['coordination_seconds']:.2f} s | {v['wall_seconds']:.1f} s "
            f"| {v['test_accuracy']:.3f} |"
        )
    overhead = r["launch_overhead_seconds"]
    load = r.get("load_average_5min")
    busy = f" Load average at the end: {load} (other work on the machine)." if load else ""
    return [
        *heading,
        f"Machine: {r['machine']}.{busy} Method: {r['method']}.",
        "Emulated Batch nodes: each a network namespace with its own eth0 on a shared bridge,",
        "host name, process tree and cores; the",
        "training task the pipeline sends to Batch, prepared by `prepare_node.sh` on every node",
        "and started by `launch.sh` on the first. Launch overhead: from the application command's",
        "start to rank 0's first optimizer step (interpreter and library start-up, SSH to the",
        "other node, Horovod's rendezvous, data loading). The coordination command (checks, the",
        "sshd) runs before it on every node.",
        "",
        *rows,
        "",
        f"2 nodes x 1 process train at {r['two_nodes_over_one_images_per_sec']}x the images/s of "
        "1 node x 2 processes on the same cores: the allreduce crosses the network stack (Gloo "
        "over TCP on eth0 and the bridge) instead of loopback. The bridge adds no wire latency, "
        "so between real nodes the gap is wider. Launch overhead: "
        f"{overhead['1 node']:.2f} s on 1 node, {overhead['2 nodes']:.2f} s on 2.",
        "",
    ]


def render(results: Path) -> str:
    def load(name: str) -> dict[str, Any] | None:
        path = results / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    lines = [
        "# Performance",
        "",
        f"Written by `make bench` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        f"Machine: {machine()}.",
        "",
        "Method: every comparison is measured side by side in one run on one machine, and read",
        "as a ratio: absolute times on a shared machine move by tens of percent between runs.",
        "Blob storage is Azurite on loopback, so there is no network latency and the storage",
        "service shares the CPU with the client; on Azure the per-request latency is higher and",
        "the parallel paths gain more. `python -m bench` (what `make bench` runs) regenerates",
        "this page; each benchmark also runs on its own (`python -m bench.<name> --help`).",
        "",
    ]
    if (r := load("staging")) is not None:
        lines += staging(r)
    if (r := load("loading")) is not None:
        lines += loading(
            r, "## Data loading: loose files against packed shards (`bench/loading.py`)"
        )
    if (r := load("trainer")) is not None:
        lines += trainer(r, "## The trainer on loose files and on shards (`bench/trainer.py`)")
    if (r := load("pipeline")) is not None:
        lines += pipeline(r)
    if (r := load("train_throughput")) is not None:
        lines += ["## Training throughput (`bench/train_throughput.py`)", "", *train_throughput(r)]
    if (r := load("nodes")) is not None:
        lines += nodes(r)
    gpu = sorted(GPU_RESULTS.glob("*.json")) if GPU_RESULTS.is_dir() else []
    if gpu:
        lines += [
            "## On a GPU",
            "",
            "Kept from a run on a GPU machine (`docs/bench-gpu/`); `make bench` there refreshes",
            "them. Each says its own machine and method.",
            "",
        ]
        for path in gpu:
            r = json.loads(path.read_text())
            stamp = r.get("date", "date not recorded")
            if r["benchmark"] == "loading":
                lines += loading(r, f"### Data loading, {r['method'].split(', ')[0]} ({stamp})")
            elif r["benchmark"] == "trainer":
                lines += trainer(r, f"### The trainer on loose files and on shards ({stamp})")
            else:
                lines += [f"### {r['benchmark']} ({stamp})", "", *train_throughput(r)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m bench.report RESULTS_DIR OUTPUT.md", file=sys.stderr)
        return 2
    results, output = Path(args[0]), Path(args[1])
    text = render(results)
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(text)
    tmp.replace(output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
