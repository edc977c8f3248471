"""A sync killed (SIGKILL: a node pre-empted, a task timed out, an OOM kill) at each point it
can die, then the next data version staged into the same folder: the folder then holds exactly
the new listing, and no temporary file.

The staging task runs as the Batch node runs it (``python -m staging.task``), in a process of
its own, and dies by SIGKILL: after some of its files were renamed into place, in the middle of
a blob read as ranges (a proxy holds its later ranges), or with every file in place just before
its manifest is written. Where it dies is found without touching its code: a Python audit hook
in the child kills it when it asks the operating system for the rename or the open of that
point. Every case is recorded for docs/reliability.md ("Storage faults").
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from azure.storage.blob import ContainerClient, ContainerSasPermissions, generate_container_sas
from PIL import Image

from imagedata.image_folders import list_image_folders
from imagedata.staged_folder import MANIFEST, TEMP_PREFIX
from staging.listing import PinnedBlob, listing_json, pin
from staging.sync import stage
from staging.transfer import PIECE
from tests.conftest import child_env
from tests.pipeline_helpers import new_container
from tests.reliability import report
from tests.reliability.fault_proxy import FaultProxy

# The staging task, killed by SIGKILL when it reaches the point named by its first argument:
# ``rename N`` as it renames its (N+1)-th downloaded file into place (N are in place, the next
# one is written whole under its temporary name); ``manifest`` as it opens the temporary file
# of its manifest; ``none``: killed from outside. The rest of the arguments are the task's.
CHILD = r"""
import os, signal, sys

point, count = sys.argv[1], int(sys.argv[2])
renames = 0


def kill_at(event, args):
    global renames
    if point == "rename" and event == "os.rename" and str(args[0]).endswith(".part"):
        renames += 1
        if renames > count:
            os.kill(os.getpid(), signal.SIGKILL)
    elif point == "manifest" and event == "open" and ".staging-manifest.json." in str(args[0]):
        os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(kill_at)
from staging.task import main

