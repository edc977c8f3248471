"""The data gate's checks on a folder before it is uploaded (gate/folder.py): the gate's own rows
and suites, so a folder the gate would refuse for its layout, splits, classes, file kinds, empty
files or duplicates fails here, naming its files, and one it would pass, passes."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from backends.version_upload import local_files
from core.config import ValidationConfig
from gate.folder import check_folder
from imagedata.make_images import write_digits
from imagedata.webdataset import pack_folders

RULES = ValidationConfig(min_images_per_class=5, min_side=8, max_side=4096)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits(root, test_fraction=0.25, seed=0, per_class=24)
    return root


def test_a_folder_the_gate_would_pass_passes(digits: Path) -> None:
    files = local_files(digits)
    check = check_folder(files, RULES)
    assert check.success, check.problems()
    assert len(check.rows) == len(files) == 240
    assert {r["label"] for r in check.rows} == {f"digit_{d}" for d in range(10)}


def test_each_problem_of_a_broken_folder_is_named_by_its_file(digits: Path, tmp_path: Path) -> None:
    """What a person's own folder holds that the gate refuses: each is named, in one check."""
    folder = tmp_path / "mine"
    shutil.copytree(digits, folder)
    (folder / "notes.txt").write_text("where the photos came from")  # not an image
    (folder / "train" / "digit_1" / ".DS_Store").write_bytes(b"\0")  # a file manager's
    (folder / "training" / "digit_1").mkdir(parents=True)  # not a split
    shutil.copy(next((folder / "train" / "digit_1").glob("*.png")), folder / "training" / "digit_1")
    shutil.rmtree(folder / "test" / "digit_3")  # a class with no test images
    (folder / "test" / "digit_2" / "empty.png").write_bytes(b"")  # an empty file
    leaked = sorted((folder / "train" / "digit_4").glob("*.png"))[0]
    shutil.copy(leaked, folder / "test" / "digit_4" / "copy.png")  # the same image in both
    (folder / "val" / "cat").mkdir(parents=True)  # a class train does not have
    shutil.copy(leaked, folder / "val" / "cat" / "cat.png")
    check = check_folder(local_files(folder), RULES)
    assert not check.success
    said = "\n".join(check.problems())
    for named in (
        "notes.txt",
        "train/digit_1/.DS_Store",
        "training/digit_1/",
        "digit_3 (0 test images)",
        "test/digit_2/empty.png",
        "test/digit_4/copy.png",
        "val/cat/cat.png",
    ):
        assert named in said, (named, said)


def test_tar_shards_are_checked_by_their_samples(digits: Path, tmp_path: Path) -> None:
    """WebDataset shards: their samples are the rows (as the gate reads them); a shard that is
    not a tar, a sample without its class and class folders beside shards are named."""
    shards = tmp_path / "shards"
    pack_folders(digits, shards, max_bytes=20_000)
    check = check_folder(local_files(shards), RULES)
    assert check.success, check.problems()
    assert len(check.rows) == 240 and {r["split"] for r in check.rows} == {"train", "test"}

    (shards / "train" / "000999.tar").write_bytes(b"not a tar at all" * 64)
    with tarfile.open(shards / "test" / "000998.tar", "w") as tar:
        png = next((digits / "test" / "digit_0").glob("*.png")).read_bytes()
        member = tarfile.TarInfo("lonely.png")
        member.size = len(png)
        tar.addfile(member, io.BytesIO(png))
    (shards / "train" / "digit_0").mkdir()
    shutil.copy(next((digits / "train" / "digit_0").glob("*.png")), shards / "train" / "digit_0")
    said = "\n".join(check_folder(local_files(shards), RULES).problems())
    for named in ("train/000999.tar: ", "test/000998.tar: ", "train/digit_0/"):
        assert named in said, (named, said)


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its pixel data a 1 x 1's)."""
    import struct
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


def test_the_gates_size_limits_are_checked_from_the_header(digits: Path, tmp_path: Path) -> None:
    """What the gate refuses without decoding a pixel is refused here too, named: a file over
    its byte cap (by its size), a header over its pixel cap, a header over max_side, a file
    that is no PNG or JPEG by content. The folder's own images get their header's sides."""
    from imagedata.images import MAX_IMAGE_BYTES

    folder = tmp_path / "mine"
    shutil.copytree(digits, folder)
    big = folder / "train" / "digit_0" / "big.png"
    big.write_bytes(_png_declaring(8, 8))
    with open(big, "r+b") as fh:
        fh.truncate(MAX_IMAGE_BYTES + 1)
    (folder / "train" / "digit_1" / "bomb.png").write_bytes(_png_declaring(13_000, 13_000))
    (folder / "train" / "digit_2" / "strip.png").write_bytes(_png_declaring(5_000, 8))
    (folder / "train" / "digit_3" / "page.jpg").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n" * 8)
    check = check_folder(local_files(folder), RULES)
    assert not check.success
    said = "\n".join(check.problems())
    for named in ("digit_0/big.png", "digit_1/bomb.png", "digit_2/strip.png", "digit_3/page.jpg"):
        assert named in said, (named, said)
    fine = next(r for r in check.rows if r["path"].startswith("test/digit_5/"))
    assert (fine["width"], fine["height"], fine["channels"], fine["readable"]) == (8, 8, 1, None)
