"""Storage faults: staging and results upload through a fault-injecting proxy in front of
Azurite. Nothing is lost, nothing half-written is ever visible, an interrupted sync resumes."""

from __future__ import annotations

import hashlib
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import API_VERSION, upload_directory
from imagedata.staged_folder import MANIFEST
from staging.blob import Retry
from staging.sync import sync_to_directory
from tests.reliability import report, trials
from tests.reliability.fault_proxy import FaultProxy

# Staging's retries with waits of tens of milliseconds: the same behaviour, faster tests.
FAST = Retry(request_retries=3, first_wait=0.05, max_wait=0.2, blob_attempts=3)


def _parts(conn: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in conn.split(";") if "=" in p)


@pytest.fixture
def dataset(azurite: str) -> Iterator[tuple[ContainerClient, dict[str, bytes]]]:
    """300 small files and 3 larger ones in a fresh container, uploaded directly."""
    container = ContainerClient.from_connection_string(
        azurite, f"faults-{uuid.uuid4().hex[:10]}", api_version=API_VERSION
    )
    container.create_container()
    rng = random.Random(7)
    files = {
        f"ds/train/{i % 10}/{i:04d}.bin": rng.randbytes(rng.randint(2_000, 20_000))
        for i in range(300)
    }
    files.update({f"ds/big/{i}.bin": rng.randbytes(3_000_000) for i in range(3)})
    from azure.storage.blob import ContentSettings

    for name, data in files.items():
        md5 = bytearray(hashlib.md5(data, usedforsecurity=False).digest())
        container.upload_blob(name, data, content_settings=ContentSettings(content_md5=md5))
    yield container, files
    container.delete_container()


def _through(proxy: FaultProxy, azurite: str, container: str) -> ContainerClient:
    parts = _parts(azurite)
    conn = proxy.connection_string(parts["AccountName"], parts["AccountKey"])
    return ContainerClient.from_connection_string(
        conn,
        container,
        api_version=API_VERSION,
        retry_total=3,
        # The storage SDK's ExponentialRetry reads these (it ignores azure-core's
        # retry_backoff_*): waits of about 0.2 s rather than its default 15, 18, 24 s.
        initial_backoff=0,
        increment_base=0.2,
        random_jitter_range=0.05,
        max_single_get_size=1 << 20,
        max_chunk_get_size=1 << 20,
    )


class PartialWatcher(threading.Thread):
    """Scans the destination while a sync runs: any file under its final name must already be
    complete and correct. Counts checks and violations."""

    def __init__(self, dest: Path, files: dict[str, bytes]) -> None:
        super().__init__(daemon=True)
        self.dest, self.expected = dest, {n.removeprefix("ds/"): d for n, d in files.items()}
        self.stop, self.checks, self.violations = threading.Event(), 0, []

    def run(self) -> None:
        verified: dict[str, int] = {}  # path -> mtime_ns already checked
        while not self.stop.is_set():
            for path in self.dest.rglob("*"):
                rel = path.relative_to(self.dest).as_posix()
                if rel not in self.expected:
                    continue
                try:
                    mtime = path.stat().st_mtime_ns
                    if verified.get(rel) == mtime:
                        continue
                    data = path.read_bytes()
                except FileNotFoundError:
                    continue
                self.checks += 1
                verified[rel] = mtime
                if data != self.expected[rel]:
                    self.violations.append(rel)
            time.sleep(0.01)  # leave the CPU to the sync


