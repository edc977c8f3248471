"""Hostile and careless input on the data path: staging, the gate's pinned listing, image
formats, CIFAR pickles, checkpoints, model files, config sizes, concurrent shard packs.

Each case gets a clear error naming the problem, or is handled, and nothing stored is lost or
half-written. Every case is recorded for docs/reliability.md ("Adversarial inputs").
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from azure.storage.blob import ContainerClient
from PIL import Image

from core.config import ConfigError, load_config
from imagedata.data import open_dataset
from imagedata.dataset import DatasetError
from imagedata.image_folders import decode_checked
from imagedata.shards import INDEX, SHARD_DIR, open_shards, pack_shards
from imagedata.staged_folder import MANIFEST
from staging.listing import ChangedSinceGateError, PinnedBlob, listing_json, parse_listing, pin
from staging.sync import UnsafeBlobNameError, stage, sync_to_directory
from tests.conftest import ROOT, child_env, run_trainer
from tests.pipeline_helpers import new_container
from tests.reliability import report

LOCAL = ROOT / "configs" / "local.yaml"


def _png(seed: int, side: int = 16) -> bytes:
    import io

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def container(azurite: str) -> ContainerClient:
    return new_container(azurite, "adv")


def _upload(container: ContainerClient, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        container.upload_blob(name, data, overwrite=True)


def _pinned(container: ContainerClient, prefix: str) -> list[PinnedBlob]:
    return [pin(b) for b in container.list_blobs(name_starts_with=f"{prefix}/")]


# ---------------------------------------------------------------------------- staging


def test_new_version_under_new_prefix_keeps_every_file(
    container: ContainerClient, tmp_path: Path
) -> None:
    """v1, then v2 = v1 plus new images under images/v2 (the new-data trigger's layout), into
    the same folder: every v2 file stays, unchanged content is not downloaded again, and a
    class dropped by v3 leaves no empty folder behind."""
    v1 = {f"train/c{i % 2}/{i}.png": _png(i) for i in range(6)}
    v2 = {**v1, **{f"train/c{i % 2}/{i}.png": _png(i) for i in range(6, 18)}}
    _upload(container, {f"images/v1/{k}": v for k, v in v1.items()})
    _upload(container, {f"images/v2/{k}": v for k, v in v2.items()})
    dest = tmp_path / "data"
    sync_to_directory(container, "images/v1", dest)
    second = sync_to_directory(container, "images/v2", dest)

    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*.png")}
    assert on_disk == set(v2)
    assert all((dest / rel).read_bytes() == data for rel, data in v2.items())
    manifest = json.loads((dest / MANIFEST).read_text())
    assert {f["path"] for f in manifest["files"].values()} == set(v2)
    assert second.deleted == [] and len(second.downloaded) == 12 and second.skipped == 6

    v3 = {k: v for k, v in v2.items() if k.startswith("train/c0/")}
    _upload(container, {f"images/v3/{k}": v for k, v in v3.items()})
    third = sync_to_directory(container, "images/v3", dest)
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*.png")} == set(v3)
    assert not (dest / "train" / "c1").exists()  # an empty class folder would stop the trainer
    assert len(third.deleted) == len(v2) - len(v3)
    report.record(
        "adversarial",
        "staging: v1 then v2 (v1 + 12 images) under a new prefix, same folder",
        f"all {len(v2)} v2 files kept; 12 downloaded, 6 unchanged",
        before_fix="12 of the 18 v2 files deleted right after staging",
    )


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["ds/train/c/a.png", "ds/train/c/a.png/b.png"], r"'ds/train/c/a.png/b.png'.*folder"),
        (["ds/train/c/" + "x" * 252 + ".png"], r"blob 'ds/train/c/x{252}\.png'.*255 bytes"),
        (["ds/train/c/" + "é" * 130 + ".png"], r"255 bytes"),  # 264 bytes in UTF-8
    ],
    ids=["file-and-folder", "segment-256-bytes", "segment-264-utf8-bytes"],
)
def test_unusable_blob_names_are_named_before_anything_is_written(
    container: ContainerClient, tmp_path: Path, names: list[str], expected: str
) -> None:
    _upload(container, {"ds/train/c/ok.png": _png(1), **dict.fromkeys(names, _png(2))})
    dest = tmp_path / "data"
    with pytest.raises(UnsafeBlobNameError, match=expected) as err:
        sync_to_directory(container, "ds", dest)
    assert ".part" not in str(err.value)  # the blob is named, not a temp file
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))
    report.record(
        "adversarial", f"staging: blob names {[n[:40] for n in names]}", "refused, names the blob"
    )


def test_a_new_version_may_turn_a_file_into_a_folder(
    container: ContainerClient, tmp_path: Path
) -> None:
    _upload(container, {"p1/train/c/x": b"was a file", "p1/train/c/a.png": _png(1)})
    _upload(container, {"p2/train/c/x/y.png": _png(2), "p2/train/c/a.png": _png(1)})
    dest = tmp_path / "data"
    sync_to_directory(container, "p1", dest)
    sync_to_directory(container, "p2", dest)
    assert (dest / "train/c/x/y.png").read_bytes() == _png(2)
    # A file no sync recorded in the way (what a sync killed before its manifest leaves): the
    # folder holds the listing and nothing else, so it goes.
    (dest / "train/c/keep.txt").write_text("not staged by us")
    _upload(container, {"p3/train/c/keep.txt/z.png": _png(3)})
    third = sync_to_directory(container, "p3", dest)
    assert (dest / "train/c/keep.txt/z.png").read_bytes() == _png(3)
    assert third.removed == ["train/c/keep.txt"]
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*.png")} == {
        "train/c/keep.txt/z.png"
    }


def test_staging_stages_exactly_the_gates_listing(
    container: ContainerClient, tmp_path: Path
) -> None:
    """A blob uploaded after the gate is not staged; one changed or deleted since fails the
    staging and is named; nothing of it is written."""
    _upload(container, {f"ds/train/c/{i}.png": _png(i) for i in range(4)})
    listing = parse_listing(listing_json("ds", _pinned(container, "ds")), "gate", "ds")
    _upload(container, {"ds/train/c/late.png": _png(99)})  # after the gate
    dest = tmp_path / "data"
    staged = stage(container, "ds", dest, 0, listing=listing)
    assert staged["total_files"] == 4 and not (dest / "train/c/late.png").exists()

    fresh = tmp_path / "fresh"
    _upload(container, {"ds/train/c/2.png": _png(1000, side=20)})  # changed after the gate
    with pytest.raises(ChangedSinceGateError, match=r"blob 'ds/train/c/2.png' changed or was"):
        stage(container, "ds", fresh, 0, listing=listing)
    assert not (fresh / "train/c/2.png").exists()
    container.delete_blob("ds/train/c/3.png")
    with pytest.raises(ChangedSinceGateError, match=r"'ds/train/c/3.png' changed or was deleted"):
        stage(container, "ds", tmp_path / "third", 0, listing=[listing[3]])
    with pytest.raises(ValueError, match="for prefix 'ds', not 'other'"):
        parse_listing(listing_json("ds", listing), "gate", "other")
    report.record(
        "adversarial",
        "staging: a blob uploaded after the gate; a blob changed after the gate",
        "late blob not staged; changed blob fails staging, named (If-Match on the gate's ETag)",
    )


# ---------------------------------------------------------------------------- the gate


@pytest.fixture
def gate_config(azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from tests.pipeline_helpers import make_config

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    return make_config(tmp_path, "data.prefix=images/v1", "validation.min_images_per_class=2")


def _gate(config: Any, files: dict[str, bytes], docs: Path) -> tuple[bool, list[str]]:
    """Run the gate's suites on 2 classes x 2 images per split plus ``files``; returns
    whether it passed and, per failed expectation, its column and the files it names."""
    from backends.blob import container_client
    from gate.manifest import build_manifest
    from gate.report import examples
    from gate.suites import run_expectations

    base = {
        f"{split}/c{c}/{split}{c}{i}.png": _png(100 * c + 10 * i + (split == "test"))
        for split in ("train", "test")
        for c in range(2)
        for i in range(2)
    }
    container = container_client(config.data, create=True)
    _upload(container, {f"images/v1/{k}": v for k, v in {**base, **files}.items()})
    rows, _ = build_manifest(config.data, config.work_dir / "gate-cache")
    passed, records = run_expectations(rows, config.validation, docs)
    failed = [f"{r['column']}: {examples(rows, r)}" for r in records if not r["success"]]
    return passed, failed


def _gif() -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("P", (16, 16)).save(buffer, "GIF")
    return buffer.getvalue()


def _jpeg(seed: int, side: int = 64) -> bytes:
    import io

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


GATE_CASES = {
    # A valid header and no pixels: a header read called these readable, and the scorer then
    # skipped 25 of 28 test images.
    "PNG cut after 60 bytes": ({"test/c1/cut.png": _png(9, side=64)[:60]}, "cut.png"),
    "JPEG cut in half": ({"train/c0/half.jpg": _jpeg(9)[: len(_jpeg(9)) // 2]}, "half.jpg"),
    "underscore name, 1x1 image": ({"train/c0/_tiny.png": _png(7, side=1)}, "_tiny.png"),
    "val split missing a class": ({"val/c0/v.png": _png(8)}, "val_images"),
    "EPS document named .png": (
        {"train/c1/cat.png": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n"},
        "cat.png",
    ),
    "GIF named .gif": ({"train/c1/anim.gif": _gif()}, "anim.gif"),
}


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gate_validates_what_is_trained(case: str, gate_config: Any, tmp_path: Path) -> None:
    files, named = GATE_CASES[case]
    passed, failed = _gate(gate_config, files, tmp_path / "docs")
    assert not passed, f"{case}: the gate passed"
    assert any(named in line for line in failed), failed
    report.record("adversarial", f"gate: {case}", "gate fails before provisioning, names it")


def test_gate_skips_only_the_completion_marker(gate_config: Any, tmp_path: Path) -> None:
    from backends.blob import container_client
    from gate.manifest import list_dataset

    passed, _ = _gate(gate_config, {}, tmp_path / "docs")
    assert passed
    container = container_client(gate_config.data)
    _upload(container, {"images/v1/_SUCCESS": b"", "images/v1/train/_notes.txt": b"x"})
    names = {b.name for b in list_dataset(gate_config.data)}
    assert "images/v1/_SUCCESS" not in names and "images/v1/train/_notes.txt" in names


# ---------------------------------------------------------------------------- image formats


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto\n"


@pytest.mark.processes
def test_eps_named_png_never_reaches_ghostscript(tmp_path: Path) -> None:
    """The trainer, the shard packer and the scorer decode through the same two functions;
    neither may hand a file to Ghostscript (a fake ``gs`` on PATH logs any call)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "gs-called"
    (fake / "gs").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    (fake / "gs").chmod(0o755)
    image = tmp_path / "cat.png"
    image.write_bytes(EPS)
    script = (
        "import sys; from pathlib import Path\n"
        "from imagedata.dataset import DatasetError\n"
        "from imagedata.image_folders import ImageFolderSplit, decode_checked\n"
        f"p = Path({str(image)!r})\n"
        "print('verdict:', decode_checked(p, 32))\n"
        "try:\n    ImageFolderSplit([(p, 0)], 32)[0]\nexcept DatasetError as e:\n"
        "    print('dataset error:', e)\n"
    )
    env = {**child_env(), "PATH": f"{fake}{os.pathsep}{child_env()['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "verdict: unreadable image" in proc.stdout and "cannot decode image" in proc.stdout
    assert not log.exists(), f"Ghostscript was called: {log.read_text()}"
    assert isinstance(decode_checked(image, 32), str)
    report.record(
        "adversarial",
        "image: EPS document named .png (trainer, shards, scorer)",
        "refused as unreadable; Ghostscript never called",
    )


# ---------------------------------------------------------------------------- CIFAR


class _ZeroStrided:
    """Pickles as numpy.ndarray(shape, uint8, 1-byte buffer, 0, zero strides)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __reduce__(self) -> Any:
        return (np.ndarray, (self.shape, np.dtype("u1"), b"\x00", 0, (0,) * len(self.shape)))


def _cifar(root: Path, batch: Any, meta: Any = None) -> Path:
    from tests.imagedata.test_cifar import write_cifar_pickle

    write_cifar_pickle(root)
    with open(root / "data_batch_1", "wb") as fh:
        pickle.dump(batch, fh, protocol=2)
    if meta is not None:
        with open(root / "batches.meta", "wb") as fh:
            pickle.dump(meta, fh, protocol=2)
    return root


def test_zero_strided_cifar_pickle_is_refused_by_size(tmp_path: Path) -> None:
    """177 bytes that claim 553,000 images (1.7 GB once materialised)."""
    n = 553_000
    batch = {b"data": _ZeroStrided((n, 3072)), b"labels": _ZeroStrided((n,))}
    root = _cifar(tmp_path / "cifar", batch)
    size = (root / "data_batch_1").stat().st_size
    assert size < 400
    with pytest.raises(DatasetError, match=r"data_batch_1 is not a valid CIFAR pickle"):
        open_dataset(str(root), 32)
    report.record(
        "adversarial",
        f"CIFAR: {size}-byte pickle, zero-strided numpy.ndarray of {n} x 3072",
        "refused before any allocation, names the file",
        would_allocate_gb=round(n * 3072 / 1e9, 2),
    )


HOSTILE_CIFAR = {
    "data is a string": ({b"data": "x" * 10, b"labels": [0]}, None, "'data' is not a uint8 array"),
    "labels is a string": (
        {b"data": np.zeros((1, 3072), np.uint8), b"labels": "0"},
        None,
        "'labels' is not a list of integers",
    ),
    "labels holds floats": (
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0.5, 1]},
        None,
        "'labels' is not a list of integers",
    ),
    "data is float64": (
        {b"data": np.zeros((1, 3072)), b"labels": [0]},
        None,
        "dtype 'f8' is not an integer type",
    ),
    "batch is a list": ([1, 2, 3], None, "holds a list, not a dict"),
    "meta is a list": (None, [b"cat"], "batches.meta holds a list, not a dict"),
    "label_names is an int": (None, {b"label_names": 5}, "label_names is not a list"),
    "label_names holds numbers": (None, {b"label_names": [1, 2]}, "class name 1 is not"),
    "label_names repeat": (None, {b"label_names": [b"a"] * 10}, "class names repeat"),
}


@pytest.mark.parametrize("case", list(HOSTILE_CIFAR))
def test_hostile_cifar_fields_are_named_errors(case: str, tmp_path: Path) -> None:
    batch, meta, expected = HOSTILE_CIFAR[case]
    root = tmp_path / "cifar"
    if batch is None:
        from tests.imagedata.test_cifar import write_cifar_pickle

        write_cifar_pickle(root)
        with open(root / "batches.meta", "wb") as fh:
            pickle.dump(meta, fh, protocol=2)
    else:
        _cifar(root, batch)
    with pytest.raises(DatasetError, match=expected) as err:
        open_dataset(str(root), 32)
    assert str(root) in str(err.value)
    report.record("adversarial", f"CIFAR: {case}", "DatasetError naming the file")


@pytest.mark.processes
def test_hostile_cifar_exits_2_without_a_traceback(tmp_path: Path) -> None:
    root = _cifar(tmp_path / "cifar", {b"data": "x", b"labels": {"a": 1}})
    result = run_trainer(1, root, tmp_path / "out", "--epochs", "1")
    assert result.returncode == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.processes
def test_checkpoint_of_other_shapes_falls_back_to_an_intact_one(
    small_folders: Path, tmp_path: Path
) -> None:
    ckpts = tmp_path / "ckpt"
    args = ("--batch-size", "8", "--checkpoint-dir", str(ckpts), "--seed", "3")
    first = run_trainer(1, small_folders, tmp_path / "o1", "--epochs", "2", *args)
    assert first.returncode == 0, first.output
    state = torch.load(ckpts / "checkpoint-2.pt", weights_only=True)
    name = next(k for k, v in state["model"].items() if v.dim() == 2)  # the classifier
    state["model"][name] = torch.zeros(7, 5)
    state["epoch"] = 3
    torch.save(state, ckpts / "checkpoint-3.pt")  # loads fine, does not fit the model

    resumed = run_trainer(1, small_folders, tmp_path / "o2", "--epochs", "3", *args)
    assert resumed.returncode == 0, resumed.output
    assert "skipping checkpoint" in resumed.output and name in resumed.output
    assert "resuming from checkpoint-2.pt" in resumed.output
    assert [e["epoch"] for e in resumed.metrics["epochs"]][-1] == 3
    report.record(
        "adversarial",
        "checkpoint: newest loads but has other shapes",
        "skipped with the reason; resumed from the previous intact one",
    )


# ---------------------------------------------------------------------------- the scorer


def _model_files() -> dict[str, Any]:
    good = {
        "state_dict": {"w": torch.zeros(2)},
        "class_names": ["a", "b"],
        "model_name": "cnn",
        "input_size": 32,
    }
    return {
        "a list": [1, 2],
        "a tensor": torch.zeros(3),
        "wrong shapes": good,
        "unknown model": {**good, "model_name": "vgg"},
        "input size 10^8": {**good, "input_size": 10**8},
        "class names not a list": {**good, "class_names": "ab"},
    }


@pytest.mark.parametrize(
    "case",
    [
        "a list",
        "a tensor",
        "wrong shapes",
        "unknown model",
        "input size 10^8",
        "class names not a list",
    ],
)
def test_malformed_model_file_is_refused_by_the_scorer(
    case: str, small_folders: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.score import main as score

    model = tmp_path / "model.pt"
    torch.save(_model_files()[case], model)
    out = tmp_path / "score.json"
    error = tmp_path / "error.json"
    args = ["--model", str(model), "--data-dir", str(small_folders), "--output", str(out)]
    code = score([*args, "--error-output", str(error)])  # the CLI's entry point, in-process
    assert code == 2
    assert f"error: model file {model}" in capsys.readouterr().err
    assert not out.exists()  # no score from a refused model
    reason = json.loads(error.read_text())["error"]  # for the orchestrator
    assert reason.startswith(f"model file {model}")
    report.record("adversarial", f"scorer: model.pt is {case}", "exit 2, names the file")


# ---------------------------------------------------------------------------- config sizes


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("training.image_size=100000000", "training.image_size"),
        ("training.batch_size=1000000000000", "training.batch_size"),
        ("validation.max_side=4", "max_side (4) is less than min_side (8)"),
        ("validation.max_side=100000", "validation.max_side"),
    ],
)
def test_absurd_sizes_are_config_errors(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        load_config(LOCAL, [override])
    report.record("adversarial", f"config --set {override}", f"refused, names {field}")


# ---------------------------------------------------------------------------- shard packs


@pytest.mark.processes
def test_two_packs_of_one_folder_at_once(tmp_path: Path) -> None:
    """Pack A is stopped while it writes a shard; pack B of the same folder runs meanwhile;
    then A goes on. Both finish, and the index written last names complete shards."""
    from imagedata.make_images import write_synthetic

    root = tmp_path / "data"
    # Enough images that a split's shard stays open across two decode batches (4096 each).
    write_synthetic(root, classes=3, per_class=2800, size=8, test_fraction=0.05, seed=1)
    shards = root / SHARD_DIR
    code = (
        "import sys; from pathlib import Path; from imagedata.shards import pack_shards; "
        "print(pack_shards(Path(sys.argv[1]), 8, workers=1).action)"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", code, str(root)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        while first.poll() is None and not (
            shards.is_dir() and any(p.name.endswith(".tmp") for p in shards.iterdir())
        ):
            time.sleep(0.005)
        assert first.poll() is None, "pack A ended before it could be paused"
        os.kill(first.pid, signal.SIGSTOP)  # mid-write
        box: dict[str, Any] = {}
        second = threading.Thread(target=lambda: box.update(r=pack_shards(root, 8, workers=1)))
        second.start()
        second.join(timeout=5)  # with a lock it waits for A; without, it runs to its end
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, _ = first.communicate(timeout=300)
    second.join(timeout=300)
    assert first.returncode == 0, out
    assert box["r"].action in ("packed", "unchanged")
    index = json.loads((shards / INDEX).read_text())
    opened = open_shards(root, 8)
    assert not isinstance(opened, str), opened
    assert (
        sum(len(s) for s in opened.splits.values())
        == 8400
        == sum(s["count"] for s in index["splits"].values())
    )
    assert not [p for p in shards.iterdir() if p.name.endswith(".tmp")]
    report.record(
        "adversarial",
        "shards: two packs of one folder at once (one paused mid-write)",
        f"both finished ({out.strip()}, {box['r'].action}); index consistent",
    )
