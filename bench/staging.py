"""Staging throughput, side by side in one run against one Azurite, reported as ratios.

For each part of the dataset (many small images; a few large files) the same bytes go to a
local folder three ways:

* the staging step's sync (``backends.staging``: parallel, verified, temp name + rename),
* a naive loop: list, then ``download_blob().readall()`` per blob, one at a time, same SDK,
* ``cp -r`` of the staged folder: no HTTP at all, the ceiling on this machine's loopback.

Then the incremental cases the nightly retrain lives on: a re-sync with nothing changed, and
one with 1% of the small files changed (including the repack of the shards). Everything is in
the page cache (the data was just generated and uploaded), so these are CPU and protocol
costs, not disk reads.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from azure.storage.blob import ContainerClient

from backends.azurite import running_azurite
from backends.blob import API_VERSION, upload_directory
from backends.staging import stage, sync_to_directory
from bench import dataset
from bench.output import dataset_main

PREFIX = "bench"
PACK_IMAGE_SIZE = 32  # the default model's input size: the side of a packed image


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the storage client's side of a transfer)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def naive_download(container: ContainerClient, prefix: str, dest: Path) -> int:
    """What a first script does: one blob after another, straight into its file."""
    count = 0
    for blob in container.list_blobs(name_starts_with=f"{prefix}/"):
        target = dest / blob.name[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(container.download_blob(blob.name).readall())
        count += 1
    return count


def _rate(files: int, size: int, seconds: float) -> dict[str, float]:
    return {
        "seconds": round(seconds, 3),
        "files_per_sec": round(files / seconds, 1),
        "mb_per_sec": round(size / seconds / 1e6, 1),
    }


def measure_part(
    container: ContainerClient, prefix: str, work: Path, part: str, workers: int
) -> dict[str, Any]:
    staged, naive, copied = (work / kind / part for kind in ("staged", "naive", "copy"))
    cpu = cpu_seconds()
    t_stage, report = timed(lambda: sync_to_directory(container, prefix, staged, workers))
    cpu_stage, cpu = cpu_seconds() - cpu, cpu_seconds()
    t_naive, count = timed(lambda: naive_download(container, prefix, naive))
    cpu_naive = cpu_seconds() - cpu
    copied.parent.mkdir(parents=True, exist_ok=True)
    t_copy, _ = timed(lambda: subprocess.run(["cp", "-r", str(staged), str(copied)], check=True))
    files, size = dataset.tree_bytes(staged)
    if (count, dataset.tree_bytes(naive)) != (files, (files, size)):
        raise RuntimeError(f"{part}: naive download does not match the staged folder")
    return {
        "files": files,
        "bytes": size,
        "staging": _rate(files, size, t_stage),
        "naive_sequential": _rate(files, size, t_naive),
        "cp_r": _rate(files, size, t_copy),
        "staging_over_naive": round(t_naive / t_stage, 2),
        "staging_fraction_of_cp": round(t_copy / t_stage, 3),
        "downloaded": len(report.downloaded),
        "client_cpu_ms_per_file": {
            "staging": round(1000 * cpu_stage / files, 2),
            "naive_sequential": round(1000 * cpu_naive / files, 2),
        },
    }


def change_one_percent(container: ContainerClient, prefix: str, side: int) -> int:
    """Overwrite 1% of the small images with new pictures (new content, same names)."""
    names = sorted(b.name for b in container.list_blobs(name_starts_with=f"{prefix}/"))
    chosen = names[:: max(1, len(names) // max(1, len(names) // 100))][: len(names) // 100]
    fresh = dataset.png_images(len(chosen), side, seed=1)
    for name, (_, data) in zip(chosen, fresh, strict=True):
        container.upload_blob(name, data, overwrite=True)
    return len(chosen)


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = dataset.images(args.source, args.small, args.small_kb)
    raw = dataset.large_files(args.source, args.large, args.large_mb)
    shutil.rmtree(args.work, ignore_errors=True)
    work = args.work
    with running_azurite(work / "azurite") as conn:
        container = ContainerClient.from_connection_string(
            conn,
            f"bench-{uuid.uuid4().hex[:8]}",
            api_version=API_VERSION,
            max_single_get_size=32 << 20,
        )
        container.create_container()
        t_upload, _ = timed(
            lambda: [
                upload_directory(container, folder, f"{PREFIX}/{folder.name}", workers=8)
                for folder in (images, raw)
            ]
        )
        parts = {
            "small": measure_part(container, f"{PREFIX}/images", work, "small", args.workers),
            "large": measure_part(container, f"{PREFIX}/raw", work, "large", args.workers),
        }
        staged = work / "staged" / "small"
        t_pack, packed = timed(
            lambda: stage(container, f"{PREFIX}/images", staged, PACK_IMAGE_SIZE, args.workers)
        )
        t_same, same = timed(
            lambda: [
                stage(container, f"{PREFIX}/images", staged, PACK_IMAGE_SIZE, args.workers),
                sync_to_directory(container, f"{PREFIX}/raw", work / "staged" / "large"),
            ]
        )
        changed = change_one_percent(container, f"{PREFIX}/images", dataset.side_for(args.small_kb))
        t_changed, after = timed(
            lambda: stage(container, f"{PREFIX}/images", staged, PACK_IMAGE_SIZE, args.workers)
        )
    total_files = sum(p["files"] for p in parts.values())
    total_bytes = sum(p["bytes"] for p in parts.values())
    seconds = {
        k: sum(p[k]["seconds"] for p in parts.values())
        for k in ("staging", "naive_sequential", "cp_r")
    }
    return {
        "benchmark": "staging",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cores": os.cpu_count(),
        "workers": args.workers,
        "method": f"{args.small} images of ~{args.small_kb} KB + {args.large} x {args.large_mb} MB "
        f"in Azurite on loopback; staging with {args.workers} threads; page cache warm",
        "upload_seconds": round(t_upload, 1),
        "parts": parts,
        "total": {
            "files": total_files,
            "bytes": total_bytes,
            **{k: _rate(total_files, total_bytes, v) for k, v in seconds.items()},
            "staging_over_naive": round(seconds["naive_sequential"] / seconds["staging"], 2),
            "staging_fraction_of_cp": round(seconds["cp_r"] / seconds["staging"], 3),
        },
        "first_pack": {**packed["shards"], "step_seconds": round(t_pack, 3)},
        "resync_unchanged": {
            "seconds": round(t_same, 3),
            "downloaded": len(same[0]["downloaded"]) + len(same[1].downloaded),
            "shards": same[0]["shards"]["action"],
        },
        "resync_one_percent": {
            "seconds": round(t_changed, 3),
            "changed_blobs": changed,
            "downloaded": len(after["downloaded"]),
            "pack_seconds": after["shards"]["seconds"],
            "decoded": after["shards"]["decoded"],
            "reused": after["shards"]["reused"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.staging",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--small", type=int, default=20_000, help="small images")
    p.add_argument("--small-kb", type=float, default=20, help="size of each, about")
    p.add_argument("--large", type=int, default=4, help="large files")
    p.add_argument("--large-mb", type=int, default=256, help="size of each")
    p.add_argument("--workers", type=int, default=16, help="staging threads")
    return dataset_main(p, "staging", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
