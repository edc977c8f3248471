"""The data upload (``python -m cli.data upload``) against what a careless user, a hostile
folder and a second upload of the same version do, on Azurite.

- A complete version never changes: an upload paused after its checks (a laptop asleep) while
  another completes the version stops and says so, writing and deleting nothing; every write is
  conditional on what the upload listed.
- Links: one leading out of the folder is refused by name; one inside it is followed; no
  folder is left out without a word.
- The gate's cheap per-file checks (bytes, pixels by the header) run before a byte is sent.
- The README's "Use your own data" commands work as written in a fresh shell.
- A new version's files that the previous version holds are copied in storage, not sent.

Each case is recorded for docs/reliability.md ("Adversarial inputs").
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from azure.storage.blob import ContainerClient
from PIL import Image

from backends import version_upload
from backends.version_upload import LocalFile, Uploaded, UploadError, local_files, upload_version
from cli.data import main as data
from core.data_versions import DataRoot
from imagedata.images import MAX_IMAGE_BYTES
from tests.conftest import ROOT
from tests.pipeline_helpers import new_container
from tests.reliability import report

LOCAL = str(ROOT / "configs" / "local.yaml")
WAIT = 60  # seconds a paused upload or its releaser waits at most: past it, the test fails


@pytest.fixture
def container(azurite: str) -> ContainerClient:
    return new_container(azurite, "upl")


def _folder(path: Path, files: dict[str, bytes]) -> list[LocalFile]:
    for rel, content in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(content)
    return local_files(path)


def _state(container: ContainerClient, prefix: str) -> dict[str, str]:
    """Every blob below ``prefix`` and its ETag: what a complete version must keep."""
    return {b.name: b.etag for b in container.list_blobs(name_starts_with=f"{prefix}/")}


class Pause:
    """Holds the upload running in ``owner`` once, at the point it is called from, until
    released; every other thread passes. A laptop asleep, without a sleep."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.owner: threading.Thread | None = None

    def __call__(self) -> None:
        if threading.current_thread() is self.owner and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(WAIT), "the paused upload was never released"


def _late_upload(
    run: Callable[[], Uploaded], pause: Pause, meanwhile: Callable[[], None]
) -> Uploaded | BaseException:
    """``run`` in a thread of its own, held by ``pause``; ``meanwhile`` runs while it is held.
    What ``run`` returned or raised."""
    outcome: list[Uploaded | BaseException] = []

    def late() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # reported to the test, which judges it
            outcome.append(exc)

    pause.owner = threading.Thread(target=late)
    pause.owner.start()
    try:
        assert pause.reached.wait(WAIT), outcome
        meanwhile()
    finally:
        pause.go.set()
        pause.owner.join(WAIT)
    assert not pause.owner.is_alive() and outcome
    return outcome[0]


A_FILES = {f"train/c{i % 2}/{i:02d}.png": f"upload A, file {i}".encode() for i in range(8)}


@pytest.mark.parametrize("delete_extra", [False, True], ids=["plain", "delete-extra"])
@pytest.mark.parametrize("paused", ["after its checks", "after its listing"])
def test_a_late_upload_never_changes_a_version_another_completed(
    container: ContainerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    paused: str,
    delete_extra: bool,
) -> None:
    """Upload B of v1 is held after its checks (the version incomplete then), upload A of v1
    runs to its end, B resumes. B stops and says the version was completed meanwhile; v1 holds
    A's blobs, as A left them, and nothing else. B's folder has the same names with other
    bytes, one name A's lacks, and lacks one of A's (which --delete-extra would delete)."""
    root = DataRoot(container.container_name, "mine")
    # An earlier upload cut short left a blob neither folder holds: both need --delete-extra.
    if delete_extra:
        container.upload_blob("mine/v1/train/c0/stale.png", b"an earlier upload's")
    a = _folder(tmp_path / "a", A_FILES)
    b_files = {rel: b"upload B: " + content for rel, content in A_FILES.items()}
    b_files.pop("train/c1/07.png")
    b_files["train/c0/extra.png"] = b"only B has it"
    b = _folder(tmp_path / "b", b_files)

    pause = Pause()
    say: Callable[[str], None] = print
    if paused == "after its checks":  # the version was surveyed and found incomplete
        checked = version_upload.check_target

        def check_then_pause(*args: Any) -> Any:
            found = checked(*args)
            pause()
            return found

        monkeypatch.setattr(version_upload, "check_target", check_then_pause)
    else:  # and its blobs listed, the plan said: the next request is a write

        def say(line: str) -> None:
            print(line)
            if line.startswith("uploading"):
                pause()

    completed: dict[str, str] = {}

    def upload_a() -> None:
        upload_version(container, root, "v1", a, workers=2, delete_extra=delete_extra)
        completed.update(_state(container, "mine/v1"))

    late = _late_upload(
        lambda: upload_version(
            container, root, "v1", b, workers=2, delete_extra=delete_extra, say=say
        ),
        pause,
        upload_a,
    )
    assert isinstance(late, UploadError), late
    assert "was completed by another upload while this one ran" in str(late)
    assert "mine/v1/_SUCCESS" in completed
    assert _state(container, "mine/v1") == completed  # not a blob written, replaced or deleted
    report.record(
        "adversarial",
        f"upload: B of v1 paused {paused}{' (--delete-extra)' if delete_extra else ''}, "
        "upload A of v1 completes, B resumes",
        "B stops: 'completed by another upload while this one ran'; v1 holds A's "
        f"{len(completed) - 1} blobs and marker, ETags unchanged",
        message=str(late)[:160],
        before_fix=BEFORE_FIX[(paused, delete_extra)],
    )


