"""Render the benchmarks' JSON results as ``docs/performance.md``.

Every sentence with a number is computed from the results, so the page cannot drift from what
was measured. GPU results (``docs/bench-gpu/*.json``) are kept in the repository because most
machines that run ``make bench`` have no GPU; they are shown with their own machine and date.
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
        f"The same small images uploaded as {found['tar_files']} WebDataset tar shard(s) of "
        f"about {found['tar_mb']} MB (`python -m imagedata.webdataset`), against loose files: "
        "the whole stage-data step, download and pack, which is what stands between new data "
        "and the trainer's first step (the trainer then reads the same packed rows).",
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
        f"{r.get('cores', '?')} cores shared with other work, so absolute rates are low and "
        "noisy; the step and rclone alternate within each case, so the ratios are the figures "
        "to read. The figures of each tool are its medians; a ratio is the median of each "
        "round's ratio (the two tools run back to back in a round, so a drift of the "
        "machine's speed over the run cancels: the same code took 76 ms and 131 ms fifteen "
        "minutes apart on this machine). Delays come from `bench/delay_proxy.py` (a fixed "
        "delay per request on loopback); 'no delay' is Azurite direct. For rates, step / "
        "rclone above 1 means the step is faster; for CPU and re-sync time, below 1 means the "
        "step spends less.",
        "",
        *rows,
        "",
        f"Packing the small images into shards (first time): {pack['images']:,} images decoded "
        f"in {pack['seconds']:.2f} s ({pack['images'] / max(pack['seconds'], 1e-9):,.0f} "
        f"images/s), {pack['shards']} shard file(s), {_mb(pack['bytes'])}. The nightly case, "
        f"1% of the small files changed ({changed['changed_blobs']} blobs): the whole step took "
        f"{changed['seconds']:.2f} s, {changed['downloaded']} downloaded, repacked in "
        f"{changed['pack_seconds']:.2f} s ({changed['decoded']} decoded, "
        f"{changed['reused']:,} rows reused).",
        "",
        *_first_step(r.get("first_step")),
        *_large_choices(r.get("large_choices")),
        *STAGING_NOTES,
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
        "Large files, no delay: each choice of the step undone in turn, measured beside the",
        "step as shipped in the same run (alternating, medians). Below 1, the alternative is",
        "slower.",
        "",
        "| alternative | its MB/s | shipped MB/s | alternative / shipped | CPU per file, "
        "alternative | CPU per file, shipped |",
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


STAGING_NOTES = [
    "The engine, and the contenders tried. Every small blob costs the storage SDK about 3 ms",
    "of interpreter-locked CPU (request preparation, its policy pipeline, a model object per",
    "listed blob), which bounded the step whatever its thread count. An earlier run of this",
    "bench measured the SDK on a thread pool (the step before), a naive one-at-a-time loop and",
    "the async SDK with 64 in flight: all within 0.3-0.5x of rclone on small files. Tried",
    "since: `rclone copy` driven by the step, and `obstore` (Python bindings of Rust's",
    "`object_store`, which makes each request outside the interpreter lock). The step",
    "now downloads with obstore's blocking calls from as many fetch threads as it has requests",
    "in flight (each call releases the interpreter lock for its whole exchange; from an",
    "asyncio loop the same engine costs two awaited futures per blob, each a wake-up of the",
    "loop), and hands the file work (MD5, temp file, write, rename) to one writer thread, more",
    "only when its queue grows. A blob over 16 MB is read as parallel ranged reads of 16 MB,",
    "each pinned with If-Match to the listed ETag, at most 4 per core in flight; each range's",
    "body is streamed a MB at a time, written in place and hashed in order while that MB is",
    "still in the processor's cache. Why 16 MB: a blob's MD5 is one serial pass, so the bytes",
    "of the ranges ahead of the hash's turn are hashed late, and the fewer and larger the",
    "ranges, the less a request costs the service and the client; with 4 ranges of a 64 MB",
    "blob in flight, two such blobs are read and hashed at once on two cores. The table of",
    "choices gives 8 MB (the step before) and 32 MB beside it. In scratch trials (20 rounds",
    "alternating, one process) 4 MB ranges took 1.86x the time of 8 MB ones, 12 MB 1.16x, and",
    "24 MB 1.02x the time of 16 MB ones: part of that is Azurite's own (a lone range of 4 MB",
    "answered its first byte after 16 ms, one of 8 MB after 4 ms), which real Blob storage",
    "need not share; 16 MB is within what peers use (azcopy's 8 MiB blocks, rclone's 64 MiB",
    "chunks per stream). On a local disk the step does not wait for its files to reach the",
    "disk: the manifest records the machine's boot and marks them, and a sync under another",
    "boot (after a restart, maybe a crash) reads them once before trusting them; on NFS a file",
    "is committed to the server when it is closed; any other file system is flushed before",
    "the manifest is written (`staging/durability.py`). A process's first download sets",
    "glibc's thresholds so that the buffers its chunks arrive in are reused once freed",
    "(`staging/memory.py`): with glibc's defaults each MB received was fresh memory again, a",
    "page fault and a zeroed page per 4 KB. Separate processes, 8 rounds each alternating",
    "with rclone, three pairs: 158 against 182 ms of CPU per 64 MB file (medians; rclone",
    "158-170 ms), 463 against 446 MB/s. Trim thresholds tried: 8 MB left most of the churn",
    "(176 ms), 16 MB some (155), 32 MB none (146), 128 MB gained nothing more (147). It",
    "lists through azure-core's public pipeline client with the container's credential, and",
    "instead of the SDK's per-blob models reads each page with the C XML parser for the four",
    "fields it pins (`staging/list_page.py`); the cyclic garbage collector is paused while a",
    "page is read (the gate's section below measures both choices). A sync",
    "that lists reads its manifest, each recorded file's status and its slice of files while",
    "the listing is on its way, so a re-sync's own work overlaps the wait. A re-sync reads no file",
    "whose status (size, modification and change times, inode) is the one recorded when it was",
    "staged; a file rewritten behind its back has a new change time and is read, and one slice",
    "of the files in 16 is re-read by turns for what no status shows. rclone as the engine was",
    "rejected: 1.60 writes in place under the final name, does not pin a blob to the gate's",
    "ETag, and checks an MD5 only by reading every file again; the step would have had to",
    "re-read what rclone wrote to keep its guarantees (MD5-verified, temp name then rename,",
    "the gate's exact listing, a manifest).",
    "",
    "The data gate lists through the same lister and keeps what it read from each image by",
    "content (Content-MD5 and size from the listing; name and ETag where the service stores no",
    "MD5), so a new version under a new prefix reads only its new images. On the full listing",
    "it checks every blob's name and layout (split/class), size, image extension and the",
    "train/test leak by MD5; each image is read and decoded whole (readable, dimensions after",
    "its EXIF orientation, channels) once per content. Reusing a row by MD5 is sound because",
    "staging checks every byte it stages against that same MD5. Its cost on a 1.28 M-blob",
    "listing is measured in the gate's section below (`bench/gate_scale.py`).",
    "",
    "Where the step stands against rclone, and what bounds each row here. Azurite serves",
    "every request from one Node.js process on the same 2 cores as the client; the server's",
    "CPU rows count it (with the delay proxy's share where there is a delay) while each tool",
    "is its client. Small files: Azurite spends 0.8-1.2 ms of CPU per file with no delay in",
    "the runs behind this page, more than either client (0.3-0.85 ms), so it is the bound",
    "whichever client asks, and a",
    "client's rate mostly says how much CPU it leaves the server; the step leaves more. In",
    "scratch runs with Azurite on a core of its own, where nothing but its own CPU bounds it,",
    "the two clients were level (0.92x and 1.04x). Re-sync of small files: Azurite's listing of",
    "one 5,000-blob page costs it more CPU than the step's whole re-sync and about as much",
    "as rclone's (the server's share in the re-sync rows), and it is what either tool mostly",
    "waits for; in scratch runs of the same listing it took Azurite 0.38-0.69 s of CPU from",
    "one listing to the next. The step spends about a third of rclone's CPU on a re-sync. In",
    "a scratch run, reading the page took it 48 ms with the XML parser (19 ms with a scanner",
    "since removed) and its own work after (plan, status checks, manifest) 74 ms, of a 0.50 s",
    "re-sync against rclone's 0.61 s. Large files: the MD5 of every byte, which rclone",
    "computes too, is about half of either client's CPU, and client and server together fill",
    "both cores, so",
    "with no delay the two are level within this machine's spread (0.93x to 1.08x of rclone",
    "in the runs behind this page and the scratch trials before them). With Azurite on a core",
    "of its own (the row named so) the client has the other core to itself and its rate is",
    "its CPU per byte on one core (the step then keeps 4 ranges in flight, its setting for",
    "one core); there the step is ahead (1.20x to 1.32x of rclone in four runs). With 10 ms",
    "per request the two were level or the step ahead (0.92x to 1.18x in the same runs). Those",
    "CPU figures are the clients' own since the small files' folders are kept until every",
    "benchmark has run: this machine's ext4 has no journal, and there a file created within",
    "60 s of the deletion of thousands (300 s while their inode table is unwritten) costs the",
    "kernel's inode allocator a scan of the deleted inodes (`recently_deleted` in `perf`),",
    "about 0.5 ms per file for either tool, which had made both tools' CPU per file look",
    "alike (0.84 and 0.80 ms at 10 ms per request, against 0.33 and 0.42 ms without it, in a",
    "scratch run). The large files are measured before the small ones: measured after the",
    "small files' kept folders (2.4 GB in 120,000 files), two runs put the step at 0.71x and",
    "0.79x of rclone, each round of the step that came right after rclone's taking 1.3-1.6x",
    "the time of its other rounds; the cause is not established. `cp -r` is one local copy",
    "on one thread: the ceiling for small files, which no HTTP client here comes near; for",
    "large files it moved between 296 and 1,992 MB/s from one run to the next (the page",
    "cache and the disk's write-back), so it bounds nothing there.",
    "",
]


def _listing_ahead(a: dict[str, Any] | None) -> list[str]:
    """The listing's choices, asking for the next page before parsing this one and pausing the
    collector while parsing, each measured against its alternative in the same run."""
    if a is None:
        return []
    ahead, plain = a["ahead"], a["one_after_another"]
    return [
        f"The listing asks for the next page before it reads this one. Measured against one "
        f"page after another, on {int(ahead['blobs']):,} blobs ({a['pages']} pages) answered "
        f"{a['page_delay_ms']:g} ms after each request (a stand-in for the service's own time, "
        f"which this server lacks), medians of {a['rounds']} alternating rounds: "
        f"{ahead['wall_s']:.1f} s against {plain['wall_s']:.1f} s (one after another takes "
        f"{plain['wall_s'] / max(ahead['wall_s'], 1e-9):.2f}x the time), with "
        f"{ahead['cpu_s']:.1f} s and {plain['cpu_s']:.1f} s of CPU. What it saves per page is "
        "the smaller of the page's reading and the wait for the next one.",
        "",
        *_collector(a),
    ]


def _collector(a: dict[str, Any]) -> list[str]:
    """The other choice of the listing: the cyclic collector paused while a page is parsed."""
    running = a.get("collector_running")
    if running is None:
        return []
    ahead = a["ahead"]
    return [
        "Each page is read with the cyclic garbage collector paused: a page of 5,000 blobs "
        "becomes some 80,000 objects the collector tracks in the XML parser's tree, none in a "
        "cycle, and each time they outnumber a "
        "quarter of the process's long-lived objects the collector walks all of them. In the "
        f"same rounds, with Prefect imported as in the flow's process "
        f"({a['tracked_objects']:,} objects tracked), the collector running took "
        f"{running['wall_s']:.1f} s and {running['cpu_s']:.1f} s of CPU against "
        f"{ahead['wall_s']:.1f} s and {ahead['cpu_s']:.1f} s paused "
        f"({running['cpu_s'] / max(ahead['cpu_s'], 1e-9):.2f}x the CPU).",
        "",
    ]


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
    return [
        "## The data gate at ImageNet scale (`bench/gate_scale.py`)",
        "",
        f"Method: {r['method']}. Each step is timed on its own, in one process; peak RSS is the "
        "process's high-water mark after the step (it never goes down).",
        "",
        *rows,
        "",
        *_listing_ahead(r.get("listing_ahead")),
        f"A first gate over {listing['blobs']:,} new images at the measured read-and-decode rate: "
        f"{r['first_gate_estimate_s']:,} s ({r['first_gate_estimate_s'] / 60:,.0f} min).",
        "",
        f"Against the goal of 5 minutes: listing and the cached manifest took {before:,.0f} s "
        f"together ({before / 300:.2f}x the goal) before any expectation ran. "
        f"`run_expectations` took {big['run_expectations']['wall_s']:,.0f} s at "
        f"{big['rows']:,} rows, {big['class_counts']['wall_s']:,.1f} s of it (timed apart) in "
        "`class_counts` (one pass over the rows); "
        f"at the full {cached['rows']:,} rows, linearly, about {expect:,.0f} s: the nightly "
        f"gate as a whole about {before + expect:,.0f} s ({(before + expect) / 300:.2f}x the "
        "goal).",
        "",
        *GATE_NOTES,
    ]


GATE_NOTES = [
    "What the gate guarantees, and where. On the full listing, every run: every blob's name",
    "and layout (split and class), its size (no empty blob), its image extension, the class",
    "counts, and the train/test leak by Content-MD5; the listing it validated is pinned, and",
    "staging checks every byte it stages against the listed MD5. From one read of the whole",
    "image, decoded as the trainer decodes it, once per content (MD5 and size), never sampled:",
    "readable (every pixel decoded, not a header), width and height after the EXIF orientation,",
    "channels. The cache makes the nightly run and a new version of mostly unchanged images",
    "read only new content. Per blob, the listing pays one read of its page (taken as a",
    "stream: unstreamed, the SDK's pipeline parsed every page a second time, into a tree it",
    "never returned; the XML parser reads it for four fields per blob) and the cached",
    "manifest a few dicts in the listing's",
    "thread (a cache hit no longer goes through the thread pool). What is left is interpreter",
    "work per blob; the manifest taking each page while the next is read would overlap the two",
    "(not done: the manifest is the smaller part now). Listing by folder, several at once",
    "as rclone does, was tried and not kept: it asks for a page per folder (2,002 for",
    "ImageNet's layout against 266), which pays where folders hold thousands of blobs and",
    "costs where they hold a few dozen; against Azurite it listed 5,000 blobs in 20",
    "folders 8% faster. A first gate at the",
    "rate above is bound by one read per image through the SDK plus its decode (Pillow",
    "decodes outside the interpreter lock, so the reading threads decode in parallel);",
    "decoding a sample (e.g. a few per class) and trusting staging's MD5 check for the rest",
    "would bound it, at the price of catching an undecodable image only when the trainer",
    "opens it (a header read alone passed PNGs cut after 60 bytes).",
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
        "the four concurrent steps: summed / span / speed-up",
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
        f"Method: {r['method']}. After one run that is not compared (the first run of a data",
        "version pays for what later runs reuse), each pair runs the two in turn; the estimate",
        "is the mean of the median difference of the pairs run tracked first and of those run",
        "untracked first, which cancels what running second adds or takes away (the order",
        "effect). The orchestrator's CPU is the flow process's, every thread (tracking's own",
        "included), not the trainer's.",
        "",
        *rows,
        "",
        f"`import mlflow` alone costs a fresh interpreter {imported['cpu_seconds']:.2f} s of CPU "
        f"({imported['wall_seconds']:.2f} s wall).",
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
        *_ddp_nodes(r),
    ]


def _ddp_nodes(r: dict[str, Any]) -> list[str]:
    """The DDP engine's ratios (reports written before it existed have none)."""
    if "ddp_two_nodes_over_one_images_per_sec" not in r:
        return []
    return [
        "Rows named `ddp, ...` ran the DDP engine (one torchrun per node, c10d rendezvous on "
        f"the first): 2 nodes at {r['ddp_two_nodes_over_one_images_per_sec']}x the images/s "
        f"of 1 node, and at {r['ddp_over_horovod_two_nodes_images_per_sec']}x Horovod's on 2 "
        "nodes.",
        "",
    ]


