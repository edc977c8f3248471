"""Data uploaded as WebDataset tar shards: read by the loose reader and packed by the shard
packer without unpacking, to the same samples as the image folders they were made from; and
a shard that would train on wrong labels refused, naming the shard and the sample."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from imagedata.data import open_dataset
from imagedata.dataset import DatasetError, DatasetInfo
from imagedata.make_images import write_digits
from imagedata.shards import pack_shards
from imagedata.webdataset import main, pack_folders
from tests.conftest import ROOT, child_env, run_trainer
from tests.hostile_tars import CASES, MEMBER, hostile_shard

SIZE = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("folders")
    write_digits(root, test_fraction=0.3, seed=0, per_class=16)
    return root


@pytest.fixture
def shards(folders: Path, tmp_path: Path) -> Path:
    """The folders as shards of about 10 KB: several per split."""
    root = tmp_path / "packed"
    written = pack_folders(folders, root, max_bytes=10_000)
    assert written["train"] > 1 and written["test"] >= 1
    return root


def _content(info: DatasetInfo) -> dict[str, Counter[tuple[str, str]]]:
    """Per split, each sample as (its pixels' digest, its class name), counted."""
    return {
        name: Counter(
            (hashlib.sha256(image.numpy().tobytes()).hexdigest(), info.class_names[label])
            for image, label in (split.dataset[i] for i in range(len(split.dataset)))
        )
        for name, split in info.splits.items()
    }


def test_shards_read_as_the_folders_they_were_made_from(folders: Path, shards: Path) -> None:
    loose = open_dataset(str(folders), SIZE, use_shards=False)
    packed = open_dataset(str(shards), SIZE, use_shards=False)
    assert packed.class_names == loose.class_names
    assert _content(packed) == _content(loose)
    before = sorted(p.relative_to(shards) for p in shards.rglob("*"))

    report = pack_shards(shards, SIZE)
    assert report.action == "packed" and report.images == sum(
        len(s.dataset) for s in loose.splits.values()
    )
    fed = open_dataset(str(shards), SIZE)
    assert fed.kind == "image-folders (packed shards)"
    assert _content(fed) == _content(loose)
    # Nothing was unpacked: the only new files are the packer's, under .shards/.
    after = sorted(p.relative_to(shards) for p in shards.rglob("*"))
    assert [p for p in after if p not in before and p.parts[0] != ".shards"] == []


def test_a_changed_shard_repacks_only_its_own_images(shards: Path) -> None:
    first = pack_shards(shards, SIZE)
    assert first.decoded == first.images
    changed = sorted((shards / "train").glob("*.tar"))[0]
    with tarfile.open(changed) as tar:
        in_it = sum(1 for m in tar.getmembers() if m.name.endswith(".png"))
    changed.write_bytes(changed.read_bytes())  # same bytes, new mtime: its key changes
    again = pack_shards(shards, SIZE)
    assert again.action == "packed"
    assert (again.decoded, again.reused) == (in_it, first.images - in_it)


def test_a_damaged_image_inside_a_shard_is_left_out_and_named(shards: Path) -> None:
    shard = sorted((shards / "train").glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    first_png = next(m.name for m, _ in members if m.name.endswith(".png"))
    _write(shard, [(m.name, data[:40] if m.name == first_png else data) for m, data in members])

    info = open_dataset(str(shards), SIZE, use_shards=False)
    assert [s.split(": ")[0] for s in info.splits["train"].skipped] == [f"{shard}/{first_png}"]
    report = pack_shards(shards, SIZE)
    assert report.skipped == 1


def _write(path: Path, members: list[tuple[str, bytes | str]]) -> None:
    """A tar of ``members``; ``"link"`` as the data makes a hard link to the first member.
    GNU format with surrogate escapes: a name may hold bytes that are not UTF-8."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data == "link":
                info.type, info.linkname = tarfile.LNKTYPE, members[0][0]
                tar.addfile(info)
                continue
            assert isinstance(data, bytes)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _png(folders: Path) -> bytes:
    return next((folders / "train").rglob("*.png")).read_bytes()


@pytest.mark.parametrize(
    ("members", "named"),
    [
        ([("a.png", "png")], "sample 'a' (a.png) has no .cls member"),
        ([("a.cls", b"3")], "sample 'a' has a .cls member and no .png/.jpg image"),
        ([("a.png", "png"), ("a.jpg", "png"), ("a.cls", b"3")], "sample 'a' has two images"),
        ([("a.png", "png"), ("a.cls", b"../3")], "holds '../3', not a class name"),
        ([("a.png", "png"), ("a.cls", b"")], "holds '', not a class name"),
        ([("a.png", "png"), ("a.cls", b"\xff\xfe")], "is not UTF-8 text"),
        ([("a.png", "png"), ("a.cls", b"x" * 300)], "300 bytes, not a class"),
        ([("a.png", "png"), ("a.cls", b"3"), ("a.cls", b"4")], "sample 'a' has two classes"),
        ([("a.png", "png"), ("a.cls", b"a\rb")], "holds 'a\\rb', not a class name"),
        (
            [("img.v0.png", "png"), ("img.v0.cls", b"3")],
            "member 'img.v0.png' is field 'v0.png' of sample 'img'",
        ),
        ([("a.png", "link"), ("a.cls", b"3")], "member 'a.png' is a link"),
        ([("caf\udce9.png", "png"), ("caf\udce9.cls", b"3")], "a member name is not UTF-8"),
    ],
)
def test_a_shard_that_would_mislabel_is_refused_naming_the_sample(
    folders: Path, shards: Path, members: list[tuple[str, bytes | str]], named: str
) -> None:
    bad = shards / "train" / "999999.tar"
    if any(d == "link" for _, d in members):
        members = [("b.png", "png"), *members]
    _write(bad, [(n, _png(folders) if d == "png" else d) for n, d in members])
    with pytest.raises(DatasetError) as err:
        open_dataset(str(shards), SIZE, use_shards=False)
    assert str(bad) in str(err.value) and named in str(err.value)
    assert pack_shards(shards, SIZE).action == "not packed"


def test_a_compressed_or_cut_shard_is_refused_naming_it(shards: Path) -> None:
    shard = sorted((shards / "test").glob("*.tar"))[0]
    data = shard.read_bytes()
    shard.write_bytes(gzip.compress(data))
    with pytest.raises(DatasetError, match=f"{shard}: not an uncompressed tar"):
        open_dataset(str(shards), SIZE, use_shards=False)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        last = tar.getmembers()[-1]
    at_a_boundary = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    for cut, why in ((len(data) // 2 + 100, "cut short|damaged tar"), (at_a_boundary, "cut short")):
        shard.write_bytes(data[:cut])  # inside a member; then after its last member's data
        with pytest.raises(DatasetError, match=f"{shard}: ({why})"):
            open_dataset(str(shards), SIZE, use_shards=False)


def test_a_split_of_shards_and_class_folders_is_refused(folders: Path, shards: Path) -> None:
    shutil.copytree(folders / "train" / "digit_3", shards / "train" / "digit_3")
    with pytest.raises(DatasetError, match="both tar shards and class folders"):
        open_dataset(str(shards), SIZE, use_shards=False)


def test_the_producers_command_refuses_to_write_into_a_full_folder(
    folders: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    assert main([str(folders), str(dest)]) == 0
    assert "train: 1 shard(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(folders), str(dest)])
    assert "exists and is not an empty folder" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit):
        main([str(folders), str(tmp_path / "a-file")])
    assert "exists and is not an empty folder" in capsys.readouterr().err
    (tmp_path / "empty-class" / "train" / "cat").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty-class"), str(tmp_path / "out2")])
    assert "empty class folder" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()  # refused before anything was written


def test_two_tars_written_one_after_the_other_are_refused(shards: Path) -> None:
    first, second = sorted((shards / "train").glob("*.tar"))[:2]
    first.write_bytes(first.read_bytes() + second.read_bytes())
    second.unlink()
    with pytest.raises(DatasetError, match=f"{first}: data after its end-of-archive blocks"):
        open_dataset(str(shards), SIZE, use_shards=False)


def test_a_byte_order_mark_is_not_part_of_the_class(folders: Path, shards: Path) -> None:
    shard = sorted((shards / "train").glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    _write(shard, [(n, b"\xef\xbb\xbf" + d if n.endswith(".cls") else d) for n, d in members])
    before = open_dataset(str(folders), SIZE, use_shards=False).class_names
    assert open_dataset(str(shards), SIZE, use_shards=False).class_names == before


def test_shards_alike_in_size_and_time_keep_their_own_pixels_on_a_repack(
    folders: Path, shards: Path
) -> None:
    """Shards of a folder not staged are keyed by path, size and time: tars pad to 10 KiB, so
    equal sizes are common, and unpacked archives share times. A repack reuses each image's
    own row, never another shard's."""
    tars = sorted(shards.rglob("*.tar"))
    for tar in tars:
        os.utime(tar, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert len({t.stat().st_size for t in tars}) < len(tars)  # some alike
    pack_shards(shards, SIZE)
    shutil.copy(tars[0], shards / "train" / "999999.tar")  # a new shard: the folder repacks
    again = pack_shards(shards, SIZE)
    assert again.action == "packed" and again.reused > 0
    loose = _content(open_dataset(str(shards), SIZE, use_shards=False))
    assert _content(open_dataset(str(shards), SIZE)) == loose


def test_the_trainer_starts_from_packed_shards_without_opening_a_tar(shards: Path) -> None:
    """The data version is the shards' files' (their staged MD5s, or path, size and time):
    listing every member header instead is a read per image, on NFS, at every rank's start."""
    pack_shards(shards, SIZE)
    opened: list[str] = []
    watching = [True]

    def watch(event: str, args: tuple[object, ...]) -> None:
        if watching[0] and event == "open" and str(args[0]).endswith(".tar"):
            opened.append(str(args[0]))

    sys.addaudithook(watch)  # audit hooks stay for the process: `watching` turns it off
    try:
        info = open_dataset(str(shards), SIZE)
    finally:
        watching[0] = False
    assert info.kind == "image-folders (packed shards)" and opened == []


def test_class_folders_added_beside_packed_shards_are_refused_not_ignored(
    folders: Path, shards: Path
) -> None:
    pack_shards(shards, SIZE)
    shutil.copytree(folders / "train" / "digit_3", shards / "train" / "digit_3")
    with pytest.raises(DatasetError, match="both tar shards and class folders"):
        open_dataset(str(shards), SIZE)


def test_a_shard_replaced_with_its_size_and_time_kept_is_read_again(shards: Path) -> None:
    """Relabelled in place (each class the next digit), the modification time set back:
    the packed rows are not used; the shard's change time and inode say it is not the one
    packed."""
    pack_shards(shards, SIZE)
    shard = sorted((shards / "train").glob("*.tar"))[0]
    before = shard.stat()
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    relabelled = [  # each class the next digit: same lengths, so the same tar size
        (n, d[:-1] + str((int(d[-1:]) + 1) % 10).encode() if n.endswith(".cls") else d)
        for n, d in members
    ]
    assert relabelled != members
    _write(shard, relabelled)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size
    info = open_dataset(str(shards), SIZE)
    assert info.kind == "image-folders" and _content(info) == _content(
        open_dataset(str(shards), SIZE, use_shards=False)
    )


def test_the_scorer_reads_what_is_left_when_a_packed_split_is_gone(shards: Path) -> None:
    pack_shards(shards, SIZE)
    shutil.rmtree(shards / "train")
    info = open_dataset(str(shards), SIZE, required_splits=("test",))
    assert info.kind == "image-folders" and list(info.splits) == ["test"]


@pytest.mark.processes
def test_a_sparse_member_is_refused_naming_it(shards: Path, tmp_path: Path) -> None:
    """GNU tar's --sparse stores a file's holes as a map: the bytes at the member's offset are
    not the file. The gate's reader rebuilds them, the trainer's reads at the offset: refused
    by both, rather than passed by one and garbage to the other."""
    import subprocess

    work = tmp_path / "sparse"
    work.mkdir()
    (work / "x.png").write_bytes(b"")
    os.truncate(work / "x.png", 100_000)  # a hole, the whole file
    (work / "x.cls").write_text("digit_0")
    shard = shards / "train" / "999999.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(shard), "x.png", "x.cls"], cwd=work, check=True)
    with pytest.raises(DatasetError, match=r"member 'x\.png' is not stored as a plain file"):
        open_dataset(str(shards), SIZE, use_shards=False)


@pytest.fixture(scope="module")
def trained(folders: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of the folders' classes, for the scorer."""
    out = tmp_path_factory.mktemp("trained")
    result = run_trainer(1, folders, out, "--epochs", "1", "--batch-size", "16", timeout=300)
    assert result.returncode == 0, result.output
    return out / "model.pt"


@pytest.mark.processes
@pytest.mark.parametrize(("lie", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_member_header_with_a_false_size_ends_every_reader_naming_it(
    folders: Path, shards: Path, trained: Path, tmp_path: Path, lie: str, words: str
) -> None:
    """A size below zero sent tarfile back to a header it had read, forever (the trainer, the
    scorer and the packer hung with their memory growing); a size past the shard's end ended
    the trainer and the scorer in an OSError traceback. Each now ends as bad data does: exit
    2, or "not packed", naming the shard and the member. Run as processes with a timeout, so a
    reader that loops fails the test instead of hanging it."""
    from tests.reliability import report

    bad = shards / "test" / "999999.tar"
    bad.write_bytes(hostile_shard(_png(folders), lie))
    named = (str(bad), f"member '{MEMBER}'", words)
    trainer = run_trainer(1, shards, tmp_path / "out", "--epochs", "1", timeout=120)
    assert trainer.returncode == 2 and all(w in trainer.output for w in named), trainer.output
    assert "Traceback" not in trainer.output
    scorer = subprocess.run(
        [
            *(sys.executable, "-m", "training.score", "--model", str(trained)),
            *("--data-dir", str(shards), "--output", str(tmp_path / "s.json")),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scorer.returncode == 2 and all(w in scorer.stderr for w in named), scorer.stderr
    assert "Traceback" not in scorer.stderr
    packer = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from imagedata.shards "
            "import pack_shards; r = pack_shards(Path(sys.argv[1]), 16); print(r.action, r.reason)",
            str(shards),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert packer.stdout.startswith("not packed") and all(w in packer.stdout for w in named)
    report.record(
        "adversarial",
        f"a shard whose member header lies about its size ({lie})",
        "trainer and scorer exit 2, the packer does not pack; each names the shard and member",
        before_fix="re-read a header forever, memory growing"
        if "-" in lie
        else "OSError traceback (Invalid argument) from a seek",
        message=scorer.stderr.strip().replace(str(shards), "<data>"),
    )


@pytest.mark.processes
def test_a_shard_header_that_would_loop_fails_the_local_folder_check_too(
    folders: Path, tmp_path: Path
) -> None:
    """The gate's check of a folder before upload (``gate.folder``) reads shards as the
    trainer does: the looping header is one row naming the member, not a hang."""
    root = tmp_path / "upload"
    pack_folders(folders, root, max_bytes=10_000)
    (root / "train" / "999999.tar").write_bytes(hostile_shard(_png(folders), CASES[0][1]))
    script = (
        "import sys; from pathlib import Path; from backends.version_upload import local_files; "
        "from gate.folder import folder_rows; rows = folder_rows(local_files(Path(sys.argv[1]))); "
        "print([r['path'] + ': ' + r['problem'] for r in rows if r['problem']])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"train/999999.tar: member '{MEMBER}'" in proc.stdout and "says -1536" in proc.stdout


def test_loose_and_packed_class_names_agree_and_lookalikes_are_refused(
    folders: Path, tmp_path: Path
) -> None:
    """The packer wrote folder names as they were and the readers stripped a .cls text:
    `cat`, `cat ` and `\\xa0cat` were three classes loose and one packed. Now both readers
    and the packer refuse what reads like another class, naming it, and take a name in
    either Unicode form as its composed one, packed or loose alike."""
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    root = tmp_path / "loose"
    for split in ("train", "test"):
        shutil.copytree(folders / split / "digit_0", root / split / nfd)
        shutil.copytree(folders / split / "digit_1", root / split / "cat")
    packed = tmp_path / "packed"
    pack_folders(root, packed)
    loose_names = open_dataset(str(root), SIZE, use_shards=False).class_names
    assert loose_names == open_dataset(str(packed), SIZE, use_shards=False).class_names
    assert loose_names == [nfc, "cat"]  # sorted as text: "caf\u00e9" < "cat"
    for bad, named in [
        ("cat ", "'cat ' has white space at an end"),
        ("\xa0cat", "'\\xa0cat' has white space at an end"),
        ("cat\u200b", "U+200B"),
        (nfc, "are one name in two Unicode forms"),
    ]:
        extra = root / "train" / bad
        shutil.copytree(folders / "train" / "digit_2", extra)
        with pytest.raises(DatasetError, match=re.escape(named)):
            open_dataset(str(root), SIZE, use_shards=False)
        with pytest.raises(ValueError, match=re.escape(named)):
            pack_folders(root, tmp_path / f"out-{len(bad)}-{ord(bad[-1])}")
        shutil.rmtree(extra)


@pytest.mark.parametrize(
    ("text", "label"), [(b"cat\n", "cat"), (b"cat\r\n", "cat"), (b"cafe\xcc\x81", "caf\u00e9")]
)
def test_a_cls_text_loses_its_line_ending_only_and_is_composed(
    folders: Path, shards: Path, text: bytes, label: str
) -> None:
    shard = shards / "train" / "999999.tar"
    _write(shard, [("a.png", _png(folders)), ("a.cls", text)])
    with pytest.raises(DatasetError, match=re.escape(f"missing from test: ['{label}']")):
        open_dataset(str(shards), SIZE, use_shards=False)
    _write(shard, [("a.png", _png(folders)), ("a.cls", b"\xc2\xa0" + text)])
    with pytest.raises(DatasetError, match=r"not a class name \(the class name has white space"):
        open_dataset(str(shards), SIZE, use_shards=False)