# What the same probe found before every write was conditional and fenced by the marker.
BEFORE_FIX = {
    ("after its checks", False): "B refused: it listed v1's marker as a blob its folder lacks "
    "(v1 intact by that chance)",
    ("after its checks", True): "B deleted v1's marker and a blob of A's, rewrote A's 7 others, "
    "added one and wrote its own marker: 'complete'",
    ("after its listing", False): "B overwrote 7 of A's 8 blobs and added one, after v1's marker; "
    "then failed at its own",
    ("after its listing", True): "B overwrote 7 of A's 8 blobs and added one, after v1's marker; "
    "then failed at its own",
}


def test_a_late_upload_of_the_same_files_says_complete_and_writes_nothing(
    container: ContainerClient, tmp_path: Path
) -> None:
    """The same folder uploaded twice at once (a double start): the late one finds the
    version completed with its files, says so, and rewrites none of them."""
    root = DataRoot(container.container_name, "mine")
    files = _folder(tmp_path / "a", A_FILES)
    pause = Pause()
    completed: dict[str, str] = {}

    def say(line: str) -> None:
        if line.startswith("uploading"):
            pause()

    def upload_a() -> None:
        upload_version(container, root, "v1", files, workers=2)
        completed.update(_state(container, "mine/v1"))

    late = _late_upload(
        lambda: upload_version(container, root, "v1", files, workers=2, say=say), pause, upload_a
    )
    assert isinstance(late, Uploaded), late
    assert late.by_another and late.sent == [] and late.marker == "mine/v1/_SUCCESS"
    assert _state(container, "mine/v1") == completed


@pytest.mark.parametrize("meanwhile", ["created", "replaced"])
def test_a_blob_written_by_another_upload_after_the_listing_is_not_overwritten(
    container: ContainerClient, tmp_path: Path, meanwhile: str
) -> None:
    """Every put is conditional: If-None-Match for a blob listed as absent, If-Match its listed
    ETag for one listed as stale. Another upload writing the version (not yet complete) after
    this one listed it keeps its bytes, and this one stops, naming the blob."""
    root = DataRoot(container.container_name, "mine")
    name = "mine/v1/train/c0/00.png"
    if meanwhile == "replaced":  # listed by the late upload as stale: replaced at its ETag
        container.upload_blob(name, b"cut short by an earlier upload")
    files = _folder(tmp_path / "b", A_FILES)
    pause = Pause()

    def say(line: str) -> None:
        if line.startswith("uploading"):
            pause()

    late = _late_upload(
        lambda: upload_version(container, root, "v1", files, workers=1, say=say),
        pause,
        lambda: container.upload_blob(name, b"the other upload's", overwrite=True),
    )
    assert isinstance(late, UploadError), late
    assert "another upload is writing data version v1" in str(late) and name in str(late)
    assert container.download_blob(name).readall() == b"the other upload's"
    assert "mine/v1/_SUCCESS" not in _state(container, "mine/v1")
    report.record(
        "adversarial",
        f"upload: a blob {meanwhile} by another upload after this one listed v1 (incomplete)",
        "refused by its condition (If-None-Match / If-Match); the other's bytes kept; this "
        "upload stops naming the blob; no marker",
        message=str(late)[:160],
        before_fix="overwritten, and the version marked complete with it",
    )


