"""A folder as the upload reads it (backends/version_upload.py ``local_files``): links followed
inside the folder, refused by name when they leave it, lead nowhere or loop; nothing left out
without a word."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from backends.version_upload import UploadError, local_files


def _tree(root: Path) -> Path:
    for rel in ("train/cat/1.png", "train/dog/1.png", "test/cat/1.png", "test/dog/1.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    return root


def test_links_inside_the_folder_are_followed_under_their_own_names(tmp_path: Path) -> None:
    folder = _tree(tmp_path / "mine")
    (folder / "val").symlink_to("test")  # a split linked to another folder of it
    (folder / "train" / "cat" / "2.png").symlink_to("1.png")
    files = {f.rel: f for f in local_files(folder)}
    assert set(files) == {
        "train/cat/1.png",
        "train/cat/2.png",
        "train/dog/1.png",
        "test/cat/1.png",
        "test/dog/1.png",
        "val/cat/1.png",
        "val/dog/1.png",
    }
    assert files["val/cat/1.png"].path == (folder / "test" / "cat" / "1.png").resolve()
    assert files["val/cat/1.png"].md5 == files["test/cat/1.png"].md5


def test_what_cannot_be_uploaded_is_refused_by_name(tmp_path: Path) -> None:
    """Links that leave the folder (to a file, to a folder), that lead nowhere, or to a folder
    above them, and a pipe: each named in one error, before any file is read."""
    folder = _tree(tmp_path / "mine")
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (tmp_path / "elsewhere" / "bird").mkdir(parents=True)
    (folder / "train" / "cat" / "key.png").symlink_to(secret)
    (folder / "train" / "bird").symlink_to(tmp_path / "elsewhere" / "bird")
    (folder / "train" / "dog" / "gone.png").symlink_to("missing.png")
    (folder / "test" / "cat" / "up").symlink_to("../..")
    os.mkfifo(folder / "test" / "dog" / "pipe.png")
    with pytest.raises(UploadError) as refused:
        local_files(folder)
    said = str(refused.value)
    for named in (
        f"train/cat/key.png -> {secret} (leads out of the folder)",
        f"train/bird -> {tmp_path / 'elsewhere' / 'bird'} (leads out of the folder)",
        "train/dog/gone.png -> missing.png (leads to nothing)",
        "test/cat/up -> ../.. (a loop",
        "test/dog/pipe.png (not a file or a folder",
    ):
        assert named in said, (named, said)
    assert "Nothing was uploaded" in said


class _Marker:
    """The version's marker as Blob storage answers a look at it: absent until ``written``."""

    def __init__(self) -> None:
        self.written, self.looks = False, 0

    def get_blob_client(self, name: str) -> _Marker:
        return self

    def get_blob_properties(self) -> Any:
        from azure.core.exceptions import ResourceNotFoundError

        self.looks += 1
        if not self.written:
            raise ResourceNotFoundError("BlobNotFound")
        return SimpleNamespace(
            name="v1/_SUCCESS",
            etag='"0x1"',
            size=0,
            content_settings=SimpleNamespace(content_md5=None),
        )


def test_the_marker_is_looked_for_again_after_a_second_or_a_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writes within a second of a look share it; a wall-clock jump (the machine slept: the
    monotonic clock stood still) makes the next write look again, and once the marker is
    there no write passes."""
    from backends import version_upload
    from backends.version_upload import _CompletedMeanwhile, _Fence

    marker = _Marker()
    fence = _Fence(cast(Any, marker), "v1/_SUCCESS")
    wall = [1_000.0]
    monkeypatch.setattr(version_upload.time, "time", lambda: wall[0])
    fence.check()
    fence.check()
    assert marker.looks == 1
    wall[0] += 3_600  # an hour asleep
    marker.written = True  # another upload completed the version meanwhile
    with pytest.raises(_CompletedMeanwhile):
        fence.check()
    with pytest.raises(_CompletedMeanwhile):
        fence.check()
    assert marker.looks == 2
