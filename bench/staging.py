"""Staging throughput against the tool a user could pick instead, in one run, as ratios.

The same bytes go from one Azurite to a local folder three ways:

* the staging step's sync (``staging.sync``: verified, temp name + rename, manifest), run in
  this process, its client CPU read from this process's own rusage;
* ``rclone copy`` with as many transfers (and checkers) as the step has downloads in flight,
  the best general tool found here; its CPU is the child's rusage;
* ``cp -r`` of the staged folder: no HTTP at all, the ceiling on this machine.

Azurite answers on loopback in microseconds, where Blob in the region takes milliseconds: each
round runs behind ``bench.delay_proxy`` (a fixed delay per request, 0, 2 and 10 ms by default),
so a client that keeps too few requests in flight, or pays a round trip per file more than it
must, shows it. Each case runs ``--rounds`` times, the step first in even rounds and rclone
first in odd ones, and the medians are reported, so both see the same load on this shared
machine; each also re-syncs what it just staged, with nothing changed (the step then reads
only its by-turns slice of the files, rclone compares sizes and modification times), timed and
its CPU counted. Then the same small images as WebDataset tar shards against loose files:
the whole stage-data step (download and pack for the trainer), new data to the first step.
Then the shard pack and the nightly case: 1% of the small files changed.
Everything is in the page cache: these are CPU and protocol costs, not disk reads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

from azure.storage.blob import ContainerClient

import staging.sync
import staging.transfer
from backends.blob import API_VERSION, upload_directory
from backends.local.azurite import running_azurite
from bench import dataset
from bench.delay_proxy import delayed
from bench.output import dataset_main
from imagedata.webdataset import pack_folders
from staging.durability import Settled, flush_filesystem
from staging.sync import stage, sync_to_directory

PREFIX = "bench"
PACK_IMAGE_SIZE = 32  # the default model's input size: the side of a packed image


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    """CPU time of this process (all threads), or of its finished children."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def measured(fn: Callable[[], Any], who: int = resource.RUSAGE_SELF) -> tuple[float, float]:
    """(wall seconds, CPU seconds of ``who``) of one call."""
    cpu, started = cpu_seconds(who), time.perf_counter()
    fn()
    return time.perf_counter() - started, cpu_seconds(who) - cpu


def rclone() -> str:
    """The rclone binary, installed from the distribution when missing (root and apt-get
    needed then; ``make test`` runs the quick bench, so CI machines get it this way)."""
    found = shutil.which("rclone")
    if found:
        return found
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "rclone"]
    if subprocess.run(install, capture_output=True).returncode != 0:  # package lists not read yet
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        subprocess.run(install, check=True, capture_output=True)
    return shutil.which("rclone") or "rclone"


