"""The data gate on a dataset uploaded as WebDataset tar shards: a row per sample (its class
from its .cls member), each shard read once per content, and a shard that cannot be read as
samples one unreadable row under the shard's own name, which fails the gate."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from backends.blob import container_client
from gate.manifest import build_manifest
from imagedata.webdataset import pack_folders
from tests.pipeline_helpers import make_config, seed


def test_a_row_per_sample_and_each_shard_read_once(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    written = pack_folders(small_folders, tmp_path / "packed", max_bytes=20_000)
    shards = seed(config, tmp_path / "packed")
    assert shards == sum(written.values())
    loose = Counter(
        (p.parent.parent.name, p.parent.name) for p in small_folders.rglob("*") if p.is_file()
    )
    cache = config.work_dir / "gate-cache"

    rows, reused = build_manifest(config.data, cache)
    assert reused == 0
    assert Counter((r["split"], r["label"]) for r in rows) == loose
    assert all(r["readable"] and r["md5"] and not r["leak"] for r in rows)
    assert {r["path"].split(".tar/")[0] + ".tar" for r in rows} == {
        p.relative_to(tmp_path / "packed").as_posix() for p in (tmp_path / "packed").rglob("*.tar")
    }
    again, reused = build_manifest(config.data, cache)
    assert (again, reused) == (rows, shards)

    # A shard replaced by one with a sample without its class: read again, and unreadable.
    container = container_client(config.data)
    victim = sorted(r["path"].split(".tar/")[0] + ".tar" for r in rows)[0]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("x.png")
        png = next(small_folders.rglob("*.png")).read_bytes()
        info.size = len(png)
        tar.addfile(info, io.BytesIO(png))
    container.upload_blob(f"{config.data.prefix}/{victim}", buffer.getvalue(), overwrite=True)
    changed, reused = build_manifest(config.data, cache)
    assert reused == shards - 1
    (row,) = [r for r in changed if r["path"].startswith(victim)]
    assert (row["path"], row["readable"], row["label"]) == (victim, False, None)


def test_what_the_trainer_would_refuse_or_miss_fails_the_gate_saying_why(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate that passes is a promise the trainer keeps: a shard outside a split's folder
    (the trainer never reads it), class folders beside shards (the trainer refuses the split)
    and a shard that is not samples each fail it, and the report says why, naming each."""
    from core.config import ValidationConfig
    from gate.report import failure
    from gate.suites import run_expectations

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    pack_folders(small_folders, tmp_path / "packed", max_bytes=20_000)
    seed(config, tmp_path / "packed")
    container = container_client(config.data)
    good = next((tmp_path / "packed" / "train").glob("*.tar")).read_bytes()
    png = next(small_folders.rglob("*.png")).read_bytes()
    prefix = config.data.prefix
    container.upload_blob(f"{prefix}/extra.tar", good)  # beside the splits
    container.upload_blob(f"{prefix}/test/digit_0/more.tar", good)  # in a class folder
    container.upload_blob(f"{prefix}/val/digit_0/x.png", png)  # val: loose only, fine
    container.upload_blob(f"{prefix}/train/digit_0/x.png", png)  # beside train's shards
    container.upload_blob(f"{prefix}/test/999999.tar", good[: len(good) // 2])  # cut short
    container.upload_blob(f"{prefix}/other/000000.tar", good)  # a folder no reader knows
    container.upload_blob(f"{prefix}/train/a/b/y.png", png)  # deep, beside train's shards

    rows, _ = build_manifest(config.data, config.work_dir / "gate-cache")
    problems = {r["path"]: r["problem"] for r in rows if r["problem"]}
    assert problems == {
        "extra.tar": "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)",
        "test/digit_0/more.tar": (
            "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)"
        ),
        "other/000000.tar": (
            "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)"
        ),
        "train/digit_0/x.png": "split train holds tar shards: no class folders beside them",
        "train/a/b/y.png": "split train holds tar shards: no class folders beside them",
        "test/999999.tar": problems.get("test/999999.tar", "missing"),
    }
    # Kept by content: the sentence names no blob (the row's path does), so the same bytes
    # under another version's folder are not reported under this one's name.
    assert problems["test/999999.tar"].startswith(("cut short", "damaged tar"))
    success, records = run_expectations(
        rows, ValidationConfig(min_images_per_class=1), tmp_path / "docs"
    )
    assert not success
    message = str(failure(rows, records))
    assert "expect_column_values_to_be_null(problem): 6 unexpected" in message
    assert "train/a/b/y.png: split train holds tar shards" in message


def test_a_member_header_with_a_false_size_fails_the_gate_naming_it(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10 KB shard whose pax header says size=-1536 held the gate forever, its memory
    growing, with the pool's locks. The gate now fails, naming each shard and member. The
    gate runs as a process with a timeout: one that loops fails the test, not hangs it."""
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env
    from tests.hostile_tars import CASES, MEMBER, hostile_shard
    from tests.reliability import report

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    pack_folders(small_folders, tmp_path / "packed", max_bytes=20_000)
    seed(config, tmp_path / "packed")
    container = container_client(config.data)
    png = next(small_folders.rglob("*.png")).read_bytes()
    label = next((small_folders / "train").iterdir()).name.encode()
    for n, (_, lie, _) in enumerate(CASES):
        shard = hostile_shard(png, lie, label)
        container.upload_blob(f"{config.data.prefix}/train/99999{n}.tar", shard)
    script = (
        "import sys, tempfile; from pathlib import Path; from core.config import DataLocation, "
        "ValidationConfig; from gate.manifest import build_manifest; from gate.report import "
        "failure; from gate.suites import run_expectations; "
        "rows, _ = build_manifest(DataLocation.model_validate_json(sys.argv[1]), "
        "Path(sys.argv[2])); ok, records = run_expectations(rows, ValidationConfig(), "
        "Path(tempfile.mkdtemp())); print(ok); "
        "print('\\n'.join(r['path'] + ': ' + r['problem'] for r in rows if r['problem']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, config.data.model_dump_json(), str(tmp_path / "cache")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    verdict, *problems = proc.stdout.splitlines()
    assert verdict == "False"
    for n, (case, _, words) in enumerate(CASES):
        (line,) = [p for p in problems if p.startswith(f"train/99999{n}.tar: ")]
        assert f"member '{MEMBER}'" in line and words in line, (case, line)
        report.record(
            "adversarial",
            f"gate: a shard whose member header lies about its size ({case})",
            "gate fails, naming the shard and the member",
            before_fix="gate re-read a header forever, memory growing, locks held"
            if "negative" in case
            else "named (OSError text)",
            message=line,
        )


def test_class_names_that_read_alike_fail_the_gate_naming_them(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders `cat`, `cat ` and `\\xa0cat` were three classes loose and one in shards (the
    readers stripped a .cls text); `café` in two Unicode forms and `dog` plus a zero-width
    space became classes with identical names. The gate, before any node is paid for, names
    each, and takes a name in either form as its composed one."""
    from tests.reliability import report

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    container = container_client(config.data, create=True)
    png = next(small_folders.rglob("*.png")).read_bytes()
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    classes = {"train": ["cat", "cat ", "\xa0cat", nfc, nfd, "dog\u200b"], "test": ["cat", nfd]}
    for split, names in classes.items():
        for name in names:
            container.upload_blob(f"{config.data.prefix}/{split}/{name}/a.png", png)
    buffer = io.BytesIO()  # a val split of shards whose .cls says `cat ` (not stripped)
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("x.png", png), ("x.cls", b"cat \n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    container.upload_blob(f"{config.data.prefix}/val/000000.tar", buffer.getvalue())

    rows, _ = build_manifest(config.data, tmp_path / "cache")
    problems = {r["path"]: r["problem"] for r in rows}
    assert "white space at an end" in problems["train/cat /a.png"]
    assert "class name 'cat '" in problems["train/cat /a.png"]
    assert "class name '\\xa0cat'" in problems["train/\xa0cat/a.png"]
    assert "U+200B" in problems["train/dog\u200b/a.png"]
    assert "one name in two Unicode forms" in problems[f"train/{nfd}/a.png"]
    assert "'caf\\xe9' and 'cafe\\u0301'" in problems[f"train/{nfc}/a.png"]
    assert problems["train/cat/a.png"] is None
    # One form of a name in its split: the class the trainer takes, in its composed form.
    assert problems[f"test/{nfd}/a.png"] is None
    assert {r["label"] for r in rows if r["split"] == "test"} == {"cat", nfc}
    assert "holds 'cat ', not a class name" in problems["val/000000.tar"]
    report.record(
        "adversarial",
        "gate: class folders cat, 'cat ', '\\xa0cat', café (NFC and NFD), dog+U+200B; "
        "a .cls holding 'cat '",
        "gate fails naming each lookalike; one form alone is taken in NFC",
        before_fix="cat, 'cat ', '\\xa0cat' one class in shards, three loose; lookalike "
        "classes with identical display names",
    )
