"""`python -m training.predict` labels new images as the scorer reads them, and names what it
cannot read; `training.score` scores a folder that holds only the split it scores."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, child_env, run_trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model trained for one epoch on a small synthetic dataset, and that dataset."""
    from imagedata.make_images import write_synthetic

    root = tmp_path_factory.mktemp("predict")
    data = root / "data"
    write_synthetic(data, classes=3, per_class=16, size=32, test_fraction=0.3, seed=1)
    result = run_trainer(1, data, root / "out", "--epochs", "1", "--batch-size", "8", onnx=True)
    assert result.returncode == 0, result.output
    return root / "out" / "model.pt", data


def _run(module: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.processes
def test_predictions_are_the_scorers_own_on_the_same_images(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """The top class of every test image is the one the scorer predicts for it: the same
    decoding, resizing and cropping, the same model; its probabilities are a softmax's."""
    from imagedata.data import open_dataset
    from training.score import load_model
    from training.score import predict as score_predict

    model_path, data = trained
    unlabelled = tmp_path / "new"
    unlabelled.mkdir()
    for image in sorted((data / "test").rglob("*.png")):  # the labels' folders are dropped
        shutil.copyfile(image, unlabelled / f"{image.parent.name}-{image.name}")
    proc = _run(
        "training.predict",
        "--model",
        model_path,
        "--dir",
        unlabelled,
        "--top-k",
        "3",
        "--batch-size",
        "4",  # several batches, the last one short
        "--output",
        tmp_path / "preds.csv",
    )
    assert proc.returncode == 0, proc.stderr
    rows = _rows(tmp_path / "preds.csv")

    model, saved = load_model(model_path)
    split = open_dataset(str(data), saved["input_size"], use_shards=False).splits["test"]
    _, predicted = score_predict(model, split.dataset)
    samples = split.dataset.samples  # type: ignore[attr-defined]
    expected = {
        f"{path.parent.name}-{path.name}": saved["class_names"][label]
        for (path, _), label in zip(samples, predicted, strict=True)
    }
    assert {Path(r["image"]).name: r["label_1"] for r in rows} == expected
    for row in rows:
        probabilities = [float(row[f"probability_{k}"]) for k in (1, 2, 3)]
        assert probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) == pytest.approx(1.0, abs=1e-4)  # 3 classes, all listed
        assert {row[f"label_{k}"] for k in (1, 2, 3)} == set(saved["class_names"])


@pytest.mark.processes
def test_any_image_the_trainer_takes_is_labelled_and_damaged_ones_are_named(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    model_path, _ = trained
    images = {
        "big.jpg": Image.new("RGB", (640, 480), (200, 30, 30)),
        "grey.png": Image.new("L", (20, 50), 128),
        "alpha.png": Image.new("RGBA", (33, 33), (0, 0, 255, 100)),
        "palette.png": Image.new("P", (40, 40), 3),
        "cmyk.jpg": Image.new("CMYK", (64, 48), (0, 100, 200, 0)),
    }
    for name, image in images.items():
        image.save(tmp_path / name)
    (tmp_path / "zero.png").write_bytes(b"")
    (tmp_path / "junk.jpg").write_bytes(b"not an image at all")
    (tmp_path / "eps.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    (tmp_path / "notes.txt").write_text("not an image name")
    args = [tmp_path / n for n in sorted(images)] + [
        tmp_path / n for n in ("zero.png", "junk.jpg", "eps.png", "notes.txt", "missing.png")
    ]
    proc = _run("training.predict", "--model", model_path, "--top-k", "1", *args)

    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(proc.stdout.splitlines()))
    assert [Path(r["image"]).name for r in rows] == sorted(images)
    assert set(rows[0]) == {"image", "label_1", "probability_1"}
    for name, why in (
        ("zero.png", "zero-byte file"),
        ("junk.jpg", "unreadable image"),
        ("eps.png", "unreadable image"),
        ("notes.txt", "not a .png, .jpg or .jpeg file"),
        ("missing.png", "no such file"),
    ):
        assert f"skipped {tmp_path / name}: {why}" in proc.stderr
    assert "labelled 5 images, skipped 5" in proc.stderr


@pytest.mark.processes
def test_nothing_readable_and_a_bad_model_are_errors(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    model_path, _ = trained
    (tmp_path / "zero.png").write_bytes(b"")
    proc = _run("training.predict", "--model", model_path, tmp_path / "zero.png")
    assert proc.returncode == 2 and "none of the 1 images could be read" in proc.stderr
    proc = _run("training.predict", "--model", model_path, "--dir", tmp_path / "nowhere")
    assert proc.returncode == 2 and "does not exist or is not a folder" in proc.stderr
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 truncated")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    out = tmp_path / "preds.csv"
    proc = _run(
        "training.predict", "--model", tmp_path / "bad.pt", tmp_path / "a.png", "--output", out
    )
    assert (
        proc.returncode == 2 and f"model file {tmp_path / 'bad.pt'} cannot be read" in proc.stderr
    )
    assert not out.exists()


@pytest.mark.gpu
def test_the_gpu_gives_the_cpus_labels(trained: tuple[Path, Path]) -> None:
    from training.predict import predict

    assert torch.cuda.is_available(), "selected with -m gpu, which needs a CUDA device"
    model_path, data = trained
    images = sorted((data / "test").rglob("*.png"))
    on_cpu, _ = predict(model_path, images, top_k=3, device="cpu")
    on_gpu, _ = predict(model_path, images, top_k=3, device="cuda")
    assert [p.top[0][0] for p in on_gpu] == [p.top[0][0] for p in on_cpu]
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert [v for _, v in gpu.top] == pytest.approx([v for _, v in cpu.top], abs=1e-3)


@pytest.mark.processes
def test_the_scorer_takes_a_folder_with_only_the_split_it_scores(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    model_path, data = trained
    only_test = tmp_path / "held-out"
    shutil.copytree(data / "test", only_test / "test")
    proc = _run(
        "training.score",
        "--model",
        model_path,
        "--data-dir",
        only_test,
        "--output",
        tmp_path / "s.json",
    )
    assert proc.returncode == 0, proc.stderr
    full = _run(
        "training.score", "--model", model_path, "--data-dir", data, "--output", tmp_path / "f.json"
    )
    assert full.returncode == 0, full.stderr
    alone, whole = (json.loads((tmp_path / n).read_text()) for n in ("s.json", "f.json"))
    assert alone["num_images"] == whole["num_images"] > 0
    assert alone["confusion_matrix"] == whole["confusion_matrix"]
    # Another split than the one there is still named.
    proc = _run(
        "training.score",
        "--model",
        model_path,
        "--data-dir",
        only_test,
        "--split",
        "val",
        "--output",
        tmp_path / "v.json",
    )
    assert (
        proc.returncode == 2 and f"missing split: {only_test / 'val'} does not exist" in proc.stderr
    )


@pytest.mark.processes
def test_model_onnx_labels_as_model_pt_does_without_torch(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """The trainer's model.onnx gives every image the label model.pt gives it, with the same
    probabilities, in a process that cannot import torch."""
    from tests.isolated import run_refusing

    refused = run_refusing(("torch",), "import torch\n", tmp_path)
    assert refused.returncode != 0 and "torch is refused in this process" in refused.stderr
    model_path, data = trained
    onnx_path = model_path.with_name("model.onnx")
    images = sorted((data / "test").rglob("*.png"))
    Image.new("RGBA", (50, 30), (0, 0, 255, 100)).save(tmp_path / "other-size.png")
    images.append(tmp_path / "other-size.png")
    (tmp_path / "damaged.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    images.append(tmp_path / "damaged.png")
    listed = tmp_path / "images.txt"
    listed.write_text("\n".join(map(str, images)))
    args = ["--model", str(onnx_path), "--top-k", "3", "--output", str(tmp_path / "onnx.csv")]
    code = (
        "from training.predict import main\n"
        f"code = main({args!r} + open({str(listed)!r}).read().split('\\n'))\n"
        "assert code == 0, code\n"
    )
    env = {**child_env(), "PYTHONPATH": str(ROOT)}
    proc = run_refusing(("torch",), code, tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {tmp_path / 'damaged.png'}: unreadable image" in proc.stderr
    with_pt = _run(
        "training.predict", "--model", model_path, "--output", tmp_path / "pt.csv", *images
    )
    assert with_pt.returncode == 0, with_pt.stderr
    onnx_rows, pt_rows = _rows(tmp_path / "onnx.csv"), _rows(tmp_path / "pt.csv")
    assert len(onnx_rows) == len(images) - 1
    assert [(r["image"], r["label_1"]) for r in onnx_rows] == [
        (r["image"], r["label_1"]) for r in pt_rows
    ]
    for ours, theirs in zip(onnx_rows, pt_rows, strict=True):
        for k in (1, 2, 3):
            key = f"probability_{k}"
            assert float(ours[key]) == pytest.approx(float(theirs[key]), abs=2e-6)


@pytest.mark.processes
def test_a_file_that_is_no_trainers_onnx_model_is_named(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    import onnx

    model_path, _ = trained
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07 not protobuf at all")
    proc = _run("training.predict", "--model", tmp_path / "junk.onnx", tmp_path / "a.png")
    assert proc.returncode == 2
    assert f"model file {tmp_path / 'junk.onnx'} cannot be read" in proc.stderr
    # A real ONNX model without the trainer's metadata.
    bare = onnx.load(model_path.with_name("model.onnx"))
    del bare.metadata_props[:]
    onnx.save(bare, tmp_path / "bare.onnx")
    proc = _run("training.predict", "--model", tmp_path / "bare.onnx", tmp_path / "a.png")
    assert proc.returncode == 2
    assert "lacks the metadata classes (a JSON list) and input_size" in proc.stderr
    proc = _run(
        "training.predict",
        "--model",
        model_path.with_name("model.onnx"),
        "--device",
        "cuda",
        tmp_path / "a.png",
    )
    assert proc.returncode == 2 and "model.onnx runs on the CPU" in proc.stderr


HOSTILE_NAMES = [
    "=cmd|' -C calc'!A0.png",
    '=HYPERLINK("http:evil.example","open").png',
    "@SUM(1+1).png",
    "+1+1.png",
    "-2+3.png",
    "a;=1+1.png",
]


@pytest.mark.processes
def test_image_names_reach_the_csv_as_text_not_formulas(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """OWASP's CSV-injection rule: a cell that begins with = + - @ (or a tab or carriage
    return) gets a ' before it, and every cell is quoted (a ';' cannot start a new cell).
    Before: the names went into the CSV as they are, and a spreadsheet ran them."""
    model_path, _ = trained
    for name in HOSTILE_NAMES:
        Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.predict",
            "--model",
            str(model_path),
            "--",
            *HOSTILE_NAMES,
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.startswith('"') for line in lines), lines
    images = [row[0] for row in csv.reader(lines[1:])]
    assert images == [name if name.startswith("a;") else f"'{name}" for name in HOSTILE_NAMES]