# ---------------------------------------------------------------------------- the command


@pytest.fixture
def command(azurite: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``python -m cli.data``'s arguments up to the subcommand: the local config on a container
    and data root of the test's own."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    suffix = uuid.uuid4().hex[:10]
    yield ["--config", LOCAL, "--set", f"data.container=upl-{suffix}", "--set", "data.prefix=mine"]


def _blobs(azurite: str, args: list[str]) -> list[str]:
    container = ContainerClient.from_connection_string(azurite, args[3].split("=", 1)[1])
    return [b.name for b in container.list_blobs()] if container.exists() else []


def _photos(folder: Path, classes: tuple[str, ...] = ("cat", "dog")) -> Path:
    """A small dataset the gate passes: 6 train and 2 test images of each class, 8 x 8
    pixels, each image's content its own."""
    rng = np.random.default_rng(0)
    for label in classes:
        for split, count in (("train", 6), ("test", 2)):
            (folder / split / label).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (8, 8), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / split / label / f"{i}.png")
    return folder


def test_links_out_of_the_folder_are_refused_by_name(
    azurite: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link named like an image leading to a private key elsewhere, a `val` split and a
    class (in train and test) linked to folders elsewhere: refused, each named, nothing
    uploaded. Before, the key was uploaded, and the split and the class were left out without
    a word: the folder passed as two classes and the version was marked complete."""
    folder = _photos(tmp_path / "mine", ("bird", "cat", "dog"))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keys").mkdir(parents=True)
    (elsewhere / "keys" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    shutil.copytree(folder / "test", elsewhere / "val")
    for split in ("train", "test"):
        shutil.move(folder / split / "bird", elsewhere / f"{split}-bird")
        (folder / split / "bird").symlink_to(elsewhere / f"{split}-bird")
    (folder / "train" / "cat" / "photo.png").symlink_to(elsewhere / "keys" / "id_ed25519")
    (folder / "val").symlink_to(elsewhere / "val")

    assert data([*command, "upload", str(folder), "--version", "v1"]) == 2
    said = capsys.readouterr().err
    for named in ("train/cat/photo.png ->", "val ->", "train/bird ->", "test/bird ->"):
        assert named in said and "leads out of the folder" in said, said
    assert "Nothing was uploaded" in said and _blobs(azurite, command) == []
    report.record(
        "adversarial",
        "upload: train/cat/photo.png linked to a private key outside the folder; val/ and "
        "class bird (train/bird, test/bird) linked to folders outside it",
        "refused, each link named; nothing uploaded",
        before_fix="'passed: 17 images, 2 classes': the key uploaded as photo.png, val/ and "
        "bird left out without a word, the version marked complete",
    )


def test_links_inside_the_folder_are_followed(
    azurite: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `val` split linked to another folder inside the dataset's folder is uploaded as val/
    (links that loop are refused by name: tests/backends/test_version_upload.py)."""
    folder = _photos(tmp_path / "mine")
    (folder / "val").symlink_to("test")
    assert data([*command, "upload", str(folder), "--version", "v1"]) == 0, capsys.readouterr()
    blobs = _blobs(azurite, command)
    val = sorted(b.removeprefix("mine/v1/val/") for b in blobs if b.startswith("mine/v1/val/"))
    assert val and val == sorted(
        p.relative_to(folder / "test").as_posix() for p in (folder / "test").rglob("*.png")
    )
    report.record(
        "adversarial",
        "upload: val/ linked to test/ inside the folder",
        f"val/ uploaded ({len(val)} images) as the folder it links to holds them",
        before_fix="val/ left out without a word, the version marked complete without it",
    )


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its pixels those of a 1 x 1)."""
    import io

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def test_images_the_gate_refuses_by_size_are_refused_before_upload(
    azurite: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .png over the gate's byte cap and a PNG whose header declares 13,000 x 13,000 pixels:
    the gate refuses both, so the upload does, naming them, before a byte is sent."""
    folder = _photos(tmp_path / "mine")
    big = folder / "train" / "cat" / "huge.png"
    big.write_bytes(_png_declaring(8, 8))
    with open(big, "r+b") as fh:
        fh.truncate(MAX_IMAGE_BYTES + 1)  # sparse: 64 MB of zeros after a valid header
    (folder / "train" / "dog" / "wide.png").write_bytes(_png_declaring(13_000, 13_000))
    assert data([*command, "upload", str(folder), "--version", "v1"]) == 2
    said = capsys.readouterr().err
    assert "would fail the data gate; nothing was uploaded" in said
    assert "train/cat/huge.png" in said and "train/dog/wide.png" in said, said
    assert _blobs(azurite, command) == []
    report.record(
        "adversarial",
        f"upload: a .png of {MAX_IMAGE_BYTES + 1:,} bytes and a PNG declaring 13,000 x 13,000 px",
        "refused before upload, both named (the gate's byte cap; the width rule from the header)",
        before_fix="passed the upload's check; the version marked complete, then refused by "
        "every run's gate",
    )