sys.exit(main(sys.argv[3:]))
"""


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _version(classes: tuple[str, ...], seed: int = 0) -> dict[str, bytes]:
    return {
        f"{split}/{c}/{i}.png": _png(seed + 100 * k + i + (50 if split == "test" else 0))
        for k, c in enumerate(classes)
        for split in ("train", "test")
        for i in range(4)
    }


def _upload(container: ContainerClient, prefix: str, files: dict[str, bytes]) -> list[PinnedBlob]:
    for rel, data in files.items():
        container.upload_blob(f"{prefix}/{rel}", data, overwrite=True)
    return [pin(b) for b in container.list_blobs(name_starts_with=f"{prefix}/")]


def _sas_url(container: ContainerClient, port: int | None = None) -> str:
    sas = generate_container_sas(
        container.account_name,
        container.container_name,
        account_key=container.credential.account_key,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    url = urlsplit(container.url)
    if port is not None:  # through the proxy
        url = url._replace(netloc=f"127.0.0.1:{port}")
    return f"{url.geturl()}?{sas}"


def _start_sync(
    tmp_path: Path, url: str, prefix: str, listing: list[PinnedBlob], dest: Path, *point: str
) -> subprocess.Popen[str]:
    listing_file = tmp_path / f"{prefix.replace('/', '-')}.json"
    listing_file.write_bytes(listing_json(prefix, listing))
    env = child_env() | {"RETRAIN_DATA_URL": url}
    return subprocess.Popen(
        [
            *(sys.executable, "-c", CHILD, *point, "--prefix", prefix, "--dest", str(dest)),
            *("--report", str(tmp_path / "report.json"), "--listing", str(listing_file)),
            *("--workers", "2"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _killed(child: subprocess.Popen[str], timeout: float = 120) -> None:
    output, _ = child.communicate(timeout=timeout)
    assert child.returncode == -signal.SIGKILL, f"exit {child.returncode}: {output[-2000:]}"


def _tree(dest: Path) -> set[str]:
    """Every entry below ``dest`` (files, folders, links, hidden ones too) but the manifest."""
    return {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.name != MANIFEST}


def _expected_tree(files: dict[str, bytes]) -> set[str]:
    folders = {Path(rel).parent.as_posix() for rel in files}
    folders |= {Path(f).parent.as_posix() for f in folders}
    return (set(files) | folders) - {"."}


@pytest.fixture
def container(azurite: str) -> Iterator[ContainerClient]:
    client = new_container(azurite, "killed")
    yield client
    client.delete_container()


def _stage_v3_and_check(
    container: ContainerClient, dest: Path, left: set[str], v3: dict[str, bytes]
) -> dict[str, object]:
    """Stage v3 (classes a and b) after the killed sync; the folder must hold exactly v3."""
    listing = _upload(container, "images/v3", v3)
    done = stage(container, "images/v3", dest, 0, listing=listing)
    assert _tree(dest) == _expected_tree(v3), f"killed sync left {sorted(left)}"
    assert all((dest / rel).read_bytes() == data for rel, data in v3.items())
    assert not [p for p in dest.rglob(f"{TEMP_PREFIX}*") if p.name != MANIFEST]
    class_names, _ = list_image_folders(dest)
    assert class_names == ["a", "b"]  # what the trainer reads
    return done


def _left_by(dest: Path, v1: dict[str, bytes]) -> set[str]:
    """What the killed sync left beyond v1: its files renamed into place and temporary files."""
    return {
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if p.is_file() and p.name != MANIFEST and p.relative_to(dest).as_posix() not in v1
    }


@pytest.mark.parametrize("point", ["after 3 renames", "before the manifest"])
def test_a_sync_killed_leaves_nothing_the_next_listing_does_not_name(
    container: ContainerClient, tmp_path: Path, point: str
) -> None:
    """v1 (a, b) staged; v2 (a, b and a class ``bad``) killed at ``point``; v3 (a, b, one
    image changed, one gone) staged: no ``bad`` folder, no temporary file, exactly v3."""
    dest = tmp_path / "nfs" / "data"
    v1 = _version(("a", "b"))
    stage(container, "images/v1", dest, 0, listing=_upload(container, "images/v1", v1))
    v2 = v1 | _version(("bad",), seed=1000)
    listing = _upload(container, "images/v2", v2)
    args = ("rename", "3") if point == "after 3 renames" else ("manifest", "0")
    _killed(_start_sync(tmp_path, _sas_url(container), "images/v2", listing, dest, *args))
    left = _left_by(dest, v1)
    bad = {rel for rel in left if "/bad/" in f"/{rel}" and not rel.endswith(".part")}
    if point == "after 3 renames":
        # 3 in place, the fourth (and any other in hand) under its temporary name
        temporary = left - bad
        assert len(bad) == 3 and temporary, sorted(left)
        assert all(Path(rel).name.startswith(TEMP_PREFIX) for rel in temporary), sorted(left)
    else:
        assert bad == {rel for rel in v2 if rel not in v1}, sorted(left)

    v3 = {k: v for k, v in v1.items() if k != "train/b/3.png"} | {"train/a/0.png": _png(999)}
    done = _stage_v3_and_check(container, dest, left, v3)
    assert sorted(done["removed"]) == sorted(left)  # type: ignore[arg-type]
    report.record(
        "storage",
        f"staging task SIGKILLed {point} of v2 (v1 + class 'bad'), then v3 (v1's classes) "
        "staged into the folder",
        f"folder holds exactly v3; the {len(left)} files the killed sync left "
        f"({len(bad)} of class 'bad', {len(left - bad)} temporary) deleted; trainer's classes "
        "['a', 'b']",
        before_fix="class 'bad' stayed in the folder: the trainer read 3 classes",
    )


def test_a_sync_killed_inside_a_large_blob_leaves_no_temporary_file(
    container: ContainerClient, tmp_path: Path
) -> None:
    """v2 adds a blob read as ranges; the task is killed once its first range is written (a
    proxy holds the others): the partial temporary file goes with the next sync."""
    dest = tmp_path / "nfs" / "data"
    v1 = _version(("a", "b"))
    stage(container, "images/v1", dest, 0, listing=_upload(container, "images/v1", v1))
    big = "train/bad/big.png"
    v2 = v1 | _version(("bad",), seed=1000) | {big: os.urandom(PIECE + PIECE // 4)}
    listing = _upload(container, "images/v2", v2)
    release = threading.Event()

    def hold_later_ranges(path: str, headers: dict[str, str]) -> None:
        if path.endswith(big) and not headers.get("range", "").startswith("bytes=0-"):
            release.wait(60)

    proxy = FaultProxy(urlsplit(container.url).port or 0)
    proxy.before_get = hold_later_ranges
    try:
        child = _start_sync(
            tmp_path, _sas_url(container, proxy.port), "images/v2", listing, dest, "none", "0"
        )
        deadline = time.monotonic() + 90
        partial: list[Path] = []
        while not partial and time.monotonic() < deadline and child.poll() is None:
            partial = (
                [
                    p
                    for p in (dest / "train" / "bad").glob(f"{TEMP_PREFIX}*.part")
                    if p.stat().st_size >= PIECE
                ]
                if (dest / "train" / "bad").is_dir()
                else []
            )
            time.sleep(0.02)
        assert partial, "the first range of the large blob was never written"
        child.send_signal(signal.SIGKILL)
        _killed(child)
    finally:
        release.set()
        proxy.close()
    left = _left_by(dest, v1)
    assert {p.relative_to(dest).as_posix() for p in partial} <= left

    v3 = {k: v for k, v in v1.items() if k != "train/b/3.png"} | {"train/a/0.png": _png(999)}
    done = _stage_v3_and_check(container, dest, left, v3)
    assert sorted(done["removed"]) == sorted(left)  # type: ignore[arg-type]
    report.record(
        "storage",
        f"staging task SIGKILLed inside a blob of {len(v2[big]) >> 20} MB read as ranges "
        "(first range written), then the next version staged",
        f"folder holds exactly the next version; the partial temporary file and the "
        f"{len(left) - len(partial)} other files the killed sync left deleted",
        before_fix="class 'bad' and the partial temporary file stayed for good",
    )