def gpu_speed(r: dict[str, Any]) -> list[str]:
    """Each speed switch's images/s per engine, the memory per batch size, the shards run."""
    engines = list(r["engines"])
    head = " | ".join(f"{e}: images/s (sd) | x first" for e in engines)
    lines = [
        f"Machine: {r['machine']}. Method: {r['method']}. {r.get('runs', '')}",
        "",
        "Each row adds its switch to those above it (the last row undoes one, to show it).",
        "At batch 64 the step is bound by kernel launches and Python, not by the GPU, so",
        "the precision, optimizer and layout switches move it little; a larger batch and",
        "compilation (fewer, fused kernels) are what lift it. Under Horovod, channels-last",
        "weights need contiguous gradient buffers (its collectives refuse other layouts), and",
        "autograd then adds each convolution's gradient into them with a transposing copy, so",
        "that switch costs Horovod what it buys DDP, whose buckets follow the weights' layout.",
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
    if (m := r.get("memory")) is not None:
        sizes = ", ".join(
            f"{b}: {v['peak_gib']:.1f} GiB, {v['images_per_sec']:,.0f}/s"
            for b, v in m["per_batch"].items()
        )
        lines += [
            f"Memory ({m.get('note', '')}), peak per batch size: {sizes}. The largest batch "
            f"that fits in the GPU's {m['gpu_gib']:.0f} GiB is {m['largest_batch']} "
            f"({m['first_failing_batch']} does not).",
            "",
        ]
    fed = r.get("fed") or {}
    if fed.get("measured") is False:
        lines += [f"Fed from packed shards: not measured in this run ({fed['why']}).", ""]
    for engine, f in fed.items() if fed.get("measured") is not False else []:
        if "images_per_sec" in f:
            synthetic = r["engines"][engine]["steps"][r["steps"].index("torch.compile")]
            ratio = f["images_per_sec"] / synthetic["images_per_sec"]
            lines += [
                f"Fed from packed shards ({engine}): {f['images_per_sec']:,.0f} images/s in the "
                f"last epoch, {ratio:.2f} of the synthetic rate with the same switches.",
                "",
            ]
    return lines


def image(r: dict[str, Any], heading: str) -> list[str]:
    """The training image's build times and size (``bench/image.py``)."""
    lines = [heading, ""]
    if "skipped" in r:
        return [*lines, f"Not measured on this machine: {r['skipped']}.", ""]
    lines += [
        f"Method: {r['method']}; {r['storage_driver']} storage. Load average at the end:",
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
    lines += ["", f"Image size ({r['variant']} variant, layers unpacked): {r['size']}.", ""]
    if r.get("checks"):
        lines += ["What its build-time checks saw:", "", *(f"    {c}" for c in r["checks"]), ""]
    return lines


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
    if (r := load("preemption")) is not None:
        lines += systems.preemption(r)
    if (r := load("warm_start_flow")) is not None:
        lines += warm_start_flow(r)
    gpu = sorted(GPU_RESULTS.glob("*.json")) if GPU_RESULTS.is_dir() else []
    if gpu:
        lines += [
            "## On a GPU",
            "",
            "Kept from a run on a GPU machine (`docs/bench-gpu/`); `make bench` there refreshes",
            "them. Each says its own machine and method.",
            "",
        ]
        if not _fed_measured(gpu):
            lines += [
                "The trainer fed from packed shards against its synthetic rate (the goal: 0.9 "
                f"or more for both engines) awaits a GPU: {systems.GPU_COMMAND} measures it, "
                "with one core's feed rate and the checkpoint stall there.",
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