def rclone_copy(port: int, container: str, prefix: str, dest: Path, transfers: int) -> None:
    """``rclone copy`` of ``prefix`` into ``dest``; the emulator's well-known account through
    the environment, as rclone's docs describe for Azurite."""
    env = {
        **os.environ,
        "RCLONE_CONFIG": "/dev/null",
        "RCLONE_CONFIG_AZ_TYPE": "azureblob",
        "RCLONE_CONFIG_AZ_USE_EMULATOR": "true",
        "RCLONE_CONFIG_AZ_ENDPOINT": f"http://127.0.0.1:{port}/devstoreaccount1",
    }
    budget = ["--transfers", str(transfers), "--checkers", str(transfers)]
    subprocess.run(
        [rclone(), "copy", f"az:{container}/{prefix}", str(dest), "-q", *budget],
        env=env,
        check=True,
    )


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and
    parentheses): [0] state, [1] parent, [11] user and [12] system CPU in clock ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents.setdefault(int(_stat(entry.name)[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def servers() -> list[int]:
    """The processes serving the clients here: whatever this process runs beside them when
    none is being measured (Azurite, and the delay proxy when there is one)."""
    return _children(os.getpid())


def server_cpu(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` have used so far (those gone count nothing)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat(pid)
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus``; threads started later inherit it. A process or
    thread gone meanwhile is passed over."""
    with contextlib.suppress(OSError):
        for task in list(Path(f"/proc/{pid}/task").iterdir()):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def apart(pids: list[int]) -> Iterator[str | None]:
    """The server processes ``pids`` on one core and this process (the client, and the rclone
    it starts) on the others, until the block ends; yields what was done, or None on a
    machine of one core. Why: Blob storage does not run on the node it serves, yet Azurite
    here shares the client's two cores, so a client's rate also measures how much CPU it
    leaves the server. Apart, a large file's rate is the client's own."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield None
        return
    server, client = {cpus[0]}, set(cpus[1:])
    try:
        for pid in pids:
            _pin(pid, server)
        _pin(os.getpid(), client)
        yield f"server on CPU {cpus[0]}, client on {len(client)} other(s)"
    finally:
        for pid in [*pids, os.getpid()]:
            _pin(pid, set(cpus))


def _served(fn: Callable[[], Any], who: int, serving: list[int]) -> tuple[float, float, float]:
    """:func:`measured` of one call, and the CPU seconds the ``serving`` processes spent."""
    before = server_cpu(serving)
    wall, cpu = measured(fn, who)
    return wall, cpu, server_cpu(serving) - before


def _through(conn: str, port: int, name: str) -> ContainerClient:
    azurite = urlsplit(conn.split("BlobEndpoint=")[1].split(";")[0]).port
    return ContainerClient.from_connection_string(
        conn.replace(f":{azurite}/", f":{port}/"), name, api_version=API_VERSION
    )


def _rates(
    files: int, size: int, wall: float, cpu: float, served: float | None = None
) -> dict[str, float]:
    rates = {
        "files": files,
        "seconds": round(wall, 3),
        "files_per_sec": round(files / wall, 1),
        "mb_per_sec": round(size / wall / 1e6, 1),
        "cpu_ms_per_file": round(1000 * cpu / files, 3),
    }
    if served is not None:
        rates["server_cpu_ms_per_file"] = round(1000 * served / files, 3)
    return rates


def _turns(rounds: int, first: str, second: str) -> Iterator[tuple[int, str]]:
    """Each round's two cases, the order reversed every other round, so both see the same
    load on this shared machine."""
    for rnd in range(rounds):
        for case in (first, second) if rnd % 2 == 0 else (second, first):
            yield rnd, case


def measure(
    conn: str,
    name: str,
    port: int,
    part: str,
    work: Path,
    delay: float,
    args: argparse.Namespace,
    server_apart: bool = False,
) -> dict[str, Any]:
    """One part of the dataset at one delay: the step and rclone, each into a fresh folder and
    then again (the re-sync), ``rounds`` times (``large_rounds`` for the large files, a second
    or two each), the order reversed every other round; medians. The large files' folders
    go once measured, but the first round's (the ``cp -r`` ceiling copies it), so later rounds
    do not share the disk with the write-back of earlier ones. The small files' folders are
    kept (see :func:`run`): on an ext4 without a journal (this machine's), every file created
    within a minute or more of deleting thousands costs the kernel's inode allocator a scan
    of the deleted ones (``recently_deleted``), paid alike by either tool and larger than either
    tool's own CPU per file (docs/performance.md).

    The server's CPU (Azurite's, and the delay proxy's) is counted per sync too: where it is
    larger than the client's, the server is what bounds the rate on this machine, whichever
    client asks. ``server_apart``: the server on a core of its own (:func:`apart`)."""
    runs: dict[str, list[dict[str, float]]] = {"step": [], "rclone": []}
    who = {"step": resource.RUSAGE_SELF, "rclone": resource.RUSAGE_CHILDREN}
    source, workers = f"{PREFIX}/{part}", args.workers
    trees = set()
    kind = "apart-" if server_apart else ""
    placed = None
    with delayed(port, delay) as via, contextlib.ExitStack() as pinned:
        serving = servers()
        if server_apart:
            placed = pinned.enter_context(apart(serving))
            if placed is None:  # one core: nothing to put apart, nothing to measure so
                return {}
        container = _through(conn, via, name)
        rounds = args.large_rounds if part == "raw" else args.rounds
        for rnd, tool in _turns(rounds, "step", "rclone"):
            dest = work / f"{kind}{tool}-{part}-{delay:g}ms-{rnd}"
            call = {
                "step": lambda d=dest: sync_to_directory(container, source, d, workers),
                "rclone": lambda d=dest: rclone_copy(via, name, source, d, workers),
            }[tool]
            wall, cpu, served = _served(call, who[tool], serving)
            files, size = dataset.tree_bytes(dest)
            trees.add((files, size))
            rates = _rates(files, size, wall, cpu, served)
            # A re-sync takes about half a second, most of it one listing page, and moves by
            # a tenth of that with the load: several, and their median, per round.
            agains = [_served(call, who[tool], serving) for _ in range(args.resyncs)]
            rates["resync_seconds"] = round(statistics.median(a[0] for a in agains), 3)
            rates["resync_cpu_seconds"] = round(statistics.median(a[1] for a in agains), 3)
            rates["resync_server_cpu_seconds"] = round(statistics.median(a[2] for a in agains), 3)
            runs[tool].append(rates)
            if (rnd or server_apart) and part == "raw":
                shutil.rmtree(dest)
    if len(trees) != 1:
        raise RuntimeError(f"{part}: the step and rclone staged different trees: {trees}")
    return {
        **({"apart": placed} if placed else {}),
        **{
            tool: {
                **{k: statistics.median(r[k] for r in rs) for k in rs[0]},
                # Each round's: the spread behind a median, and each round's ratio of the
                # two tools, which ran back to back (bench.report pairs them).
                "each": {
                    k: [r[k] for r in rs]
                    for k in (
                        "seconds",
                        "cpu_ms_per_file",
                        "server_cpu_ms_per_file",
                        "resync_seconds",
                        "resync_cpu_seconds",
                    )
                },
            }
            for tool, rs in runs.items()
        },
    }


def _flushed(dest: Path, boot: str | None) -> Settled:
    """What every sync did before staging.durability: flush, then trust under any boot."""
    return "flushed" if flush_filesystem(dest) else "failed"


@dataclass(frozen=True)
class Setting:
    """A choice's value that is another module setting's, read when the choice is applied."""

    module: Any
    name: str


# The large-file choices of staging.transfer and staging.durability, each against what was
# there before it (or the obvious other choice): the module settings each one changes.
LARGE_CHOICES: dict[str, list[tuple[Any, str, Any]]] = {
    "flush before the manifest (the step before)": [(staging.sync, "settle", _flushed)],
    "each range received whole (chunk = range)": [
        (staging.transfer, "CHUNK", Setting(staging.transfer, "PIECE"))
    ],
    "every fetch thread on a range (ranges = workers)": [
        (staging.transfer, "RANGES_PER_CORE", 10**6)
    ],
    "ranges of 8 MB (the step before)": [(staging.transfer, "PIECE", 8 << 20)],
    "ranges of 32 MB": [(staging.transfer, "PIECE", 32 << 20)],
}


def _choice(changes: list[tuple[Any, str, Any]]) -> contextlib.ExitStack:
    """The module settings of one choice, changed until the block ends; a value given as a
    :class:`Setting` is that setting's when the choice is applied, not at import."""
    stack = contextlib.ExitStack()
    for module, attr, value in changes:
        now = getattr(value.module, value.name) if isinstance(value, Setting) else value
        stack.enter_context(mock.patch.object(module, attr, now))
    return stack


def large_choices(conn: str, name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The large files, no delay, staged as shipped and with each choice undone in turn,
    alternating (``large_rounds`` of each, medians): MB/s, client CPU per file, and the ratio
    of each alternative's rate to the shipped one measured beside it."""
    container = ContainerClient.from_connection_string(conn, name, api_version=API_VERSION)
    source, out = f"{PREFIX}/raw", dict[str, Any]()
    for label, changes in LARGE_CHOICES.items():
        runs: dict[str, list[dict[str, float]]] = {"shipped": [], "alternative": []}
        for rnd, case in _turns(args.large_rounds, "shipped", "alternative"):
            dest = work / f"choice-{len(out)}-{case}-{rnd}"
            with _choice(changes if case == "alternative" else []):
                wall, cpu = measured(
                    partial(sync_to_directory, container, source, dest, args.workers)
                )
            files, size = dataset.tree_bytes(dest)
            runs[case].append(_rates(files, size, wall, cpu))
            shutil.rmtree(dest)
        med = {
            case: {
                k: statistics.median(r[k] for r in rs) for k in ("mb_per_sec", "cpu_ms_per_file")
            }
            for case, rs in runs.items()
        }
        out[label] = {
            **med,
            "ratio": round(med["alternative"]["mb_per_sec"] / med["shipped"]["mb_per_sec"], 2),
        }
    return out


def copy_ceiling(source: Path, work: Path) -> dict[str, float]:
    target = work / f"cp-{source.name}"
    shutil.rmtree(target, ignore_errors=True)
    wall, cpu = measured(
        lambda: subprocess.run(["cp", "-r", str(source), str(target)], check=True),
        resource.RUSAGE_CHILDREN,
    )
    files, size = dataset.tree_bytes(target)
    return _rates(files, size, wall, cpu)


def change_one_percent(container: ContainerClient, prefix: str, side: int) -> int:
    """Overwrite 1% of the small images with new pictures (new content, same names)."""
    names = sorted(b.name for b in container.list_blobs(name_starts_with=f"{prefix}/"))
    chosen = names[:: max(1, len(names) // max(1, len(names) // 100))][: len(names) // 100]
    fresh = dataset.png_images(len(chosen), side, seed=1)
    for name, (_, data) in zip(chosen, fresh, strict=True):
        container.upload_blob(name, data, overwrite=True)
    return len(chosen)


def loose_or_packed(
    conn: str, name: str, port: int, work: Path, delay: float, args: argparse.Namespace
) -> dict[str, Any]:
    """New data to what the trainer reads, the same images uploaded two ways: loose files,
    and WebDataset tar shards of ``--tar-mb`` (``imagedata.webdataset``). Each is staged into a
    fresh folder and packed for the trainer (the whole stage-data step), ``rounds`` times,
    the order reversed every other round; medians. The trainer's first step then reads the
    same packed rows either way, so this is the difference in time to the first step."""
    seconds: dict[str, list[float]] = {"loose": [], "packed": []}
    images = 0
    with delayed(port, delay) as via:
        container = _through(conn, via, name)
        for rnd, how in _turns(args.rounds, "loose", "packed"):
            dest = work / f"first-step-{how}-{delay:g}ms-{rnd}"
            prefix = f"{PREFIX}/{'images' if how == 'loose' else 'tars'}"
            started = time.perf_counter()
            done = stage(container, prefix, dest, PACK_IMAGE_SIZE, args.workers)
            seconds[how].append(time.perf_counter() - started)
            images = done["shards"]["images"]
            # Kept, as the small files' folders are (see measure).
    loose, packed = (statistics.median(seconds[k]) for k in ("loose", "packed"))
    return {"images": images, "loose_seconds": round(loose, 3), "packed_seconds": round(packed, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    images = dataset.images(args.source, args.small, args.small_kb)
    raw = dataset.large_files(args.source, args.large, args.large_mb)
    shutil.rmtree(args.work, ignore_errors=True)
    work = args.work
    rclone()
    with running_azurite(work / "azurite") as conn:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        container = ContainerClient.from_connection_string(
            conn, name, api_version=API_VERSION, max_single_get_size=32 << 20
        )
        container.create_container()
        for folder in (images, raw):
            upload_directory(container, folder, f"{PREFIX}/{folder.name}", workers=8)
        tars = work / "tars"
        shard_files = sum(pack_folders(images, tars, args.tar_mb * 2**20).values())
        upload_directory(container, tars, f"{PREFIX}/tars", workers=8)
        port = urlsplit(container.url).port or 10000
        # The large files first, before the small files' kept folders (every round's copy)
        # exist: measured after them, every round of the step that came right after rclone's
        # took longer than its other rounds, which no scratch run without those folders showed
        # (docs/performance.md).
        large = {
            f"{d:g}": measure(conn, name, port, "raw", work, d, args) for d in args.large_delays_ms
        }
        large_apart = measure(conn, name, port, "raw", work, 0, args, server_apart=True)
        choices = large_choices(conn, name, work, args)
        small = {
            f"{d:g}": measure(conn, name, port, "images", work, d, args) for d in args.delays_ms
        }
        ceiling = {
            "small": copy_ceiling(work / f"step-images-{args.delays_ms[0]:g}ms-0", work),
            "large": copy_ceiling(work / f"step-raw-{args.large_delays_ms[0]:g}ms-0", work),
        }
        first_step = {
            f"{d:g}": loose_or_packed(conn, name, port, work, d, args) for d in args.delays_ms
        }
        staged = work / "packed"
        prefix = f"{PREFIX}/images"
        t_pack = time.perf_counter()
        packed = stage(container, prefix, staged, PACK_IMAGE_SIZE, args.workers)
        t_pack = time.perf_counter() - t_pack
        changed = change_one_percent(container, prefix, dataset.side_for(args.small_kb))
        t_changed = time.perf_counter()
        after = stage(container, prefix, staged, PACK_IMAGE_SIZE, args.workers)
        t_changed = time.perf_counter() - t_changed
    # The folders kept for the inode allocator's sake (see measure) stay: deleted now, they
    # would tax every file the next benchmark creates for a minute or more (ext4 without a
    # journal skips inodes deleted in the last 60 s, 300 s while their table is unwritten).
    # ``python -m bench`` deletes them once every benchmark has run. A run of this one alone
    # deletes the last run's at its start, so if that run ended minutes before, its small
    # files' cases pay the allocator's scan: run it through ``python -m bench`` for figures.
    return {
        "benchmark": "staging",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cores": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 1),
        "workers": args.workers,
        "method": f"{args.small:,} images of ~{args.small_kb:g} KB and {args.large} x "
        f"{args.large_mb} MB in Azurite on loopback; the step with {args.workers} downloads in "
        f"flight, rclone with --transfers {args.workers} --checkers {args.workers}; "
        f"per delay, {args.rounds} rounds of the small files and {args.large_rounds} of the "
        f"large ones, each followed by {args.resyncs} re-syncs (medians), page cache warm; "
        "Azurite on the client's cores, but in the case named apart (Azurite on one core, the "
        "client on the other)",
        "small": small,
        "large": large,
        "large_apart": {"0": large_apart} if large_apart else {},
        "cp_r": ceiling,
        "large_choices": choices,
        "first_pack": {**packed["shards"], "step_seconds": round(t_pack, 3)},
        "first_step": {"tar_files": shard_files, "tar_mb": args.tar_mb, "delays": first_step},
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
    p.add_argument("--small", type=int, default=5_000, help="small images")
    p.add_argument("--small-kb", type=float, default=20, help="size of each, about")
    p.add_argument("--large", type=int, default=4, help="large files")
    p.add_argument("--large-mb", type=int, default=64, help="size of each")
    p.add_argument("--workers", type=int, default=32, help="downloads in flight (both tools)")
    p.add_argument("--rounds", type=int, default=4, help="per case; the order alternates")
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0, 2, 10])
    p.add_argument("--tar-mb", type=int, default=16, help="tar shard size, the packed case")
    p.add_argument("--large-delays-ms", type=float, nargs="+", default=[0, 10])
    p.add_argument("--large-rounds", type=int, default=9, help="per large-file case")
    p.add_argument(
        "--resyncs", type=int, default=5, help="re-syncs after each round's sync (medians)"
    )
    return dataset_main(p, "staging", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
