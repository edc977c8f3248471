"""Label new images with a trained model::

    python -m training.predict --model model.pt (IMAGES... | --dir D) [--top-k K] [--output F]

Each image is decoded, resized and centre-cropped exactly as the trainer and the scorer read
their data (``training.image_folders.decode_checked``: PNG or JPEG by name and content, any size
or mode, made RGB at the model's input size), then classified in batches, on the GPU when there
is one. One CSV row per image: its path, then the ``K`` most likely classes, each with its
probability (softmax), the likeliest first. An image that cannot be used (unreadable, empty, not
a PNG or JPEG) is named on stderr and skipped; the others are still labelled.

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
from typing import TextIO

import torch

from training.atomic import atomic_write
from training.image_folders import decode_checked
from training.images import is_image_name
from training.score import ModelFileError, load_model


class PredictError(ValueError):
    """Nothing to label: no input given, a folder with no image, or no readable image."""


@dataclass(frozen=True)
class Prediction:
    image: str
    top: list[tuple[str, float]]  # class name and probability, likeliest first


def images_in(folder: Path) -> list[Path]:
    """Every image file under ``folder`` (its sub-folders too), in a stable order."""
    if not folder.is_dir():
        raise PredictError(f"--dir {folder} does not exist or is not a folder")
    return sorted(p for p in folder.rglob("*") if p.is_file() and is_image_name(p))


def _decoded(
    paths: Iterable[Path], size: int, skipped: list[tuple[Path, str]]
) -> Iterator[tuple[Path, torch.Tensor]]:
    for path in paths:
        if not is_image_name(path):
            skipped.append((path, "not a .png, .jpg or .jpeg file"))
            continue
        if not path.is_file():
            skipped.append((path, "no such file"))
            continue
        verdict = decode_checked(path, size)
        if isinstance(verdict, torch.Tensor):
            yield path, verdict
        else:
            skipped.append((path, verdict or "unreadable image"))


def _batches(
    items: Iterable[tuple[Path, torch.Tensor]], size: int
) -> Iterator[list[tuple[Path, torch.Tensor]]]:
    batch: list[tuple[Path, torch.Tensor]] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@torch.no_grad()
def predict(
    model_path: Path,
    paths: Sequence[Path],
    top_k: int = 3,
    batch_size: int = 64,
    device: str | None = None,
) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """The predictions for the usable images among ``paths`` and, for the others, why each
    was skipped. Decoding is lazy, a batch at a time, so memory stays flat."""
    model, saved = load_model(model_path)
    names: list[str] = saved["class_names"]
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(target)
    k = max(1, min(top_k, len(names)))
    skipped: list[tuple[Path, str]] = []
    predictions: list[Prediction] = []
    for batch in _batches(_decoded(paths, saved["input_size"], skipped), batch_size):
        images = torch.stack([tensor for _, tensor in batch]).to(target).float()
        probabilities = torch.softmax(model(images).float(), dim=1)
        values, indices = probabilities.topk(k, dim=1)
        for (path, _), row_values, row_indices in zip(
            batch, values.tolist(), indices.tolist(), strict=True
        ):
            top = [(names[i], p) for i, p in zip(row_indices, row_values, strict=True)]
            predictions.append(Prediction(str(path), top))
    return predictions, skipped


def write_csv(predictions: Sequence[Prediction], out: TextIO, top_k: int) -> None:
    k = max((len(p.top) for p in predictions), default=top_k)
    writer = csv.writer(out, lineterminator="\n")
    header = ["image"]
    for rank in range(1, k + 1):
        header += [f"label_{rank}", f"probability_{rank}"]
    writer.writerow(header)
    for p in predictions:
        row = [p.image]
        for name, probability in p.top:
            row += [name, f"{probability:.6f}"]
        writer.writerow(row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m training.predict",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, required=True, help="a model.pt the trainer wrote")
    p.add_argument("images", nargs="*", type=Path, help="image files to label")
    p.add_argument("--dir", type=Path, help="label every image under this folder")
    p.add_argument("--top-k", type=int, default=3, help="classes per image (default 3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when there is one)")
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
