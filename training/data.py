"""Datasets the trainer and the scorer read, detected from ``--data-dir``.

Three layouts are understood:

* image folders: ``D/train/<class>/*.png|jpg|jpeg``, ``D/test/<class>/...``, optional ``D/val``;
* a CIFAR-10 batches directory, python pickles or binary ``.bin`` records;
* ``synthetic:N``: generated images whose classes are learnable, for smoke runs and benchmarks.

Every layout yields uint8 CHW tensors at the model's input size, so the model (which owns its
normalisation) sees the same thing whatever the source. Bad input raises :class:`DatasetError`
naming the file, class or split; damaged images are skipped and reported, never silently used.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from training.images import SPLITS, is_image_name, open_image

REQUIRED_SPLITS = ("train", "test")
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
CIFAR_RECORD = 1 + 3 * 32 * 32


# Collects one picklable value from every rank (Horovod's allgather_object in the trainer), so
# work such as verifying images can be split across ranks.
Gather = Callable[[dict[str, str]], list[dict[str, str]]]


class DatasetError(ValueError):
    """The dataset cannot be used as given; the message names the offending path or class."""


@dataclass
class SplitData:
    """One split as a torch dataset plus what was dropped while indexing it."""

    dataset: Dataset[tuple[torch.Tensor, int]]
    skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # every dataset here is sized


@dataclass
class DatasetInfo:
    """What was found at ``--data-dir``: the format, class names and the splits present."""

    kind: str
    class_names: list[str]
    splits: dict[str, SplitData]
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- preprocessing


def to_model_input(image: Image.Image, size: int) -> torch.Tensor:
    """Resize the shorter side to ``size``, centre-crop, force RGB; return uint8 CHW.

    Grayscale, palette and RGBA images all become 3 channels so one model fits all inputs.
    """
    image = image.convert("RGB")
    w, h = image.size
    scale = size / min(w, h)
    if (w, h) != (size, size):
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        image = image.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = (nw - size) // 2, (nh - size) // 2
        image = image.crop((left, top, left + size, top + size))
    array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _array_to_input(chw: np.ndarray, size: int) -> torch.Tensor:
    """CIFAR arrays are 32x32 CHW; resize only when the model wants another size."""
    if chw.shape[1] == size and chw.shape[2] == size:
        return torch.from_numpy(np.ascontiguousarray(chw))
    return to_model_input(Image.fromarray(np.transpose(chw, (1, 2, 0))), size)


# ---------------------------------------------------------------------------- image folders


class ImageFolderSplit(Dataset[tuple[torch.Tensor, int]]):
    """Decodes lazily, so memory stays flat however large the split is."""

    def __init__(self, samples: Sequence[tuple[Path, int]], size: int) -> None:
        self.samples = list(samples)
        self.size = size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            with open_image(path) as image:
                return to_model_input(image, self.size), label
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DatasetError(f"cannot decode image {path}: {exc}") from exc


def decode_checked(path: Path, size: int | None) -> torch.Tensor | str | None:
    """Fully decode ``path`` (a valid header is not enough): the model input at ``size``, or
    None when no size is asked for; a string saying why when the file is unusable."""
    try:
        if path.stat().st_size == 0:
            return "zero-byte file"
        with open_image(path) as image:
            image.load()
            return None if size is None else to_model_input(image, size)
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        return f"unreadable image ({type(exc).__name__}: {exc})"


def _check_image(path: Path) -> str | None:
    verdict = decode_checked(path, None)
    return verdict if isinstance(verdict, str) else None


def _list_split(root: Path, split: str) -> dict[str, list[Path]]:
    split_dir = root / split
    if not split_dir.is_dir():
        raise DatasetError(f"missing split: {split_dir} does not exist (expected {split}/<class>/)")
    classes: dict[str, list[Path]] = {}
    for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        files = sorted(p for p in class_dir.iterdir() if p.is_file() and is_image_name(p))
        if not files:
            raise DatasetError(f"empty class folder: {class_dir} has no .png/.jpg/.jpeg images")
        classes[class_dir.name] = files
    if not classes:
        raise DatasetError(f"split {split_dir} has no class folders")
    return classes


def list_image_folders(root: Path) -> tuple[list[str], dict[str, dict[str, list[Path]]]]:
    """The class names and, per split present, each class's image files; checks that every
    split has the same classes (a model cannot score a class it never saw)."""
    listed = {
        s: _list_split(root, s) for s in SPLITS if s in REQUIRED_SPLITS or (root / s).is_dir()
    }
    class_names = sorted(listed["train"])
    for split, classes in listed.items():
        if sorted(classes) != class_names:
            only_here = sorted(set(classes) - set(class_names))
            missing = sorted(set(class_names) - set(classes))
            raise DatasetError(
                f"class sets differ between train and {split}: "
                f"only in {split}: {only_here or 'none'}; missing from {split}: {missing or 'none'}"
            )
    return class_names, listed


def labelled_samples(
    class_names: list[str], listed: dict[str, dict[str, list[Path]]], bad: dict[str, str]
) -> dict[str, tuple[list[tuple[Path, int]], list[str]]]:
    """Per split, the usable (file, label) pairs and the damaged files left out with why.

    A class whose every file is damaged in some split is an error, not a silent gap.
    """
    labels = {name: i for i, name in enumerate(class_names)}
    result: dict[str, tuple[list[tuple[Path, int]], list[str]]] = {}
    for split, classes in listed.items():
        samples: list[tuple[Path, int]] = []
        skipped: list[str] = []
        for name, files in classes.items():
            for path in files:
                if str(path) in bad:
                    skipped.append(f"{path}: {bad[str(path)]}")
                else:
                    samples.append((path, labels[name]))
            if all(str(p) in bad for p in files):
                raise DatasetError(
                    f"class {name!r} in split {split} has no readable images "
                    f"({len(files)} files, all damaged, e.g. {files[0]})"
                )
        result[split] = (samples, skipped)
    return result


def _load_image_folders(
    root: Path, size: int, verify: bool, rank: int, world: int, gather: Gather
) -> DatasetInfo:
    class_names, listed = list_image_folders(root)
    bad: dict[str, str] = {}
    if verify:
        # Each rank decodes its own share of the files; the verdicts are then shared, so every
        # rank drops exactly the same files and the samplers stay aligned.
        everything = [p for classes in listed.values() for fs in classes.values() for p in fs]
        mine = {str(p): why for p in everything[rank::world] if (why := _check_image(p))}
        for part in gather(mine):
            bad.update(part)
    splits = {
        split: SplitData(ImageFolderSplit(samples, size), skipped)
        for split, (samples, skipped) in labelled_samples(class_names, listed, bad).items()
    }
    return DatasetInfo("image-folders", class_names, splits)


# ---------------------------------------------------------------------------- CIFAR-10


class ArraySplit(Dataset[tuple[torch.Tensor, int]]):
    """In-memory uint8 images (N, 3, H, W); CIFAR-10 is 180 MB, small enough to hold."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, size: int) -> None:
        if len(images) != len(labels):
            raise DatasetError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.size = images, labels.astype(np.int64), size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return _array_to_input(self.images[index], self.size), int(self.labels[index])


