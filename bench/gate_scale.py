"""The data gate at ImageNet scale, on the project's own code paths, without a 1.28 M-blob Azurite.

Why: the gate (``gate.manifest.list_dataset`` -> ``build_manifest`` -> ``gate.suites.
run_expectations``) runs on the orchestrator before any GPU starts, and a 1.28 M-image dataset
is the size its users train on; generating such a container in Azurite takes hours here.

Method. A synthetic container is served by a small HTTP server in a process of its own (so its
CPU is not charged to the gate): it answers the Blob service's List Blobs request
(``GET /<account>/<container>?restype=container&comp=list&prefix=&marker=&maxresults=``) with
pages shaped as the REST reference documents them (``EnumerationResults`` / ``Blobs`` /
``Blob`` with ``Name`` and ``Properties``: ``Etag``, ``Content-Length``, ``Content-MD5``,
``Last-Modified``, ``BlobType``; ``NextMarker``). Each page is made on demand from its marker:
names in ImageNet's layout (``imagenet/train/n01440764/n01440764_10026.JPEG``, 1,000 classes,
ImageNet's 1,281,167 train images and a 50,000-image test split) in the service's order, sizes
of about 110 KB and MD5s derived from the blob's index. The gate reaches it through a real
``ContainerClient`` made from a connection string (Azurite's published development account;
the server does not check signatures), so the listing is the real ``list_pinned``. Then, each
timed on its own: (a) the listing; (b) ``build_manifest`` with every image's content already in
the gate's cache (the nightly run, or a new version of unchanged images: no header is read);
(c) ``run_expectations`` on rows sampled evenly from the manifest (every class kept) at the
sizes asked, larger ones only while the measured scaling says they fit the budget; (d) the
first gate's cost, one read and a whole decode per image, measured on real PNGs in Azurite.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import hashlib
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

from backends.local.azurite import ACCOUNT, connection_string, running_azurite
from bench.output import emit

CONTAINER = "imagenet"
PREFIX = "imagenet"
TRAIN = 1_281_167  # ImageNet-1k's train split
TEST = 50_000  # its validation split's size, here the test split
CLASSES = 1_000
PAGE = 5_000  # the service's largest page, what list_pinned asks for
LAST_MODIFIED = "Mon, 23 Nov 2026 00:00:00 GMT"
ENV = "GATE_SCALE_CONNECTION_STRING"  # the connection string the gate's location names


class SyntheticContainer:
    """The blobs of an ImageNet-shaped container, by index in the service's listing order:
    ``<prefix>/_SUCCESS`` first, then the test split, then train, class by class."""

    def __init__(self, train: int, test: int, classes: int, prefix: str = PREFIX) -> None:
        self.prefix = prefix
        self.wnids = [f"n{1440764 + 7919 * k:08d}" for k in range(classes)]  # sorted
        self.groups: list[tuple[str, str, int]] = []
        for split, total in (("test", test), ("train", train)):  # "test" < "train"
            for k, wnid in enumerate(self.wnids):
                self.groups.append((split, wnid, total // classes + (k < total % classes)))
        self.starts = [1]
        for _, _, count in self.groups:
            self.starts.append(self.starts[-1] + count)
        self.size = self.starts[-1]

    @lru_cache(maxsize=8)  # noqa: B019  # lives as long as the server; pages walk a class at a time
    def _names(self, group: int) -> list[str]:
        split, wnid, count = self.groups[group]
        return sorted(f"{self.prefix}/{split}/{wnid}/{wnid}_{j}.JPEG" for j in range(count))

    def name(self, index: int) -> str:
        if index == 0:
            return f"{self.prefix}/_SUCCESS"
        group = bisect.bisect_right(self.starts, index) - 1
        return self._names(group)[index - self.starts[group]]

    @staticmethod
    def bytes_of(index: int) -> int:
        """About 110 KB (60-160 KB), ImageNet's mean JPEG; the marker is empty."""
        return 0 if index == 0 else 60_000 + (index * 7_919_993) % 100_001

    @staticmethod
    def md5_of(index: int) -> str:
        digest = hashlib.md5(index.to_bytes(8, "big"), usedforsecurity=False).digest()
        return base64.b64encode(digest).decode()

    @staticmethod
    def etag_of(index: int) -> str:
        return f'"0x8DD{index:013X}"'

    def page(self, endpoint: str, prefix: str, marker: str, max_results: int) -> bytes:
        """One List Blobs response body: up to ``max_results`` blobs from ``marker``."""
        first = int(marker[1:]) if marker.startswith("i") else 0
        last = min(self.size, first + max_results) if prefix in ("", f"{self.prefix}/") else 0
        parts = [
            '<?xml version="1.0" encoding="utf-8"?>',
            f'<EnumerationResults ServiceEndpoint="{escape(endpoint)}/" '
            f'ContainerName="{CONTAINER}">',
            f"<Prefix>{escape(prefix)}</Prefix><Marker>{escape(marker)}</Marker>",
            f"<MaxResults>{max_results}</MaxResults><Blobs>",
        ]
        for i in range(first, last):
            parts.append(
                f"<Blob><Name>{escape(self.name(i))}</Name><Properties>"
                f"<Creation-Time>{LAST_MODIFIED}</Creation-Time>"
                f"<Last-Modified>{LAST_MODIFIED}</Last-Modified><Etag>{self.etag_of(i)}</Etag>"
                f"<Content-Length>{self.bytes_of(i)}</Content-Length>"
                "<Content-Type>image/jpeg</Content-Type><Content-Encoding /><Content-Language />"
                f"<Content-MD5>{self.md5_of(i)}</Content-MD5><Cache-Control />"
                "<BlobType>BlockBlob</BlobType><AccessTier>Hot</AccessTier>"
                "<AccessTierInferred>true</AccessTierInferred><LeaseStatus>unlocked</LeaseStatus>"
                "<LeaseState>available</LeaseState><ServerEncrypted>true</ServerEncrypted>"
                "</Properties><OrMetadata /></Blob>"
            )
        parts.append("</Blobs>")
        parts.append(
            f"<NextMarker>i{last}</NextMarker>" if 0 < last < self.size else "<NextMarker />"
        )
        parts.append("</EnumerationResults>")
        return "".join(parts).encode()


