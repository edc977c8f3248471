"""Render the benchmarks' JSON results as ``docs/performance.md``: figures and tables only.

Every figure is computed from the results, so the page cannot drift from what was measured; how
each benchmark measures and what its figures decided is prose, kept by hand in
``docs/benchmarks.md``, which each section links. GPU results (``docs/bench-gpu/*.json``) are
kept in the repository because most machines that run ``make bench`` have no GPU; they are
shown with their own machine and date.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import report_systems as systems
from bench.report_warm_start import warm_start, warm_start_flow

ROOT = Path(__file__).resolve().parents[1]
LOADING = "data-loading-and-the-trainer-on-loose-files-and-shards"
GPU_RESULTS = ROOT / "docs" / "bench-gpu"
# A benchmark's section of the page: its heading names its module.
SECTION = re.compile(r"^## .*\(`bench/(\w+)\.py`\)\s*$")
WRITTEN = re.compile(r"^Written by `make bench` on (.+ UTC)\.$", re.MULTILINE)
MACHINE = re.compile(r"^Machine: (.+)\.$", re.MULTILINE)
KEPT = "Not run by the `make bench` that wrote this page: kept as the one of {} wrote it, on {}."


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


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def _paired(m: dict[str, Any], key: str, ours: float, theirs: float, rate: bool = False) -> str:
    """The step against rclone on one measure: the median of each round's ratio where the
    results hold each round's figures (the two tools ran back to back in a round, so a drift
    of the machine's speed over the run cancels), else the ratio of the medians. ``rate``:
    the figures are times and the ratio is of rates (rclone's time over the step's)."""
    step, rc = (m[tool].get("each", {}).get(key) for tool in ("step", "rclone"))
    if not step or not rc or len(step) != len(rc) or not all(step) or not all(rc):
        return _ratio(ours, theirs)
    pairs = [b / a if rate else a / b for a, b in zip(step, rc, strict=True)]
    return f"{statistics.median(pairs):.2f}x"


def _delay(ms: str) -> str:
    return "no delay" if float(ms) == 0 else f"{ms} ms per request"


def _why(anchor: str) -> str:
    """The link to the section of docs/benchmarks.md that says how to read one."""
    return f"How it measures and how to read it: [benchmarks.md](benchmarks.md#{anchor})."


def _figures(rows: list[tuple[str, str]]) -> list[str]:
    """A two-column table of named figures."""
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), ""]


def _first_step(found: dict[str, Any] | None) -> list[str]:
    """Loose files against WebDataset shards of the same images: the stage-data step."""
    if not found:
        return []
    rows = [
        "| new data to the first step (stage + pack) | loose files | tar shards | "
        "packed / loose (time) |",
        "|---|---:|---:|---:|",
    ]
    for ms, m in found["delays"].items():
        loose, packed = m["loose_seconds"], m["packed_seconds"]
        rows.append(
            f"| {m['images']:,} images, {_delay(ms)} | {loose:.2f} s | {packed:.2f} s "
            f"| {_ratio(packed, loose)} |"
        )
    return [
        f"Tar shards: {found['tar_files']} WebDataset shard(s) of about {found['tar_mb']} MB.",
        "",
        *rows,
        "",
    ]


def staging(r: dict[str, Any]) -> list[str]:
    """The step against rclone and ``cp -r``: rates, then the ratios the goal is stated in."""
    cp = r["cp_r"]
    rows = [
        "| | staging step | rclone copy | `cp -r` | step / rclone | step / `cp -r` |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for ms, m in r["small"].items():
        step, rc = m["step"]["files_per_sec"], m["rclone"]["files_per_sec"]
        rows.append(
            f"| small files, {_delay(ms)} | {_per_sec(step)} files/s | {_per_sec(rc)} "
            f"| {_per_sec(cp['small']['files_per_sec'])} | {_paired(m, 'seconds', step, rc, True)} "
            f"| {_ratio(step, cp['small']['files_per_sec'])} |"
        )
    for ms, m in r["large"].items():
        step, rc = m["step"]["mb_per_sec"], m["rclone"]["mb_per_sec"]
        rows.append(
            f"| large files, {_delay(ms)} | {step:,.0f} MB/s | {rc:,.0f} "
            f"| {cp['large']['mb_per_sec']:,.0f} | {_paired(m, 'seconds', step, rc, True)} "
            f"| {_ratio(step, cp['large']['mb_per_sec'])} |"
        )
    for ms, m in r.get("large_apart", {}).items():
        step, rc = m["step"]["mb_per_sec"], m["rclone"]["mb_per_sec"]
        rows.append(
            f"| large files, {_delay(ms)}, Azurite on a core of its own | {step:,.0f} MB/s "
            f"| {rc:,.0f} | | {_paired(m, 'seconds', step, rc, True)} | |"
        )
    for ms, m in r["small"].items():
        step, rc = m["step"]["cpu_ms_per_file"], m["rclone"]["cpu_ms_per_file"]
        rows.append(
            f"| client CPU per small file, {_delay(ms)} | {step:.2f} ms | {rc:.2f} "
            f"| {cp['small']['cpu_ms_per_file']:.3f} "
            f"| {_paired(m, 'cpu_ms_per_file', step, rc)} | |"
        )
    rows += _server_cpu(r)
    for ms, m in r["large"].items():
        step, rc = m["step"]["cpu_ms_per_file"], m["rclone"]["cpu_ms_per_file"]
        rows.append(
            f"| client CPU per large file, {_delay(ms)} | {step:,.0f} ms | {rc:,.0f} "
            f"| {cp['large']['cpu_ms_per_file']:,.0f} "
            f"| {_paired(m, 'cpu_ms_per_file', step, rc)} | |"
        )
    for size, cases in (("small", r["small"]), ("large", r["large"])):
        for ms, m in cases.items():
            step, rc = m["step"]["resync_seconds"], m["rclone"]["resync_seconds"]
            files = m["step"].get("files") or m["step"]["seconds"] * m["step"]["files_per_sec"]
            spent, spent_rc = (_resync_cpu(m[tool]) for tool in ("step", "rclone"))
            rows.append(
                f"| re-sync, nothing changed ({files:,.0f} {size} files), {_delay(ms)} "
                f"| {step:.2f} s{spent} | {rc:.2f} s{spent_rc} | "
                f"| {_paired(m, 'resync_seconds', step, rc)} (time) | |"
            )
    changed, pack = r["resync_one_percent"], r["first_pack"]
    return [
        "## Staging: Blob to the data folder (`bench/staging.py`)",
        "",
        f"Method: {r['method']}. Load average during the run: {r.get('load_average', '?')} on "
        f"{r.get('cores', '?')} cores. {_why('staging')}",
        "",
        *rows,
        "",
        *_figures(
            [
                (
                    "packing the small images into shards, first time",
                    f"{pack['images']:,} images decoded in {pack['seconds']:.2f} s "
                    f"({pack['images'] / max(pack['seconds'], 1e-9):,.0f} images/s), "
                    f"{pack['shards']} shard file(s), {_mb(pack['bytes'])}",
                ),
                (
                    f"the nightly case: 1% of the small files changed "
                    f"({changed['changed_blobs']} blobs)",
                    f"the whole step {changed['seconds']:.2f} s, {changed['downloaded']} "
                    f"downloaded, repacked in {changed['pack_seconds']:.2f} s "
                    f"({changed['decoded']} decoded, {changed['reused']:,} rows reused)",
                ),
            ]
        ),
        *_first_step(r.get("first_step")),
        *_large_choices(r.get("large_choices")),
    ]


def _resync_cpu(m: dict[str, Any]) -> str:
    """A re-sync's CPU: the client's, then the server's (results that have them)."""
    cpu, served = m.get("resync_cpu_seconds"), m.get("resync_server_cpu_seconds")
    client = f", {cpu:.2f} s CPU" if cpu is not None else ""
    return client + (f" (server {served:.2f} s)" if served is not None else "")


