"""CIFAR-10 batches: python pickles read by an unpickler that refuses code, or binary records.

A pickle can run arbitrary code, and data staged from a storage account is not trusted code:
the unpickler below builds only what a CIFAR batch holds, integer arrays made from the file's
own bytes. The binary version (1 label byte + 3072 pixel bytes per record) needs no pickle.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from imagedata.dataset import DatasetError, DatasetInfo, SplitData, to_model_input

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


def _array_to_input(chw: np.ndarray, size: int) -> torch.Tensor:
    """CIFAR arrays are 32x32 CHW; resize only when the model wants another size."""
    if chw.shape[1] == size and chw.shape[2] == size:
        return torch.from_numpy(np.ascontiguousarray(chw))
    return to_model_input(Image.fromarray(np.transpose(chw, (1, 2, 0))), size)


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


def find_cifar(root: Path) -> tuple[Path, str] | None:
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


def load_cifar(directory: Path, fmt: str, size: int) -> DatasetInfo:
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