def _handler(
    blobs: SyntheticContainer, endpoint: list[str], delay: float
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's pool expects

        def do_GET(self) -> None:  # the name http.server dispatches to
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            listing = query.get("restype") == "container" and query.get("comp") == "list"
            if url.path.rstrip("/") != f"/{ACCOUNT}/{CONTAINER}" or not listing:
                self._send(404, b"", "text/plain")
                return
            time.sleep(delay)  # the service's time to answer, on top of making the page
            body = blobs.page(
                endpoint[0],
                query.get("prefix", ""),
                query.get("marker", ""),
                min(PAGE, int(query.get("maxresults", PAGE))),
            )
            self._send(200, body, "application/xml")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-ms-version", "2025-01-05")
            self.send_header("x-ms-request-id", "00000000-0000-0000-0000-000000000000")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def _serve(train: int, test: int, classes: int, ready: Any, delay: float) -> None:
    """The server process: answers List Blobs until terminated; sends its port first."""
    blobs = SyntheticContainer(train, test, classes)
    endpoint = [""]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(blobs, endpoint, delay))
    port = int(server.server_address[1])
    endpoint[0] = f"http://127.0.0.1:{port}/{ACCOUNT}"
    ready.send(port)
    server.serve_forever()


@contextmanager
def synthetic_container(train: int, test: int, classes: int, delay: float = 0.0) -> Iterator[str]:
    """Serve the synthetic container from another process, each page ``delay`` seconds after
    it is asked for; yields its connection string."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_serve, args=(train, test, classes, theirs, delay), daemon=True
    )
    process.start()
    try:
        if not ours.poll(60):
            raise TimeoutError("the synthetic Blob server did not start within 60 s")
        yield connection_string(int(ours.recv()))
    finally:
        process.terminate()
        process.join(10)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """``fn()``, and its wall and CPU seconds, the load and the process's peak RSS after it."""
    cpu, started = _cpu(), time.perf_counter()
    value = fn()
    timing = {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(_cpu() - cpu, 2),
        "load_average": round(os.getloadavg()[0], 1),
        "peak_rss_mib_so_far": round(_peak_mib()),
    }
    print(f"gate_scale: {getattr(fn, '__name__', 'step')} {timing}", file=sys.stderr, flush=True)
    return value, timing