class _Refused:
    """Stands in for ``numpy.ndarray`` in a pickle: a real batch only names it as the type
    ``_reconstruct`` builds; calling it (an array over a buffer with any strides, e.g. zero
    strides that make 177 bytes look like 1.7 GB) is refused."""

    def __init__(self, *args: object) -> None:
        raise pickle.UnpicklingError("numpy.ndarray called directly: not in a CIFAR batch")


class _PickledDtype:
    """Stands in for ``numpy.dtype``: only the plain numeric types a batch holds."""

    ALLOWED: ClassVar[set[str]] = {"u1", "i1", "b", "B", "i2", "u2", "i4", "u4", "i8", "u8"}

    def __init__(self, spec: object, align: object = False, copy: object = True) -> None:
        if isinstance(spec, bytes):
            spec = spec.decode("latin1")
        if not isinstance(spec, str) or spec not in self.ALLOWED:
            raise pickle.UnpicklingError(f"dtype {spec!r} is not an integer type of a CIFAR batch")
        self.dtype = np.dtype(spec)

    def __setstate__(self, state: object) -> None:
        # (version, byte order, subarray, names, fields, elsize, alignment, flags): a plain
        # numeric type has no subarray, names or fields; only its byte order is taken.
        if not (
            isinstance(state, tuple)
            and len(state) >= 5
            and state[1] in ("<", ">", "|", "=")
            and state[2] is None
            and state[3] is None
            and state[4] is None
        ):
            raise pickle.UnpicklingError(f"dtype state {state!r} is not a plain numeric type")
        if state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])