@pytest.mark.parametrize("trial", trials())
def test_staging_survives_faults_with_every_file_verified(
    trial: int, azurite: str, dataset: tuple[ContainerClient, dict[str, bytes]], tmp_path: Path
) -> None:
    source, files = dataset
    proxy = FaultProxy(urlparse_port(azurite), rate=0.15, seed=trial, slow_seconds=0.1)
    dest = tmp_path / "nfs"
    dest.mkdir()
    watcher = PartialWatcher(dest, files)
    watcher.start()
    attempts = 0
    try:
        while True:  # what the stage-data task's retries do
            attempts += 1
            try:
                sync_to_directory(
                    _through(proxy, azurite, source.container_name), "ds", dest, retry=FAST
                )
                break
            except Exception:
                assert attempts < 6, "staging did not complete within 5 retries"
    finally:
        watcher.stop.set()
        watcher.join()
        proxy.close()
    on_disk = {
        p.relative_to(dest).as_posix(): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    assert on_disk == {n.removeprefix("ds/"): d for n, d in files.items()}
    assert not [p for p in dest.rglob("*") if p.name.endswith(".part")]
    assert watcher.violations == []
    assert sum(proxy.injected.values()) > 10  # faults really happened
    report.record(
        "storage",
        f"staging, trial {trial + 1}",
        "complete, all MD5s match",
        files=len(files),
        faults=dict(proxy.injected),
        requests=proxy.requests,
        sync_attempts=attempts,
        partial_file_checks=watcher.checks,
        partial_visible=0,
    )


def urlparse_port(conn: str) -> int:
    from urllib.parse import urlparse

    return int(urlparse(_parts(conn)["BlobEndpoint"]).port or 10000)


def test_interrupted_sync_resumes_without_downloading_finished_files(
    azurite: str, dataset: tuple[ContainerClient, dict[str, bytes]], tmp_path: Path
) -> None:
    source, files = dataset
    proxy = FaultProxy(urlparse_port(azurite))
    proxy.cut_after = 120  # the connection to storage dies after 120 blobs
    dest = tmp_path / "nfs"
    container = _through(proxy, azurite, source.container_name)
    with pytest.raises(Exception):  # noqa: B017 - whatever staging raises once retries run out
        sync_to_directory(container, "ds", dest, workers=4, retry=FAST)
    finished = {p.relative_to(dest).as_posix() for p in dest.rglob("*.bin")}
    proxy.cut_after = None
    second = sync_to_directory(container, "ds", dest, workers=4, retry=FAST)
    proxy.close()
    assert len(finished) >= 100
    assert second.skipped == len(finished)  # none fetched again
    assert sorted(second.downloaded) == sorted(set(files) - {f"ds/{n}" for n in finished})
    # Every blob was served in full exactly once over both syncs (one GET per blob).
    account = f"/{_parts(azurite)['AccountName']}/{source.container_name}"
    assert dict(proxy.served_gets) == {f"{account}/{n}": 1 for n in files}
    report.record(
        "storage",
        "sync cut after 120 blobs, then resumed",
        "resumed; finished files kept",
        files=len(files),
        finished_before_cut=len(finished),
        downloaded_after=len(second.downloaded),
        downloaded_twice=0,
    )


def test_results_upload_survives_faults(azurite: str, tmp_path: Path) -> None:
    rng = random.Random(3)
    source = tmp_path / "outputs"
    expected = {}
    for i in range(40):
        data = rng.randbytes(rng.randint(1_000, 200_000))
        path = source / f"run/{i % 4}/file{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        expected[f"results/run/{i % 4}/file{i}.bin"] = hashlib.md5(
            data, usedforsecurity=False
        ).hexdigest()
    name = f"upload-{uuid.uuid4().hex[:10]}"
    direct = ContainerClient.from_connection_string(azurite, name, api_version=API_VERSION)
    direct.create_container()
    proxy = FaultProxy(
        urlparse_port(azurite), rate=0.2, seed=11, faults=("reset", "503", "slow", "lost")
    )
    uploaded = upload_directory(_through(proxy, azurite, name), source, "results")
    proxy.close()
    stored = {
        b.name: hashlib.md5(
            direct.download_blob(b.name).readall(), usedforsecurity=False
        ).hexdigest()
        for b in direct.list_blobs()
    }
    assert uploaded == 40 and stored == expected
    report.record(
        "storage",
        f"results upload ({len(expected)} files)",
        "complete, all MD5s match",
        files=len(expected),
        faults=dict(proxy.injected),
        requests=proxy.requests,
    )
    direct.delete_container()
