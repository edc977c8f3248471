"""Label new images with a trained model::

    python -m training.predict --model model.pt|model.onnx (IMAGES... | --dir D) [--top-k K]
        [--output F]

Each image is decoded, resized and centre-cropped exactly as the trainer and the scorer read
their data (``imagedata.model_input.decode_array``: PNG or JPEG by name and content, any size or
mode, made RGB at the model's input size), then classified in batches. ``model.pt`` runs with
PyTorch, on the GPU when there is one; ``model.onnx`` with onnxruntime on the CPU, and then torch
is never imported (``training.onnx_model``). One CSV row per image: its path, then the ``K``
most likely classes, each with its probability (softmax), the likeliest first. An image that
cannot be used (unreadable, empty, not a PNG or JPEG) is named on stderr and skipped; the others
are still labelled.

Every cell of the CSV is quoted, and a name that begins with ``=``, ``+``, ``-``, ``@``, a tab
or a carriage return is written with a ``'`` before it (OWASP's rule against CSV injection):
image and class names come from whoever named the files, and a spreadsheet would run such a
cell as a formula.

Exit status: 0 when at least one image was labelled (skipped ones are on stderr), 2 when the
model file cannot be used, nothing was given, or no image could be read.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

import numpy as np

from common.atomic import atomic_write
from imagedata.images import is_image_name
from imagedata.model_input import decode_array
from training.model_file import ModelFileError

# OWASP's CSV injection rule: a cell starting with one of these is a formula to a spreadsheet.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class PredictError(ValueError):
    """Nothing to label: no input given, a folder with no image, or no readable image."""


@dataclass(frozen=True)
class Prediction:
    image: str
    top: list[tuple[str, float]]  # class name and probability, likeliest first


class Classifier(Protocol):
    """A trained model as ``predict`` uses it, whichever file it came from."""

    class_names: list[str]
    input_size: int

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """Softmax probabilities of a uint8 ``(N, 3, S, S)`` batch, ``(N, classes)``."""
        ...


class TorchClassifier:
    """A ``model.pt`` on ``device`` (default: the GPU when there is one)."""

    def __init__(self, path: Path, device: str | None) -> None:
        import torch

        from training.score import load_model

        model, saved = load_model(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device)
        self.class_names: list[str] = saved["class_names"]
        self.input_size: int = saved["input_size"]

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            batch = torch.from_numpy(images).to(self.device).float()
            return torch.softmax(self.model(batch).float(), dim=1).cpu().numpy()


def load_classifier(path: Path, device: str | None = None) -> Classifier:
    """``model.onnx`` (by its suffix) with onnxruntime, anything else as a ``model.pt``."""
    if path.suffix.lower() == ".onnx":
        if device not in (None, "cpu"):
            raise PredictError(f"--device {device}: model.onnx runs on the CPU (onnxruntime)")
        from training.onnx_model import OnnxModel

        return OnnxModel(path)
    return TorchClassifier(path, device)


def images_in(folder: Path) -> list[Path]:
    """Every image file under ``folder`` (its sub-folders too), in a stable order."""
    if not folder.is_dir():
        raise PredictError(f"--dir {folder} does not exist or is not a folder")
    return sorted(p for p in folder.rglob("*") if p.is_file() and is_image_name(p))


def _decoded(
    paths: Iterable[Path], size: int, skipped: list[tuple[Path, str]]
) -> Iterator[tuple[Path, np.ndarray]]:
    for path in paths:
        if not is_image_name(path):
            skipped.append((path, "not a .png, .jpg or .jpeg file"))
            continue
        if not path.is_file():
            skipped.append((path, "no such file"))
            continue
        verdict = decode_array(path, size)
        if isinstance(verdict, np.ndarray):
            yield path, verdict
        else:
            skipped.append((path, verdict or "unreadable image"))


def _batches(
    items: Iterable[tuple[Path, np.ndarray]], size: int
) -> Iterator[list[tuple[Path, np.ndarray]]]:
    batch: list[tuple[Path, np.ndarray]] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def predict(
    model_path: Path,
    paths: Sequence[Path],
    top_k: int = 3,
    batch_size: int = 64,
    device: str | None = None,
) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """The predictions for the usable images among ``paths`` and, for the others, why each
    was skipped. Decoding is lazy, a batch at a time, so memory stays flat."""
    model = load_classifier(Path(model_path), device)
    names = model.class_names
    k = max(1, min(top_k, len(names)))
    skipped: list[tuple[Path, str]] = []
    predictions: list[Prediction] = []
    for batch in _batches(_decoded(paths, model.input_size, skipped), batch_size):
        probabilities = model.probabilities(np.stack([array for _, array in batch]))
        # The likeliest first; of equal ones, the first class (as argmax picks).
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
        for (path, _), row, indices in zip(batch, probabilities, order, strict=True):
            top = [(names[i], float(row[i])) for i in indices]
            predictions.append(Prediction(str(path), top))
    return predictions, skipped


def csv_text(value: str) -> str:
    """``value`` as a spreadsheet shows it as text: OWASP's rule, a ``'`` before a cell that
    would start a formula."""
    return f"'{value}" if value.startswith(FORMULA_STARTS) else value


def write_csv(predictions: Sequence[Prediction], out: TextIO, top_k: int) -> None:
    k = max((len(p.top) for p in predictions), default=top_k)
    # Every cell quoted: a separator inside a name (a ';' where the spreadsheet's locale splits
    # on it) cannot start a new cell there.
    writer = csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_ALL)
    header = ["image"]
    for rank in range(1, k + 1):
        header += [f"label_{rank}", f"probability_{rank}"]
    writer.writerow(header)
    for p in predictions:
        row = [csv_text(p.image)]
        for name, probability in p.top:
            row += [csv_text(name), f"{probability:.6f}"]
        writer.writerow(row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m training.predict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=Path, required=True, help="a model.pt or model.onnx the trainer wrote"
    )
    p.add_argument("images", nargs="*", type=Path, help="image files to label")
    p.add_argument("--dir", type=Path, help="label every image under this folder")
    p.add_argument("--top-k", type=int, default=3, help="classes per image (default 3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--device",
        help="cpu, cuda or cuda:N for a model.pt (default: cuda when there is one); "
        "a model.onnx runs on the CPU",
    )
    p.add_argument("--output", type=Path, help="the CSV file (default: standard output)")
    args = p.parse_args(argv)
    if args.top_k < 1 or args.batch_size < 1:
        p.error("--top-k and --batch-size must be at least 1")
    try:
        paths = list(args.images) + (images_in(args.dir) if args.dir else [])
        if not paths:
            raise PredictError(
                "no images: give image files, or --dir with a folder of .png/.jpg/.jpeg files"
            )
        predictions, skipped = predict(args.model, paths, args.top_k, args.batch_size, args.device)
        for path, why in skipped:
            print(f"skipped {path}: {why}", file=sys.stderr)
        if not predictions:
            raise PredictError(f"none of the {len(paths)} images could be read")
    except (ModelFileError, PredictError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:  # whole or not at all, as every output the trainer writes
        text = io.StringIO()
        write_csv(predictions, text, args.top_k)
        atomic_write(args.output, lambda fh: fh.write(text.getvalue().encode()))
    else:
        write_csv(predictions, sys.stdout, args.top_k)
    print(
        f"labelled {len(predictions)} images, skipped {len(skipped)}"
        + (f" -> {args.output}" if args.output else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