class _PickledArray:
    """Stands in for an array being unpickled: built from the bytes in the file only, so it
    can never be larger than the file (no strides, no uninitialised allocation)."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            state = state[1:]  # (version, shape, dtype, is_fortran, raw)
        if not (isinstance(state, tuple) and len(state) == 4):
            raise pickle.UnpicklingError("array state is not (shape, dtype, order, data)")
        shape, dtype, fortran, raw = state
        if not (
            isinstance(shape, tuple)
            and 1 <= len(shape) <= 4
            and all(type(n) is int and n >= 0 for n in shape)
        ):
            raise pickle.UnpicklingError(f"array shape {shape!r} is not a CIFAR array's")
        if not isinstance(dtype, _PickledDtype) or not isinstance(raw, bytes):
            raise pickle.UnpicklingError("array dtype or data is not a plain byte buffer")
        expected = math.prod(shape) * dtype.dtype.itemsize
        if len(raw) != expected:
            raise pickle.UnpicklingError(
                f"array of shape {shape} needs {expected} bytes, the file holds {len(raw)}"
            )
        flat = np.frombuffer(raw, dtype=dtype.dtype).copy()  # writable, as torch wants
        self.array = flat.reshape(shape, order="F") if fortran else flat.reshape(shape)


def _reconstruct(cls: object, shape: object, typecode: object) -> _PickledArray:
    if cls is not _Refused:
        raise pickle.UnpicklingError("_reconstruct of something other than numpy.ndarray")
    return _PickledArray()  # what it holds comes with its state, from the file's own bytes


def _encode(text: object, encoding: object = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it: str to bytes, byte for byte."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode other than str to latin1 bytes")
    return text.encode("latin1")


class _CifarUnpickler(pickle.Unpickler):
    """Builds only what a CIFAR batch holds: dicts, lists, strings, numbers and plain integer
    arrays made from the file's own bytes.

    A pickle can run arbitrary code; data staged from a storage account is not trusted code.
    The numpy globals a batch names are replaced by stand-ins that check their arguments, so
    a hostile file can neither call code nor make numpy allocate more than the file holds.
    """

    STAND_INS: ClassVar[dict[tuple[str, str], object]] = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): _Refused,
        ("numpy", "dtype"): _PickledDtype,
        ("_codecs", "encode"): _encode,
    }

    def __init__(self, fh: Any) -> None:
        super().__init__(fh, encoding="bytes")

    def find_class(self, module: str, name: str) -> object:
        found = self.STAND_INS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return found


def _unpickle(path: Path, what: str) -> object:
    """The object in ``path``, arrays as numpy arrays; DatasetError naming the file if the
    pickle is not one a CIFAR batch can be."""
    try:
        with open(path, "rb") as fh:
            loaded = _CifarUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise DatasetError(f"{what} {path} is not a valid CIFAR pickle: {exc}") from None
    except RecursionError:
        raise DatasetError(f"{what} {path} is not a valid CIFAR pickle: nested too deep") from None
    if not isinstance(loaded, dict):
        raise DatasetError(f"{what} {path} holds a {type(loaded).__name__}, not a dict")
    return {k: v.array if isinstance(v, _PickledArray) else v for k, v in loaded.items()}


def _field(batch: dict[Any, Any], name: str) -> object:
    return batch.get(name.encode(), batch.get(name))


def _read_cifar_pickle(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = cast(dict[Any, Any], _unpickle(path, "CIFAR batch"))
    data, labels = _field(batch, "data"), _field(batch, "labels")
    if data is None or labels is None:
        raise DatasetError(f"CIFAR batch {path} has no 'data'/'labels' entries")
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8):
        raise DatasetError(f"CIFAR batch {path}: 'data' is not a uint8 array")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] == 0:
        raise DatasetError(f"CIFAR batch {path}: data has shape {data.shape}, want (N, 3072)")
    if isinstance(labels, np.ndarray) and labels.ndim == 1 and labels.dtype.kind in "iu":
        label_array = labels.astype(np.int64)
    elif isinstance(labels, list) and all(type(x) is int for x in labels):
        label_array = np.asarray(labels, dtype=np.int64) if labels else np.zeros(0, np.int64)
    else:
        raise DatasetError(f"CIFAR batch {path}: 'labels' is not a list of integers")
    if len(label_array) != len(data):
        raise DatasetError(f"CIFAR batch {path}: {len(data)} images but {len(label_array)} labels")
    return data.reshape(-1, 3, 32, 32), label_array


def _read_cifar_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise DatasetError(
            f"CIFAR binary batch {path} is {raw.size} bytes, not a multiple of {CIFAR_RECORD}"
        )
    records = raw.reshape(-1, CIFAR_RECORD)
    return records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0].astype(np.int64)


def _cifar_dir(root: Path) -> tuple[Path, str] | None:
    for candidate in (root, root / "cifar-10-batches-py", root / "cifar-10-batches-bin"):
        if (candidate / "data_batch_1").is_file() and (candidate / "test_batch").is_file():
            return candidate, "pickle"
        if (candidate / "data_batch_1.bin").is_file() and (candidate / "test_batch.bin").is_file():
            return candidate, "bin"
    return None


MAX_CLASS_NAMES = 1000  # far more than CIFAR-10's 10 or CIFAR-100's 100
MAX_CLASS_NAME = 100  # characters
MAX_META_BYTES = 1 << 20


def _checked_names(names: object, source: str) -> list[str]:
    """Class names as a real CIFAR meta file holds them, or DatasetError naming the file."""
    if not isinstance(names, list) or not 1 <= len(names) <= MAX_CLASS_NAMES:
        raise DatasetError(f"{source}: label_names is not a list of 1 to {MAX_CLASS_NAMES} names")
    decoded = []
    for n in names:
        try:
            text = n.decode() if isinstance(n, bytes) else n
        except UnicodeDecodeError:
            text = None
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_CLASS_NAME:
            raise DatasetError(f"{source}: class name {n!r} is not a short text")
        decoded.append(text.strip())
    if len(set(decoded)) != len(decoded):
        raise DatasetError(f"{source}: class names repeat")
    return decoded


def _cifar_class_names(directory: Path, fmt: str) -> list[str]:
    text_meta, pickled_meta = directory / "batches.meta.txt", directory / "batches.meta"
    if fmt == "bin" and text_meta.is_file():
        if text_meta.stat().st_size > MAX_META_BYTES:
            raise DatasetError(f"{text_meta} is larger than a class list ({MAX_META_BYTES} bytes)")
        try:
            lines = text_meta.read_text().splitlines()
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{text_meta} is not UTF-8 text: {exc}") from None
        return _checked_names([n for n in lines if n.strip()], str(text_meta))
    if fmt == "pickle" and pickled_meta.is_file():
        if pickled_meta.stat().st_size > MAX_META_BYTES:
            raise DatasetError(f"{pickled_meta} is larger than a class list")
        meta = cast(dict[Any, Any], _unpickle(pickled_meta, "CIFAR meta file"))
        names = _field(meta, "label_names")
        if names is not None:
            return _checked_names(names, str(pickled_meta))
    return list(CIFAR10_CLASSES)


def _load_cifar(directory: Path, fmt: str, size: int) -> DatasetInfo:
    suffix, reader = (".bin", _read_cifar_bin) if fmt == "bin" else ("", _read_cifar_pickle)
    train_files = sorted(directory.glob(f"data_batch_[0-9]{suffix}"))
    parts = [reader(p) for p in train_files]
    train_x = np.concatenate([x for x, _ in parts])
    train_y = np.concatenate([y for _, y in parts])
    test_x, test_y = reader(directory / f"test_batch{suffix}")
    names = _cifar_class_names(directory, fmt)
    for split, labels in (("train", train_y), ("test", test_y)):
        if labels.size and (labels.min() < 0 or labels.max() >= len(names)):
            raise DatasetError(
                f"CIFAR {split} labels in {directory} range over {labels.min()}..{labels.max()}, "
                f"but there are {len(names)} class names"
            )
    splits = {
        "train": SplitData(ArraySplit(train_x, train_y, size)),
        "test": SplitData(ArraySplit(test_x, test_y, size)),
    }
    return DatasetInfo(f"cifar10-{fmt}", names, splits)


# ---------------------------------------------------------------------------- synthetic


class SyntheticSplit(Dataset[tuple[torch.Tensor, int]]):
    """Images drawn on demand from class templates plus noise, reproducible per index.

    Each class has a fixed low-frequency colour pattern; a sample is its template, randomly
    shifted and noised, so a small CNN learns the classes in an epoch or two but cannot
    memorise pixel values.
    """

    def __init__(self, count: int, offset: int, templates: torch.Tensor, seed: int) -> None:
        self.count, self.offset, self.templates, self.seed = count, offset, templates, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
        label = int(torch.randint(len(self.templates), (1,), generator=gen))
        size = self.templates.shape[-1]
        shift = torch.randint(-size // 8, size // 8 + 1, (2,), generator=gen)
        image = torch.roll(
            self.templates[label], shifts=(int(shift[0]), int(shift[1])), dims=(1, 2)
        )
        image = image + 40.0 * torch.randn(image.shape, generator=gen)
        return image.clamp(0, 255).to(torch.uint8), label


def synthetic_templates(classes: int, size: int, seed: int) -> torch.Tensor:
    """One smooth random pattern per class: coarse noise upsampled to the image size."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand((classes, 3, 4, 4), generator=gen) * 255.0
    return torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")


