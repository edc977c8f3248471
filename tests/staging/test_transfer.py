"""Large blobs against Azurite: read as parallel ranges, each pinned to one ETag, verified."""

from __future__ import annotations

import hashlib
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import API_VERSION
from staging.blob import Retry, list_pinned, object_store
from staging.listing import ChangedSinceGateError
from staging.sync import sync_to_directory
from staging.transfer import HOLD_BYTES, PIECE, Download, TransferError, download_all
from tests.reliability.fault_proxy import FaultProxy

SIZE = 2 * PIECE + 12_345  # three ranges, the last one short


def _settings(conn: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in conn.split(";") if "=" in p)


@pytest.fixture
def proxy(azurite: str) -> Iterator[FaultProxy]:
    """A proxy without faults in front of Azurite: it shows each request a client makes."""
    endpoint = urlparse(_settings(azurite)["BlobEndpoint"])
    proxy = FaultProxy(endpoint.port or 10000)
    yield proxy
    proxy.close()


@pytest.fixture
def container(azurite: str, proxy: FaultProxy) -> Iterator[ContainerClient]:
    """A fresh container, reached through ``proxy``."""
    name = f"large-{uuid.uuid4().hex[:12]}"
    direct = ContainerClient.from_connection_string(azurite, name, api_version=API_VERSION)
    direct.create_container()
    settings = _settings(azurite)
    conn = proxy.connection_string(settings["AccountName"], settings["AccountKey"])
    yield ContainerClient.from_connection_string(conn, name, api_version=API_VERSION)
    direct.delete_container()


def _record(proxy: FaultProxy) -> list[dict[str, str]]:
    seen: list[dict[str, str]] = []
    lock = threading.Lock()

    def before_get(path: str, headers: dict[str, str]) -> None:
        with lock:
            seen.append({"path": path, **headers})

    proxy.before_get = before_get
    return seen


def _range(headers: dict[str, str]) -> str | None:
    return headers.get("x-ms-range") or headers.get("range")


