"""Write a small image-folder dataset: ``python -m imagedata.make_images --output D``.

Two sources, both available offline: ``digits`` (scikit-learn's 1,797 real 8x8 handwritten
digits, grayscale) and ``synthetic`` (class-patterned colour images, any size). Used by the
demo, the tests and the benchmarks so they all train on the same kind of data.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from imagedata.synthetic import SyntheticSplit, encode_png, synthetic_templates


def write_digits(output: Path, test_fraction: float, seed: int, per_class: int | None) -> int:
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.target))
    counts: dict[int, int] = {}
    written = 0
    for i in order:
        label = int(digits.target[i])
        if per_class is not None and counts.get(label, 0) >= per_class:
            continue
        counts[label] = counts.get(label, 0) + 1
        split = "test" if rng.random() < test_fraction else "train"
        pixels = (digits.images[i] * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
        image = torch.from_numpy(pixels).unsqueeze(0)
        _write(output / split / f"digit_{label}" / f"{i:05d}.png", encode_png(image))
        written += 1
    return written


def write_synthetic(
    output: Path, classes: int, per_class: int, size: int, test_fraction: float, seed: int
) -> int:
    templates = synthetic_templates(classes, size, seed)
    source = SyntheticSplit(classes * per_class * 4, 0, templates, seed)
    counts = dict.fromkeys(range(classes), 0)
    rng = np.random.default_rng(seed)
    written = 0
    for index in range(len(source)):
        image, label = source[index]
        if counts[label] >= per_class:
            continue
        counts[label] += 1
        split = "test" if rng.random() < test_fraction else "train"
        _write(output / split / f"class_{label}" / f"{index:06d}.png", encode_png(image))
        written += 1
        if all(c >= per_class for c in counts.values()):
            break
    return written


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m imagedata.make_images", description=__doc__)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--source", choices=["digits", "synthetic"], default="synthetic")
    p.add_argument("--classes", type=int, default=4, help="synthetic only")
    p.add_argument("--per-class", type=int, help="images per class (digits: cap)")
    p.add_argument("--size", type=int, default=32, help="synthetic only")
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.source == "digits":
        n = write_digits(args.output, args.test_fraction, args.seed, args.per_class)
    else:
        n = write_synthetic(
            args.output,
            args.classes,
            args.per_class or 50,
            args.size,
            args.test_fraction,
            args.seed,
        )
    print(f"wrote {n} images to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
