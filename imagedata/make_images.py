"""Write a small image-folder dataset: ``python -m imagedata.make_images --output D``.

Three sources, all available offline: ``digits`` (scikit-learn's 1,797 real 8x8 handwritten
digits, grayscale), ``textures`` (random crops of scikit-image's photographs of brick, grass and
gravel, the textures a team might photograph themselves) and ``synthetic`` (class-patterned
colour images, any size). Used by the demo, the tests and the benchmarks so they all train on
the same kind of data.
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


TEXTURES = ("brick", "grass", "gravel")
# The share of each photograph's rows that each split's crops come from: crops of one split
# never overlap another's, so the test images are pixels no training image saw.
_TEXTURE_BANDS = {"train": (0.0, 0.6), "val": (0.6, 0.8), "test": (0.8, 1.0)}


def write_textures(
    output: Path,
    per_split: dict[str, int],
    seed: int,
    classes: tuple[str, ...] = TEXTURES,
    sides: tuple[int, int] = (48, 96),
) -> int:
    """Random square crops (sides drawn in ``sides``, as PNG at their own size) of the
    photographs scikit-image ships (``skimage.data.brick()``, ``grass()``, ``gravel()``: 512 x
    512 grayscale), ``per_split[split]`` per class, each split from its own band of rows."""
    import skimage.data
    from PIL import Image

    rng = np.random.default_rng(seed)
    written = 0
    for name in classes:
        photo = np.asarray(getattr(skimage.data, name)())
        height, width = photo.shape[:2]
        for split, count in per_split.items():
            top, bottom = (round(f * height) for f in _TEXTURE_BANDS[split])
            for i in range(count):
                side = int(rng.integers(sides[0], min(sides[1], bottom - top) + 1))
                y = int(rng.integers(top, bottom - side + 1))
                x = int(rng.integers(0, width - side + 1))
                path = output / split / name / f"{name}_{seed}_{i:04d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(photo[y : y + side, x : x + side]).save(path)
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
    p.add_argument("--source", choices=["digits", "textures", "synthetic"], default="synthetic")
    p.add_argument("--classes", type=int, default=4, help="synthetic only")
    p.add_argument(
        "--per-class", type=int, help="images per class (digits: cap; textures: in train)"
    )
    p.add_argument("--size", type=int, default=32, help="synthetic only")
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.source == "digits":
        n = write_digits(args.output, args.test_fraction, args.seed, args.per_class)
    elif args.source == "textures":
        train = args.per_class or 120
        splits = {"train": train, "val": train // 4, "test": train // 4}
        n = write_textures(args.output, splits, args.seed)
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