def _load_synthetic(spec: str, size: int, seed: int, classes: int = 10) -> DatasetInfo:
    try:
        total = int(spec.split(":", 1)[1])
    except ValueError as exc:
        raise DatasetError(f"--data-dir {spec!r}: expected synthetic:<number of images>") from exc
    if total < 2 * classes:
        raise DatasetError(f"--data-dir {spec!r}: need at least {2 * classes} images")
    templates = synthetic_templates(classes, size, seed)
    n_test = max(classes, total // 5)
    splits = {
        "train": SplitData(SyntheticSplit(total - n_test, 0, templates, seed)),
        "test": SplitData(SyntheticSplit(n_test, total, templates, seed)),
    }
    return DatasetInfo("synthetic", [f"class_{i}" for i in range(classes)], splits)


# ---------------------------------------------------------------------------- entry point


def _single_process_gather(value: dict[str, str]) -> list[dict[str, str]]:
    return [value]


def open_dataset(
    data_dir: str,
    image_size: int,
    *,
    seed: int = 0,
    verify_images: bool = True,
    rank: int = 0,
    world: int = 1,
    gather: Gather = _single_process_gather,
    use_shards: bool = True,
) -> DatasetInfo:
    """Detect the layout at ``data_dir`` and index it; raise DatasetError on anything unusable.

    Image folders packed by staging (``training.shards``) are read from their shards when the
    shards match the folder's data and ``image_size``; ``notes`` says why when they do not.
    """
    if data_dir.startswith("synthetic:"):
        return _load_synthetic(data_dir, image_size, seed)
    root = Path(data_dir)
    if not root.is_dir():
        raise DatasetError(f"--data-dir {root} does not exist or is not a directory")
    found = _cifar_dir(root)
    if found is not None:
        return _load_cifar(found[0], found[1], image_size)
    if not any((root / s).is_dir() for s in SPLITS):
        raise DatasetError(
            f"--data-dir {root}: no train/ or test/ folders and no CIFAR-10 batches "
            "(data_batch_1 + test_batch, or their .bin versions)"
        )
    note = "packed shards not looked for"
    if use_shards:
        from training.shards import open_shards

        packed = open_shards(root, image_size)
        if isinstance(packed, DatasetInfo):
            return packed
        note = f"reading loose files: {packed}"
    info = _load_image_folders(root, image_size, verify_images, rank, world, gather)
    info.notes.append(note)
    return info


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of a uint8 CHW tensor (1 channel: grayscale); for writing generated datasets."""
    buffer = io.BytesIO()
    array = image.permute(1, 2, 0).numpy()
    Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(buffer, format="PNG")
    return buffer.getvalue()