def test_a_new_version_copies_unchanged_files_in_storage(
    azurite: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """v2 = v1 with one image changed and one added: the rest is copied by the service from
    v1 (same MD5 and size), said so, and each copy keeps its Content-MD5."""
    folder = _photos(tmp_path / "mine")
    container = ContainerClient.from_connection_string(azurite, command[3].split("=", 1)[1])
    container.create_container()
    upload_version(container, DataRoot(container.container_name, "mine"), "v1", local_files(folder))
    files = sorted(p for p in folder.rglob("*.png"))
    Image.new("L", (8, 8), 77).save(files[0])  # changed: other bytes under the same name
    Image.new("L", (8, 8), 99).save(folder / "train" / "dog" / "new.png")
    capsys.readouterr()
    assert data([*command, "upload", str(folder), "--version", "v2"]) == 0
    said = capsys.readouterr().out
    copied = len(files) - 1
    assert "2 files sent" in said and f"{copied} copied in storage from version v1" in said, said
    v2 = {b.name: b for b in container.list_blobs(name_starts_with="mine/v2/", include=["copy"])}
    by_copy = [b for b in v2.values() if b.copy and b.copy.status == "success"]
    assert len(by_copy) == copied and all(b.content_settings.content_md5 for b in by_copy)
    report.record(
        "adversarial",
        f"upload: v2 = v1 ({len(files)} images) with one changed and one added",
        f"2 sent, {copied} copied in storage from v1 (Copy Blob), MD5s kept",
        before_fix=f"all {len(files) + 1} sent again",
    )


def _readme_block() -> list[str]:
    """The README's "Use your own data" commands, line by line."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Use your own data", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the README's 'Use your own data'"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow  # a fresh interpreter importing the gate's libraries: `make reliability`
def test_the_readmes_own_data_commands_work_in_a_fresh_shell(azurite: str, tmp_path: Path) -> None:
    """The commands as the README writes them, in a new login shell that never activated the
    project's environment: they reach the project's Python, and the upload completes. What is
    not run as written: ``make azurite`` (this session's Azurite serves on a free port; its
    connection string stands in for UseDevelopmentStorage=true) and the run and download
    (the whole-flow test runs those through the same interpreter)."""
    lines = _readme_block()
    upload = next(line for line in lines if line.startswith("python -m cli.data"))
    script = []
    for line in lines[: lines.index(upload) + 1]:
        if line.startswith("make azurite"):
            continue
        if "UseDevelopmentStorage=true" in line:
            line = line.replace("UseDevelopmentStorage=true", f"'{azurite}'")
        script.append(line)
    work = tmp_path / "checkout"  # the checkout as the user has it, with their photos in it
    work.mkdir()
    for part in ROOT.iterdir():
        if part.name not in (".git", ".work", ".demo", "photos", "models"):
            (work / part.name).symlink_to(part)
    _photos(work / "photos")
    container = ContainerClient.from_connection_string(azurite, "training-data")
    if container.exists():  # the local config's container: this test's data root in it is fresh
        for blob in container.list_blobs(name_starts_with="photos/"):
            container.delete_blob(blob.name)
    fresh = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    ran = subprocess.run(
        ["bash", "-l", "-e", "-c", "\n".join(script)],
        cwd=work,
        env=fresh,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, [*script, ran.stdout, ran.stderr]
    assert "data version v1 of training-data/photos is complete" in ran.stdout, ran.stdout
    report.record(
        "adversarial",
        "README 'Use your own data': its commands in a fresh login shell",
        "the upload completes as written",
        before_fix="No module named 'PIL' (the shell's python, not the project's)",
    )