def _prefill(cache_file: Path, blobs: list[Any]) -> None:
    """The cache as the gate writes it, every image's content described (a JPEG of 500x375)."""
    from gate.manifest import _content_key

    entries = {
        _content_key(b): {
            "width": 500,
            "height": 375,
            "channels": 3,
            "readable": True,
            "md5": b.md5,
        }
        for b in blobs
    }
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(entries, separators=(",", ":")))


def _expectations(rows: list[dict[str, Any]], sizes: list[int], budget: float) -> list[Any]:
    """``run_expectations`` (and, apart, its ``class_counts``) on evenly sampled rows."""
    from core.config import ValidationConfig
    from gate.manifest import class_counts
    from gate.suites import run_expectations

    with tempfile.TemporaryDirectory() as docs:  # untimed: Great Expectations' first import
        run_expectations(rows[:: max(1, len(rows) // 2_000)], ValidationConfig(), Path(docs))
    measured: list[dict[str, Any]] = []
    for n in sorted(sizes):
        sample = [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]
        done = [m for m in measured if "run_expectations" in m]
        if done:  # the measured growth per row, applied to n: run only when it fits
            last = done[-1]
            predicted = last["run_expectations"]["wall_s"] * n / last["rows"]
            if predicted > budget:
                measured.append({"rows": n, "skipped_predicted_s": round(predicted)})
                continue
        with tempfile.TemporaryDirectory() as docs:
            (ok, records), timing = _timed(
                lambda s=sample, d=docs: run_expectations(s, ValidationConfig(), Path(d))  # type: ignore[misc]
            )
        _, counting = _timed(lambda s=sample: class_counts(s))  # type: ignore[misc]
        measured.append(
            {
                "rows": len(sample),
                "classes": len({r["label"] for r in sample}),
                "passed": ok,
                "expectations": len(records),
                "failed": [
                    f"{r['expectation']}({r['column']})" for r in records if not r["success"]
                ],
                "run_expectations": timing,
                "class_counts": counting,
            }
        )
    return measured


def _header_reads(count: int, work: Path) -> dict[str, Any]:
    """A first gate over ``count`` real PNGs in Azurite: one read and a decode per image."""
    from azure.storage.blob import ContainerClient

    from bench.dataset import png_images
    from core.config import BlobLocation
    from gate.manifest import build_manifest, list_dataset

    images = png_images(count, 64, seed=7)
    with tempfile.TemporaryDirectory(dir=work) as fresh, running_azurite(Path(fresh)) as conn:
        container = ContainerClient.from_connection_string(conn, "sample")
        container.create_container()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda x: container.upload_blob(f"sample/{x[0]}", x[1]), images))
        os.environ[ENV] = conn
        location = BlobLocation(container="sample", prefix="sample", connection_string_env=ENV)
        blobs = list_dataset(location)
        (rows, reused), timing = _timed(
            lambda: build_manifest(location, Path(fresh) / "cache", blobs=blobs)
        )
    readable = sum(1 for r in rows if r["readable"])
    return {
        "images": len(rows),
        "readable": readable,
        "reused": reused,
        "with_md5": sum(1 for b in blobs if b.md5),
        "bytes_each": round(sum(len(b) for _, b in images) / len(images)),
        "reads_per_s": round(len(rows) / max(timing["wall_s"], 1e-9), 1),
        **timing,
    }


def _listing_ahead(args: argparse.Namespace) -> dict[str, Any]:
    """The listing's two choices, with each page ``--page-delay-ms`` after it is asked for
    (a stand-in for the service's time to answer, which this server does not have),
    alternating, medians: as shipped (the next page asked for before this one is read, the
    collector paused while a page is read); one page after another; and the collector running
    while a page is read. Measured with Prefect imported, as in the flow's process: the
    collector's cost grows with the objects a process holds."""
    import contextlib
    import gc
    from unittest import mock

    import prefect  # noqa: F401  # the heap of the process the gate runs in

    import staging.blob
    from staging.blob import list_pinned

    classes = max(1, min(args.classes, args.ahead_blobs // 1_000))
    delay = args.page_delay_ms / 1000
    ways: dict[str, list[tuple[Any, dict[str, Any]]]] = {
        "ahead": [],
        "one_after_another": [(staging.blob, {"LIST_AHEAD": False})],
        "collector_running": [(staging.blob, {"paused_gc": contextlib.nullcontext})],
    }
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    with synthetic_container(args.ahead_blobs, 0, classes, delay) as conn:
        from azure.storage.blob import ContainerClient

        container = ContainerClient.from_connection_string(conn, CONTAINER)
        tracked = len(gc.get_objects())
        for rnd in range(args.ahead_rounds):
            for way in list(ways) if rnd % 2 == 0 else list(ways)[::-1]:
                with contextlib.ExitStack() as changed:
                    for module, settings in ways[way]:
                        changed.enter_context(mock.patch.multiple(module, **settings))
                    listed, timing = _timed(lambda: list_pinned(container, PREFIX))
                runs[way].append({"blobs": len(listed), **timing})
                del listed
    medians = {
        way: {k: statistics.median(r[k] for r in rs) for k in ("blobs", "wall_s", "cpu_s")}
        for way, rs in runs.items()
    }
    return {
        "page_delay_ms": args.page_delay_ms,
        "pages": -(-int(medians["ahead"]["blobs"]) // PAGE),
        "rounds": args.ahead_rounds,
        "tracked_objects": tracked,
        **medians,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from core.config import BlobLocation
    from gate.manifest import build_manifest, cache_path, list_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "gate_scale",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cores": os.cpu_count(),
        "method": f"{args.train:,} train + {args.test:,} test blobs in {args.classes:,} classes "
        "served by a synthetic List Blobs server in its own process; the gate's code through "
        "a real ContainerClient",
    }
    # First, in a process holding no listing yet: the collector's cost grows with what it holds.
    result["listing_ahead"] = _listing_ahead(args)
    with synthetic_container(args.train, args.test, args.classes) as conn:
        os.environ[ENV] = conn
        location = BlobLocation(container=CONTAINER, prefix=PREFIX, connection_string_env=ENV)
        blobs, listing = _timed(lambda: list_dataset(location))
    result["listing"] = {
        "blobs": len(blobs),
        "blobs_per_s": round(len(blobs) / max(listing["wall_s"], 1e-9)),
        **listing,
    }
    with tempfile.TemporaryDirectory(dir=work) as cache_dir:
        _prefill(cache_path(location, Path(cache_dir)), blobs)
        (rows, reused), manifest = _timed(
            lambda: build_manifest(location, Path(cache_dir), blobs=blobs)
        )
    result["cached_manifest"] = {"rows": len(rows), "reused": reused, **manifest}
    blobs.clear()  # what the gate no longer needs
    result["expectations"] = _expectations(rows, args.expect_rows, args.budget)
    del rows
    result["header_reads"] = _header_reads(args.sample, work)
    total = args.train + args.test
    result["first_gate_estimate_s"] = round(total / result["header_reads"]["reads_per_s"])
    return result


def main(argv: list[str] | None = None) -> int:
    from bench.output import ROOT

    p = argparse.ArgumentParser(
        prog="python -m bench.gate_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--train", type=int, default=TRAIN, help="train images")
    p.add_argument("--test", type=int, default=TEST, help="test images")
    p.add_argument("--classes", type=int, default=CLASSES)
    p.add_argument(
        "--expect-rows",
        type=int,
        nargs="+",
        default=[30_000, 100_000, 300_000, TRAIN + TEST],
        help="manifest sizes for run_expectations (sampled evenly, every class kept)",
    )
    p.add_argument(
        "--budget", type=float, default=300, help="seconds a run_expectations size may take"
    )
    p.add_argument("--sample", type=int, default=2_000, help="PNGs for the first gate's read rate")
    p.add_argument(
        "--ahead-blobs", type=int, default=200_000, help="blobs for the listing-ahead comparison"
    )
    p.add_argument(
        "--page-delay-ms",
        type=float,
        default=100,
        help="for that comparison: each page's answer this long after it is asked for",
    )
    p.add_argument("--ahead-rounds", type=int, default=3, help="rounds of that comparison")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "gate_scale", help="scratch")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