def test_a_large_blob_arrives_intact_as_pinned_ranges(
    container: ContainerClient, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A blob over PIECE is read as ranges, every one carrying If-Match on the listed ETag, and
    the file is the blob, verified against the MD5 the service stored."""
    data = random.Random(1).randbytes(SIZE)
    container.upload_blob("ds/big.bin", data)  # one Put Blob: the service stores its MD5
    (listed,) = list_pinned(container, "ds")
    assert listed.md5 is not None and listed.size == SIZE
    seen = _record(proxy)
    report = sync_to_directory(container, "ds", tmp_path / "data", listing=[listed])
    assert report.downloaded == ["ds/big.bin"]
    assert (tmp_path / "data" / "big.bin").read_bytes() == data
    gets = [h for h in seen if h["path"].endswith("/ds/big.bin")]
    assert sorted(_range(h) or "whole" for h in gets) == sorted(
        f"bytes={k * PIECE}-{min(SIZE, (k + 1) * PIECE) - 1}" for k in range(3)
    )
    assert {h.get("if-match") for h in gets} == {listed.etag}
    assert list((tmp_path / "data").rglob("*.part")) == []


def test_pieces_ahead_of_their_turn_beyond_the_hold_are_read_back(
    container: ContainerClient, proxy: FaultProxy, tmp_path: Path
) -> None:
    """The first range of a blob held back while the others arrive: past HOLD_BYTES they are
    not kept in memory but read back from the file to be hashed, and the file is still the
    blob (here one put as blocks, so without a stored MD5: the bytes are compared)."""
    size = HOLD_BYTES + 2 * PIECE + 777
    data = random.Random(2).randbytes(size)
    container.upload_blob("ds/huge.bin", data, max_concurrency=4)
    (listed,) = list_pinned(container, "ds")

    def first_range_last(path: str, headers: dict[str, str]) -> None:
        if (_range(headers) or "").startswith("bytes=0-"):
            time.sleep(2)  # every other piece arrives, and waits, before this one

    proxy.before_get = first_range_last
    report = sync_to_directory(container, "ds", tmp_path / "data", listing=[listed])
    assert report.downloaded == ["ds/huge.bin"]
    staged = (tmp_path / "data" / "huge.bin").read_bytes()
    assert hashlib.sha256(staged).digest() == hashlib.sha256(data).digest()


def test_a_large_blob_overwritten_after_the_gate_fails_named(
    container: ContainerClient, tmp_path: Path
) -> None:
    """Listed by the gate, then overwritten with other bytes of the same size: every range is
    refused (If-Match), the sync fails naming the blob, and nothing is left behind."""
    rng = random.Random(3)
    container.upload_blob("ds/big.bin", rng.randbytes(SIZE))
    listing = list_pinned(container, "ds")
    container.upload_blob("ds/big.bin", rng.randbytes(SIZE), overwrite=True)
    dest = tmp_path / "data"
    with pytest.raises(ChangedSinceGateError, match=r"blob 'ds/big\.bin' changed"):
        sync_to_directory(container, "ds", dest, listing=listing)
    assert not (dest / "big.bin").exists()
    assert list(dest.rglob("*.part")) == []


def test_a_large_blob_changed_between_its_ranges_fails_named(
    container: ContainerClient, proxy: FaultProxy, azurite: str, tmp_path: Path
) -> None:
    """Without the gate's listing too: the blob is overwritten after its first range was
    served; the next range is refused, so no file mixes two versions, and the blob is named."""
    rng = random.Random(4)
    direct = ContainerClient.from_connection_string(
        azurite, container.container_name, api_version=API_VERSION
    )
    container.upload_blob("ds/big.bin", rng.randbytes(SIZE))
    ranges = 0
    lock = threading.Lock()

    def overwrite_after_the_first(path: str, headers: dict[str, str]) -> None:
        nonlocal ranges
        if not path.endswith("/ds/big.bin") or _range(headers) is None:
            return
        with lock:
            ranges += 1
            if ranges == 2:
                direct.upload_blob("ds/big.bin", rng.randbytes(SIZE), overwrite=True)

    proxy.before_get = overwrite_after_the_first
    dest = tmp_path / "data"
    with pytest.raises(TransferError, match=r"blob 'ds/big\.bin' changed while it was being"):
        sync_to_directory(container, "ds", dest, workers=1)
    assert ranges >= 2
    assert not (dest / "big.bin").exists()
    assert list(dest.rglob("*.part")) == []


@pytest.mark.parametrize("size", [100, SIZE], ids=["whole", "ranges"])
def test_a_file_that_cannot_be_created_fails_the_download(
    container: ContainerClient, tmp_path: Path, size: int
) -> None:
    """A target whose folder cannot be made (a file is in the way) fails the download with
    the file system's error, for a blob read whole as for one read as ranges: never a
    download that ends as if it had landed everything."""
    container.upload_blob("ds/blob.bin", random.Random(5).randbytes(size))
    (blob,) = list_pinned(container, "ds")
    (tmp_path / "in-the-way").write_text("a file, not a folder")
    landed: list[str] = []
    job = Download(blob, tmp_path / "in-the-way" / "blob.bin")
    with pytest.raises(FileExistsError, match="in-the-way"):
        download_all(object_store(container), [job], True, 4, lambda j, *_: landed.append(j))
    assert landed == []


def test_ranges_cut_off_or_refused_are_fetched_again(
    container: ContainerClient, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Ranges answered 503, reset, or cut off halfway through their body: each is fetched
    again, and what lands is the blob, MD5-verified; a sync that still gives up leaves no
    file under the final name and no temp file, and the next attempt completes it."""
    data = random.Random(6).randbytes(SIZE)
    container.upload_blob("ds/big.bin", data)
    listing = list_pinned(container, "ds")
    proxy.rate, proxy.faults = 0.4, ("503", "reset", "truncate")
    dest = tmp_path / "data"
    fast = Retry(first_wait=0.01, max_wait=0.05)
    for _ in range(5):  # what the stage-data task's retries do
        try:
            sync_to_directory(container, "ds", dest, listing=listing, retry=fast)
            break
        except TransferError:
            assert not (dest / "big.bin").exists()
            assert list(dest.rglob("*.part")) == []
    else:
        pytest.fail("staging did not complete within 5 attempts")
    assert (dest / "big.bin").read_bytes() == data
    assert list(dest.rglob("*.part")) == []
    assert proxy.injected["truncate"] > 0


def test_the_range_size_is_the_modules_at_each_call(
    container: ContainerClient, proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIECE is read when a sync runs, as every other setting of the engine is: a setting
    changed for one sync (the benchmark's table of choices does this) is the one its requests
    use, not the value the module had when it was imported."""
    import staging.transfer

    monkeypatch.setattr(staging.transfer, "PIECE", 1 << 20)
    size = (5 << 20) // 2  # two whole ranges and a half
    data = random.Random(5).randbytes(size)
    container.upload_blob("ds/mid.bin", data)
    (listed,) = list_pinned(container, "ds")
    seen = _record(proxy)
    report = sync_to_directory(container, "ds", tmp_path / "data", listing=[listed])
    assert report.downloaded == ["ds/mid.bin"]
    assert (tmp_path / "data" / "mid.bin").read_bytes() == data
    ranges = sorted(_range(h) or "whole" for h in seen if h["path"].endswith("/ds/mid.bin"))
    assert ranges == [f"bytes={k << 20}-{min(size, (k + 1) << 20) - 1}" for k in range(3)]