def _server_cpu(r: dict[str, Any]) -> list[str]:
    """The server's CPU per file while each tool was its client (results that have it)."""
    rows = []
    for size, unit, fmt in (("small", "small file", ".2f"), ("large", "large file", ",.0f")):
        for ms, m in r[size].items():
            step = m["step"].get("server_cpu_ms_per_file")
            rc = m["rclone"].get("server_cpu_ms_per_file")
            if step is None or rc is None:
                continue
            rows.append(
                f"| server CPU per {unit} (Azurite{' and proxy' if float(ms) else ''}), "
                f"{_delay(ms)} | {step:{fmt}} ms | {rc:{fmt}} | "
                f"| {_paired(m, 'server_cpu_ms_per_file', step, rc)} | |"
            )
    return rows


def _large_choices(found: dict[str, Any] | None) -> list[str]:
    """Each large-file choice undone in turn, beside the step as shipped."""
    if not found:
        return []
    rows = [
        "| large files, no delay: alternative | its MB/s | shipped MB/s | alternative / shipped "
        "| CPU per file, alternative | CPU per file, shipped |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, m in found.items():
        alt, ship = m["alternative"], m["shipped"]
        rows.append(
            f"| {label} | {alt['mb_per_sec']:,.0f} | {ship['mb_per_sec']:,.0f} "
            f"| {m['ratio']:.2f}x | {alt['cpu_ms_per_file']:.0f} ms "
            f"| {ship['cpu_ms_per_file']:.0f} ms |"
        )
    return [*rows, ""]


def _listing_ahead(a: dict[str, Any] | None) -> list[str]:
    """The listing's choices, asking for the next page before parsing this one and pausing the
    collector while parsing, each measured against its alternative in the same run."""
    if a is None:
        return []
    ahead, plain = a["ahead"], a["one_after_another"]
    rows = [
        f"The listing's choices: {int(ahead['blobs']):,} blobs ({a['pages']} pages) answered "
        f"{a['page_delay_ms']:g} ms after each request, medians of {a['rounds']} alternating "
        "rounds.",
        "",
        "| listing | wall | CPU | time against the shipped way |",
        "|---|---:|---:|---:|",
        f"| the next page asked for before this one is read (shipped) | {ahead['wall_s']:.1f} s "
        f"| {ahead['cpu_s']:.1f} s | 1 |",
        f"| one page after another | {plain['wall_s']:.1f} s | {plain['cpu_s']:.1f} s "
        f"| {plain['wall_s'] / max(ahead['wall_s'], 1e-9):.2f}x |",
    ]
    running = a.get("collector_running")
    if running is not None:
        rows.append(
            f"| the collector running while a page is read ({a['tracked_objects']:,} objects "
            f"tracked) | {running['wall_s']:.1f} s | {running['cpu_s']:.1f} s "
            f"| {running['cpu_s'] / max(ahead['cpu_s'], 1e-9):.2f}x the CPU |"
        )
    return [*rows, ""]


def gate_scale(r: dict[str, Any]) -> list[str]:
    """The gate's steps on an ImageNet-sized listing, each timed on its own."""
    listing, cached, reads = r["listing"], r["cached_manifest"], r["header_reads"]
    before = listing["wall_s"] + cached["wall_s"]
    big = [e for e in r["expectations"] if "run_expectations" in e][-1]
    expect = big["run_expectations"]["wall_s"] * cached["rows"] / big["rows"]

    def row(step: str, count: str, t: dict[str, Any], extra: str = "") -> str:
        return (
            f"| {step} | {count} | {t['wall_s']:,.1f} s{extra} | {t['cpu_s']:,.1f} s "
            f"| {t['load_average']} | {t['peak_rss_mib_so_far']:,} MiB |"
        )

    rows = [
        "| step | blobs or rows | wall | CPU | load average | peak RSS so far |",
        "|---|---:|---:|---:|---:|---:|",
        row(
            "listing (`list_dataset`)",
            f"{listing['blobs']:,}",
            listing,
            f" ({_per_sec(listing['blobs_per_s'])} blobs/s)",
        ),
        row(
            "`build_manifest`, every image's content in the cache",
            f"{cached['rows']:,}",
            cached,
            f" ({cached['reused']:,} from the cache)",
        ),
    ]
    for e in r["expectations"]:
        if "skipped_predicted_s" in e:
            rows.append(
                f"| `run_expectations` | {e['rows']:,} | not run: {e['skipped_predicted_s']:,} s "
                "predicted from the size before | | | |"
            )
            continue
        rows.append(
            row(
                f"`run_expectations`, {e['classes']:,} classes",
                f"{e['rows']:,}",
                e["run_expectations"],
                f" (`class_counts` alone: {e['class_counts']['wall_s']:,.1f} s)",
            )
        )
    rows.append(
        row(
            f"first gate: a read and a whole decode per image, {reads['images']:,} PNGs of "
            f"~{reads['bytes_each'] / 1024:.0f} KB in Azurite",
            f"{reads['images']:,}",
            reads,
            f" ({_per_sec(reads['reads_per_s'])} reads/s)",
        )
    )
    estimate = r["first_gate_estimate_s"]
    return [
        "## The data gate at ImageNet scale (`bench/gate_scale.py`)",
        "",
        f"Method: {r['method']}. {_why('the-data-gate-at-scale')}",
        "",
        *rows,
        "",
        *_figures(
            [
                (
                    f"a first gate over {listing['blobs']:,} new images at the measured "
                    "read-and-decode rate",
                    f"{estimate:,} s ({estimate / 60:,.0f} min)",
                ),
                (
                    "listing and the cached manifest, against the 5-minute goal",
                    f"{before:,.0f} s ({before / 300:.2f}x the goal)",
                ),
                (
                    f"`run_expectations` at the full {cached['rows']:,} rows, linearly from "
                    f"{big['rows']:,}",
                    f"{expect:,.0f} s",
                ),
                (
                    "the nightly gate as a whole",
                    f"{before + expect:,.0f} s ({(before + expect) / 300:.2f}x the goal)",
                ),
            ]
        ),
        *_listing_ahead(r.get("listing_ahead")),
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
    figures = [
        (
            "shards against loose files, images/s (best loader setting of each)",
            f"{r['shards_over_loose']}x",
        ),
        ("loose files' start-up against the shards'", f"{r['open_loose_over_shards']}x"),
        (
            "packing, once per data version",
            f"{r['pack']['seconds']:.2f} s ({r['pack']['images_per_sec']:,.0f} images/s)",
        ),
    ]
    if "gpu" in r:
        g = r["gpu"]
        figures += [
            (
                f"what the GPU consumes: {g['model']} on {g['device']}",
                f"{g['images_per_sec']:,.0f} images/s",
            ),
            (
                "of which loose files feed / shards feed",
                f"{max(rates['loose'].values()) / g['images_per_sec']:.2f} / "
                f"{max(rates['shards'].values()) / g['images_per_sec']:.2f}",
            ),
        ]
    return [
        heading,
        "",
        f"Machine: {r['machine']}. Method: {r['method']}. {_why(LOADING)}",
        "",
        *rows,
        "",
        *_figures(figures),
    ]


def trainer(r: dict[str, Any], heading: str) -> list[str]:
    return [
        heading,
        "",
        f"Machine: {r['machine']}. Method: {r['method']}. {_why(LOADING)}",
        "",
        "| read from | training images/s | wall (start-up and evaluation included) | test loss |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {r[name]['images_per_sec']:,.0f} | {r[name]['wall_seconds']:.1f} s "
            f"| {r[name]['test_loss']:.3g} |"
            for name in ("loose", "shards")
        ),
        "",
        *_figures(
            [
                (
                    "shards against loose files, images/s",
                    f"{r['shards_over_loose_images_per_sec']}x",
                ),
                ("loose files against shards, wall", f"{r['loose_over_shards_wall']}x"),
                ("the same samples", _sameness(r)),
            ]
        ),
    ]


def _sameness(r: dict[str, Any]) -> str:
    if "identical_samples" in r:
        return (
            f"{r['identical_samples']} of {r['samples_checked']} random training samples "
            "bit-identical in both copies"
        )
    return "bit-identical test losses" if r.get("same_test_loss") else "-"


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
        "the four concurrent steps: summed / span / speed-up",
        lambda v: (
            f"{v['concurrent_steps']['sum_seconds']:.2f} / "
            f"{v['concurrent_steps']['span_seconds']:.2f} s / {v['concurrent_steps']['speedup']}x"
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
    start = r["startup"]
    figures = [
        ("critical path of the first run", " -> ".join(r["first_run"]["critical_path"])),
        (
            "the re-run's wall against the first run's",
            f"{again / first:.2f}x"
            + (" (up to date)" if r["rerun_unchanged"].get("up_to_date") else ""),
        ),
        ("the slowest step of the re-run", f"{slowest[0]} ({slowest[1]:.2f} s)"),
        ("`python -m flows.retrain --help`", f"{start['help_seconds']:.2f} s"),
        (
            "`import prefect` alone",
            f"{start['import_prefect_seconds']:.2f} s "
            f"(--help: {start['help_over_import_prefect']}x)",
        ),
        ("a bare interpreter", f"{start['bare_python_seconds']:.2f} s"),
        (
            "heavy libraries loaded by the flow module",
            ", ".join(start["heavy_modules_loaded_by_flow_module"]) or "none",
        ),
    ]
    return [
        "## The pipeline (`bench/pipeline.py`)",
        "",
        f"Method: {r['method']}. {_why('the-pipeline')}",
        "",
        *rows,
        "",
        *_figures(figures),
    ]


def tracking(r: dict[str, Any]) -> list[str]:
    """What MLflow tracking adds to a run, the order of each pair cancelled out."""
    rows = [
        "| | median untracked | tracked - untracked | order effect | each pair (first run) |",
        "|---|---:|---:|---:|---|",
    ]
    for key, label in (("wall_seconds", "wall"), ("cpu_seconds", "orchestrator CPU")):
        m = r[key]
        share = f" ({100 * m['share']:+.1f}%)" if m["share"] is not None else ""
        order = f"±{abs(m['order_effect']):.2f} s" if m["order_effect"] is not None else "-"
        pairs = ", ".join(
            f"{d:+.2f} ({first})"
            for d, first in zip(m["pair_differences"], m["first_in_pair"], strict=True)
        )
        rows.append(
            f"| {label} | {m['median_untracked']:.2f} s | {m['difference']:+.2f} s{share} "
            f"| {order} | {pairs} |"
        )
    imported = r["import_mlflow"]
    return [
        "## MLflow tracking's cost per run (`bench/tracking.py`)",
        "",
        f"Method: {r['method']}. {_why('mlflow-trackings-cost-per-run')}",
        "",
        *rows,
        "",
        *_figures(
            [
                (
                    "`import mlflow` alone, a fresh interpreter",
                    f"{imported['cpu_seconds']:.2f} s of CPU "
                    f"({imported['wall_seconds']:.2f} s wall)",
                )
            ]
        ),
    ]


def cost_estimate(r: dict[str, Any]) -> list[str]:
    """Each run's estimate beside what it used, and the errors against the peer's."""
    s = r["summary"]
    rows = [
        "| run | data | epochs | past runs | estimate | measured | error | previous run's |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, run in enumerate(r["runs"], 1):
        naive = run.get("previous_run_error")
        rows.append(
            f"| {i} | {run['version']} ({run['images']:,} images) | {run['epochs']} "
            f"| {run['history_runs']} | {run['estimate_node_minutes']:.2f} "
            f"| {run['measured_node_minutes']:.2f} | {run['error']:+.0%} "
            f"| {'-' if naive is None else f'{naive:+.0%}'} |"
        )
    ratio = s["error_ratio_previous_over_estimate"]
    loads = [run["load_average"] for run in r["runs"] if "load_average" in run]
    load = (
        [
            f"Load average after each run: {min(loads):g} to {max(loads):g} (other work on the "
            "machine slows a run in a way no estimate foresees).",
            "",
        ]
        if loads
        else []
    )
    return [
        "## The cost estimate against what runs used (`bench/cost_estimate.py`)",
        "",
        f"Method: {r['method']}. Node-minutes; the error is (estimate - measured) / measured.",
        "The peer is the guess a person makes without the estimator: the node-minutes of the",
        "data root's previous run. Both are scored on the runs after the first (which has no",
        "history: the estimate comes from the config alone).",
        "",
        *rows,
        "",
        f"Over the {s['runs_scored']} runs with history: the estimate's median error "
        f"{s['median_abs_error']:.0%}, largest {s['max_abs_error']:.0%}, "
        f"{s['within_25_percent']} of {s['runs_scored']} within 25%; the previous run's "
        f"figure: median {s['previous_run_median_abs_error']:.0%}, largest "
        f"{s['previous_run_max_abs_error']:.0%}, {s['previous_run_within_25_percent']} within "
        "25%"
        + (f" ({ratio:.1f}x the estimate's median error)." if ratio else ".")
        + f" The first run, from the config alone: {s['first_run_error']:+.0%}.",
        "",
        *load,
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
        *_ddp_rows(r),
        "",
    ]


def _ddp_rows(r: dict[str, Any]) -> list[str]:
    """The DDP engine's rows (reports written before it existed have none)."""
    if "ddp_np1_images_per_sec" not in r:
        return []
    return [
        f"| trainer, `--engine ddp`, `torchrun --nproc-per-node 1` | "
        f"{r['ddp_np1_images_per_sec']:,.0f} | {r['ddp_np1_over_plain']:.3f} of plain |",
        f"| trainer, `--engine ddp`, `torchrun --nproc-per-node 2` | "
        f"{r['ddp_np2_images_per_sec']:,.0f} | {r['ddp_np2_over_np1']:.3f} of np 1, "
        f"{r['ddp_np2_over_horovod_np2']:.3f} of Horovod np 2 |",
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
    busy = f" Load average at the end: {load}." if load else ""
    figures = [
        (
            "2 nodes x 1 process against 1 node x 2 processes, images/s",
            f"{r['two_nodes_over_one_images_per_sec']}x",
        ),
        (
            "launch overhead, 1 node / 2 nodes",
            f"{overhead['1 node']:.2f} s / {overhead['2 nodes']:.2f} s",
        ),
    ]
    if "ddp_two_nodes_over_one_images_per_sec" in r:
        figures += [
            ("DDP: 2 nodes against 1, images/s", f"{r['ddp_two_nodes_over_one_images_per_sec']}x"),
            (
                "DDP against Horovod on 2 nodes, images/s",
                f"{r['ddp_over_horovod_two_nodes_images_per_sec']}x",
            ),
        ]
    return [
        *heading,
        f"Machine: {r['machine']}.{busy} Method: {r['method']}. {_why('training-across-hosts')}",
        "",
        *rows,
        "",
        *_figures(figures),
    ]


def gpu_speed(r: dict[str, Any]) -> list[str]:
    """Each speed switch's images/s per engine, the memory per batch size, the shards run."""
    engines = list(r["engines"])
    head = " | ".join(f"{e}: images/s (sd) | x first" for e in engines)
    lines = [
        f"Machine: {r['machine']}. Method: {r['method']}. {r.get('runs', '')}",
        "",
        _why("what-each-speed-switch-buys-on-a-gpu"),
        "",
        f"| step | {head} | warm-up s | peak GiB |",
        "|---|" + "---:|---:|" * len(engines) + "---:|---:|",
    ]
    firsts = {e: r["engines"][e]["steps"][0].get("images_per_sec") for e in engines}
    for i, name in enumerate(r["steps"]):
        cells, warm, peak = [], [], []
        for e in engines:
            row = r["engines"][e]["steps"][i]
            if "images_per_sec" not in row:
                cells.append("failed | ")
                continue
            rate, first = row["images_per_sec"], firsts[e]
            ratio = f"{rate / first:.2f}" if first else ""
            cells.append(f"{rate:,.0f} ({row['images_per_sec_sd']:,.0f}) | {ratio}")
            warm.append(f"{row['warmup_seconds']:.0f}")
            peak.append(f"{row['peak_gib']:.1f}")
        lines.append(f"| {name} | {' | '.join(cells)} | {'/'.join(warm)} | {'/'.join(peak)} |")
    lines.append("")
    figures: list[tuple[str, str]] = []
    if (m := r.get("memory")) is not None:
        figures += [
            (
                f"peak memory at batch {b} ({m.get('note', '')})",
                f"{v['peak_gib']:.1f} GiB, {v['images_per_sec']:,.0f} images/s",
            )
            for b, v in m["per_batch"].items()
        ]
        figures.append(
            (
                f"the largest batch that fits in {m['gpu_gib']:.0f} GiB",
                f"{m['largest_batch']} ({m['first_failing_batch']} does not)",
            )
        )
    fed = r.get("fed") or {}
    if fed.get("measured") is False:
        figures.append(("fed from packed shards", f"not measured in this run ({fed['why']})"))
    for engine, f in fed.items() if fed.get("measured") is not False else []:
        if "images_per_sec" in f:
            synthetic = r["engines"][engine]["steps"][r["steps"].index("torch.compile")]
            ratio = f["images_per_sec"] / synthetic["images_per_sec"]
            figures.append(
                (
                    f"fed from packed shards ({engine}), last epoch",
                    f"{f['images_per_sec']:,.0f} images/s, {ratio:.2f} of the synthetic rate with "
                    "the same switches",
                )
            )
    return [*lines, *(_figures(figures) if figures else [])]


def image(r: dict[str, Any], heading: str) -> list[str]:
    """The training image's build times and size (``bench/image.py``)."""
    lines = [heading, ""]
    if "skipped" in r:
        return [*lines, f"Not measured on this machine: {r['skipped']}.", ""]
    lines += [
        f"Method: {r['method']}; {r['storage_driver']} storage. Load average at the end: "
        f"{r['load_average']:.1f}.",
        "",
        "| | seconds |",
        "|---|---:|",
        f"| base image (debootstrap Debian 12) | {r['base_seconds']:.0f} |",
        f"| the image on that base | {r['build_seconds']:.0f} |",
        f"| from nothing, in all | {r['cold_seconds']:.0f} |",
    ]
    if "code_change_seconds" in r:
        changed = r["code_change_seconds"]
        lines.append(f"| again after a change to the training code | {changed:.0f} |")
    lines.append(f"| image size ({r['variant']} variant, layers unpacked) | {r['size']} |")
    lines.append("")
    if r.get("checks"):
        lines += ["What its build-time checks saw:", "", *(f"    {c}" for c in r["checks"]), ""]
    return lines


def demo(r: dict[str, Any]) -> list[str]:
    """The first `make demo`'s time line, run by run (``bench/demo.py``)."""
    lines = ["## The first `make demo` (`bench/demo.py`)", ""]
    if "skipped" in r:
        return [*lines, f"Not measured on this machine: {r['skipped']}.", ""]
    runs: dict[str, dict[str, Any]] = r["runs"]
    names = list(runs)
    lines += [
        f"Method: {r['method']}. Load average at the end: {r['load_average']:.1f}.",
        "",
        "| seconds from the flow run's start | " + " | ".join(names) + " |",
        "|---" + "|---:" * len(names) + "|",
    ]
    rows = (
        ("training ended", "training_end"),
        ("scoring ended", "scored"),
        ("promotion ended", "promoted"),
        ("the image's build ended", "image_end"),
        ("the report ended", "report_end"),
        ("the flow run ended", "flow_end"),
    )
    for label, key in rows:
        cells = [f"{runs[n][key]:.0f}" if key in runs[n] else "-" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    total = [f"{runs[n]['total']:.0f}" if "total" in runs[n] else "-" for n in names]
    lines += ["| the whole demo (its own 'finished in') | " + " | ".join(total) + " |", ""]
    for name in names:
        run = runs[name]
        if {"promoted", "training_end"} <= set(run):
            wait = run["promoted"] - run["training_end"]
            lines.append(
                f"- {name}: the model was promoted {wait:.0f} s after training ended"
                + (
                    f"; the image's build ended {run['image_end'] - run['training_end']:.0f} s "
                    f"after training, and the flow run {run['flow_end'] - run['image_end']:.0f} "
                    "s after the build"
                    if {"image_end", "flow_end"} <= set(run)
                    else ""
                )
                + (f" (exit code {run['exit_code']})" if run.get("exit_code") else "")
                + "."
            )
    lines += [
        "",
        "A first demo lasts as long as the image's build from nothing plus what follows it;"
        " the build's own time moves with the machine's load between runs (the image's "
        "section). What a change to the flow's wiring moves is what waits for the build: the "
        "time from training's end to the promotion, and from the build's end to the run's.",
    ]
    return [*lines, ""]


def _fed_measured(paths: list[Path]) -> bool:
    """Whether a GPU result holds the trainer's shards-fed rate for some engine."""
    for path in paths:
        fed = json.loads(path.read_text()).get("fed") or {}
        if any(isinstance(f, dict) and "images_per_sec" in f for f in fed.values()):
            return True
    return False


def previous_sections(page: str) -> dict[str, list[str]]:
    """Each benchmark's section of an earlier page, by module name, with a line saying when it
    was measured. A run of some benchmarks (``--only``, or a fresh clone whose results folder
    is empty) re-renders the page: without these, every section it did not run would vanish.
    A section kept before keeps its first date."""
    written = WRITTEN.search(page)
    machine = MACHINE.search(page)
    note = KEPT.format(
        written.group(1) if written else "an undated run",
        machine.group(1) if machine else "a machine it did not name",
    )
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in page.rstrip("\n").splitlines():
        if line.startswith("## "):
            match = SECTION.match(line)
            current = match.group(1) if match else None
            if current is not None:
                sections[current] = [line, ""]
                continue
        if current is not None:
            body = sections[current]
            if len(body) == 2 and line == "":
                continue  # the blank line under the heading: the note goes there
            if len(body) == 2 and not line.startswith(KEPT.split("{}")[0]):
                body += [note, ""]
            body.append(line)
    return {name: [*"\n".join(body).rstrip().split("\n"), ""] for name, body in sections.items()}


def render(results: Path, previous: str = "") -> str:
    """The page for the results in ``results``; a benchmark with no result there keeps its
    section of ``previous`` (the page as it was), marked as kept."""
    kept = previous_sections(previous)

    def load(name: str) -> dict[str, Any] | None:
        path = results / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())
        lines.extend(kept.get(name, []))
        return None

    lines = [
        "# Performance",
        "",
        f"Written by `make bench` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        f"Machine: {machine()}.",
        "",
        "Figures and tables from the results of `python -m bench`; how each benchmark measures,",
        "how to read it and what it decided: [benchmarks.md](benchmarks.md).",
        "",
    ]
    if (r := load("staging")) is not None:
        lines += staging(r)
    if (r := load("gate_scale")) is not None:
        lines += gate_scale(r)
    if (r := load("loading")) is not None:
        lines += loading(
            r, "## Data loading: loose files against packed shards (`bench/loading.py`)"
        )
    if (r := load("trainer")) is not None:
        lines += trainer(r, "## The trainer on loose files and on shards (`bench/trainer.py`)")
    if (r := load("feed")) is not None:
        lines += systems.feed(r, "## Feeding a GPU from shards on one core (`bench/feed.py`)")
    if (r := load("compile_tail")) is not None:
        lines += systems.compile_tail(r)
    if (r := load("checkpoint_stall")) is not None:
        lines += systems.checkpoint_stall(
            r, "## The checkpoint stall (`bench/checkpoint_stall.py`)"
        )
    if (r := load("sharded_state")) is not None:
        lines += systems.sharded_state(r)
    if (r := load("pipeline")) is not None:
        lines += pipeline(r)
    if (r := load("tracking")) is not None:
        lines += tracking(r)
    if (r := load("train_throughput")) is not None:
        lines += ["## Training throughput (`bench/train_throughput.py`)", "", *train_throughput(r)]
    if (r := load("nodes")) is not None:
        lines += nodes(r)
    if (r := load("image")) is not None:
        lines += image(r, "## The training image, cpu variant (`bench/image.py`)")
    if (r := load("warm_start")) is not None:
        lines += warm_start(r)
    if (r := load("cost_estimate")) is not None:
        lines += cost_estimate(r)
    if (r := load("preemption")) is not None:
        lines += systems.preemption(r)
    if (r := load("warm_start_flow")) is not None:
        lines += warm_start_flow(r)
    if (r := load("demo")) is not None:
        lines += demo(r)
    gpu = sorted(GPU_RESULTS.glob("*.json")) if GPU_RESULTS.is_dir() else []
    if gpu:
        lines += [
            "## On a GPU",
            "",
            "Kept from a run on a GPU machine (`docs/bench-gpu/`), each with its machine and date.",
            "",
        ]
        if not _fed_measured(gpu):
            lines += [
                "The trainer fed from packed shards against its synthetic rate (goal: 0.9 or "
                f"more for both engines) awaits a GPU: {systems.GPU_COMMAND}.",
                "",
            ]
        for path in gpu:
            r = json.loads(path.read_text())
            stamp = r.get("date", "date not recorded")
            if r["benchmark"] == "feed":
                lines += systems.feed(r, f"### Feeding the GPU from shards on one core ({stamp})")
            elif r["benchmark"] == "checkpoint_stall":
                lines += systems.checkpoint_stall(r, f"### The checkpoint stall ({stamp})")
            elif r["benchmark"] == "gpu_fed":
                lines += [f"### Fed from packed shards ({stamp})", "", *systems.gpu_fed(r)]
            elif r["benchmark"] == "loading":
                lines += loading(r, f"### Data loading, {r['method'].split(', ')[0]} ({stamp})")
            elif r["benchmark"] == "gpu_speed":
                lines += [f"### What each speed switch buys ({stamp})", "", *gpu_speed(r)]
            elif r["benchmark"] == "trainer":
                lines += trainer(r, f"### The trainer on loose files and on shards ({stamp})")
            elif r["benchmark"] == "image":
                lines += image(r, f"### The training image, {r['variant']} variant ({stamp})")
            else:
                lines += [f"### {r['benchmark']} ({stamp})", "", *train_throughput(r)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m bench.report RESULTS_DIR OUTPUT.md", file=sys.stderr)
        return 2
    results, output = Path(args[0]), Path(args[1])
    text = render(results, output.read_text() if output.is_file() else "")
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(text)
    tmp.replace(output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
