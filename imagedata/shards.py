"""Packed shards: an image-folder dataset decoded once, at the model's input size, into a few
memory-mapped uint8 files of 64 MB or more that the trainer and the scorer read directly.

Why: with many small images, every image of every epoch on every rank costs a file open
(milliseconds on NFS or Azure Files) and a PNG/JPEG decode plus resize, the data loader's main
CPU cost. Packing pays that once, during staging, on the node beside the data; an epoch then
reads contiguous rows, and damaged images were found and left out at packing, so the trainer's
start-up verification pass is skipped too. ``bench/staging.py`` measures the difference.

Layout under ``<data>/.shards/``: ``index.json``, the commit point, written last and atomically;
per split, ``<split>-<pack>-NNNNN.u8`` files of raw (N, 3, S, S) rows, ``<split>-<pack>.labels``
(int64) and ``<split>-<pack>.keys.json`` (the content key of every row). A repack copies the
rows of files whose content did not change (keyed by the MD5 the staging manifest recorded), so
a 1% change decodes 1% of the images. The trainer uses shards only when they were packed from
the data version now in the folder, at its input size; otherwise it reads the loose files and
says why. Two packs of one folder at once (two runs staging the same NFS folder) take turns on
a lock file in ``.shards/`` and write under unique temp names, so neither deletes or overwrites
the other's work and the index written last names complete shards.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from PIL import Image
from torch.utils.data import Dataset

from common.atomic import atomic_write, atomic_write_json, read_json_object
from imagedata.dataset import DatasetError, DatasetInfo, SplitData
from imagedata.image_folders import (
    ImageSource,
    decode_checked,
    labelled_samples,
    list_files,
    list_image_folders,
)
from imagedata.staged_folder import (
    INDEX,
    PACK_FORMAT,
    SHARD_DIR,
    PackReport,
    pack_is_current,
    staged_md5s,
    unchanged_pack,
)
from imagedata.webdataset import TarMember

LOCK = ".pack.lock"  # held while a pack runs: two packs of one folder take turns
TARGET_SHARD_BYTES = 64 << 20
DECODE_BATCH = 4096  # images in flight at once: bounds memory on datasets of any size
PROCESS_DECODE_MIN = 1024  # fewer images decode faster in threads than processes start


def _files(listed: dict[str, dict[str, list[ImageSource]]]) -> Iterator[ImageSource]:
    for classes in listed.values():
        for files in classes.values():
            yield from files


def _file_keys(root: Path, files: list[Path]) -> tuple[str, dict[Path, str]]:
    """The folder's data version and a key per file (a loose image or a tar shard) that
    changes when its content does.

    Staged folders use the manifest (no file is touched); any other folder the file's path
    and status: size and modification time, as make does, with the path (two files of one
    size and time, an archive unpacked or a file system's whole-second times, are not one
    content), the change time and the inode (a file replaced by one of the same size with
    its time set back: tars are multiples of 512 bytes, so sizes repeat).
    """
    version, md5s = staged_md5s(root)
    keys: dict[Path, str] = {}
    rels: dict[Path, str] = {}
    for file in files:
        rel = rels[file] = file.relative_to(root).as_posix()
        if rel in md5s:
            keys[file] = f"md5:{md5s[rel]}"
        else:
            st = file.stat()
            keys[file] = f"stat:{rel}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    # The manifest's version stands only if it vouches for every file (it also lists
    # non-image files, so counting its entries would not say that).
    if version is None or any(key.startswith("stat:") for key in keys.values()):
        digest = hashlib.sha256()
        for rel, key in sorted((rels[file], key) for file, key in keys.items()):
            digest.update(f"{rel}\0{key}\n".encode())
        version = f"listing-{digest.hexdigest()[:16]}"
    return version, keys


def _content_keys(
    root: Path, listed: dict[str, dict[str, list[ImageSource]]]
) -> tuple[str, dict[ImageSource, str]]:
    """The data version (:func:`current_version`'s) and a key per image: its file's, and for
    an image inside a tar shard, the shard's key and its name in the shard."""
    version, files = _file_keys(root, list_files(root, list(listed)))
    keys: dict[ImageSource, str] = {
        image: f"{files[image.tar]}:{image.name}" if isinstance(image, TarMember) else files[image]
        for image in _files(listed)
    }
    return version, keys


def current_version(root: Path) -> str:
    """The version of the data now in ``root``, as the shards record it: from its files
    alone, so a tar-sharded dataset's check opens no shard."""
    return _file_keys(root, list_files(root))[0]


def _row_bytes(size: int) -> int:
    return 3 * size * size


class _ShardWriter:
    """Appends rows to numbered shard files, each renamed into place once complete."""

    def __init__(self, directory: Path, stem: str, row_bytes: int) -> None:
        self.directory, self.stem, self.row_bytes = directory, stem, row_bytes
        self.per_shard = max(1, -(-TARGET_SHARD_BYTES // row_bytes))
        self.shards: list[dict[str, Any]] = []
        self._fh: Any = None
        self._tmp: Path | None = None
        self._rows = 0

    def write(self, row: bytes) -> None:
        if self._fh is None:
            # Unique: a second pack of the same folder (another run, another node on NFS) never
            # writes into this one's file.
            self._tmp = (
                self.directory / f".{self.stem}-{len(self.shards):05d}.{uuid.uuid4().hex}.tmp"
            )
            self._fh = open(self._tmp, "wb")  # noqa: SIM115  # closed in _finish
            self._rows = 0
        self._fh.write(row)
        self._rows += 1
        if self._rows == self.per_shard:
            self._finish()

    def _finish(self) -> None:
        if self._fh is None or self._tmp is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        name = f"{self.stem}-{len(self.shards):05d}.u8"
        os.replace(self._tmp, self.directory / name)
        self.shards.append({"file": name, "count": self._rows})
        self._fh = None

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.shards

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)


class _OldRows:
    """Rows of the previous pack, found by content key, so unchanged images are not decoded."""

    def __init__(self, directory: Path, index: dict[str, Any] | None, size: int) -> None:
        self.where: dict[str, tuple[Path, int]] = {}
        if not index or index.get("format") != PACK_FORMAT or index.get("image_size") != size:
            return
        for split in index.get("splits", {}).values():
            keys = read_json_object(directory / split.get("keys", ""))
            if not keys or len(keys.get("keys", [])) != split.get("count"):
                continue
            rows = iter(keys["keys"])
            for shard in split["shards"]:
                for row in range(shard["count"]):
                    self.where[next(rows)] = (directory / shard["file"], row)
        self.row_bytes = _row_bytes(size)
        self._maps: dict[Path, np.memmap] = {}

    def get(self, key: str) -> bytes | None:
        found = self.where.get(key)
        if found is None:
            return None
        path, row = found
        try:
            if path not in self._maps:
                self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
            data = self._maps[path][row * self.row_bytes : (row + 1) * self.row_bytes]
        except (OSError, ValueError):
            return None  # an old shard gone or short: decode the image instead
        return data.tobytes() if len(data) == self.row_bytes else None


def _decode_row(path: ImageSource, size: int) -> bytes | str:
    """One image as its shard row, or why it is unusable (runs in a decoding process)."""
    verdict = decode_checked(path, size)
    if isinstance(verdict, torch.Tensor):
        return verdict.numpy().tobytes()
    return verdict or "not decoded"


def _one_thread() -> None:
    torch.set_num_threads(1)  # one decoder per core: torch's own threads would oversubscribe


def _decoder(images: int, workers: int | None) -> Executor:
    """Processes for a large decode (threads contend for the GIL: 16 threads decoded 1,300
    images/s on a 16-core machine), threads when starting processes would cost more. Forked,
    like PyTorch's DataLoader workers: a spawned process spends seconds importing torch."""
    cores = workers or os.cpu_count() or 1
    if images >= PROCESS_DECODE_MIN and cores > 2:
        Image.init()  # every format plugin loaded before the fork: no import in the children
        return ProcessPoolExecutor(
            max_workers=cores, mp_context=mp.get_context("fork"), initializer=_one_thread
        )
    return ThreadPoolExecutor(max_workers=cores)


def pack_shards(root: Path, image_size: int, workers: int | None = None) -> PackReport:
    """Pack the image folders under ``root`` for ``image_size``; see the module docstring.

    A folder that is not an image-folder dataset, or one the trainer would refuse, is left
    unpacked (the report says why) so that the trainer's own error reaches the user.
    """
    started = time.perf_counter()
    if not (root / "train").is_dir():
        return PackReport("not packed", reason="no train/ folder (not an image-folder dataset)")
    try:
        version = current_version(root)  # the cheap check first: most stagings change nothing
    except DatasetError as exc:
        return PackReport("not packed", reason=str(exc))
    directory = root / SHARD_DIR
    index = read_json_object(directory / INDEX)
    if index is not None and pack_is_current(index, version, image_size):
        return unchanged_pack(index)
    directory.mkdir(parents=True, exist_ok=True)
    with _pack_lock(directory) as locked:
        return _pack(root, image_size, workers, locked, started)


@contextlib.contextmanager
def _pack_lock(directory: Path) -> Iterator[bool]:
    """An exclusive lock on the shard folder for one pack; yields whether it is held.

    Two packs at once (two runs staging one NFS folder) would each delete the other's files
    as leftovers; with the lock the second waits, then finds the first one's pack current. A
    filesystem without locks (ENOLCK: an NFS mount without its lock daemon) packs unlocked, and
    then leaves temp files alone.
    """
    lock = FileLock(directory / LOCK)
    try:
        lock.acquire()
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _pack(
    root: Path, image_size: int, workers: int | None, locked: bool, started: float
) -> PackReport:
    """The pack itself, under the lock: the folder is listed again, as it may have changed
    (or been packed by the pack this one waited for) meanwhile."""
    try:
        class_names, listed = list_image_folders(root)
    except DatasetError as exc:
        return PackReport("not packed", reason=str(exc))
    version, keys = _content_keys(root, listed)
    directory = root / SHARD_DIR
    index = read_json_object(directory / INDEX)
    if index is not None and pack_is_current(index, version, image_size):
        return unchanged_pack(index)
    pack = hashlib.sha256(f"{version}/{image_size}/{PACK_FORMAT}".encode()).hexdigest()[:12]
    packer = _SplitPacker(directory, image_size, keys, _OldRows(directory, index, image_size))
    labels_of = {name: i for i, name in enumerate(class_names)}
    splits: dict[str, dict[str, Any]] = {}
    to_decode = sum(1 for key in keys.values() if key not in packer.old.where)
    with _decoder(to_decode, workers) as pool:
        for split, classes in listed.items():
            items = [(p, labels_of[c]) for c, files in classes.items() for p in files]
            splits[split] = packer.pack(pool, f"{split}-{pack}", items, workers)
    try:
        checked = labelled_samples(class_names, listed, packer.bad)
    except DatasetError as exc:
        _remove_unreferenced(directory, index, locked)
        return PackReport("not packed", reason=str(exc))
    for split, (_, skipped) in checked.items():
        splits[split]["skipped"] = [s.replace(str(root) + os.sep, "", 1) for s in skipped]
    new_index = {
        "format": PACK_FORMAT,
        "pack": pack,
        "version": version,
        "image_size": image_size,
        "class_names": class_names,
        "splits": splits,
    }
    atomic_write_json(new_index, directory / INDEX)
    _remove_unreferenced(directory, new_index, locked)
    images = sum(s["count"] for s in splits.values())
    return PackReport(
        "packed",
        images=images,
        decoded=images - packer.reused,
        reused=packer.reused,
        skipped=len(packer.bad),
        shards=sum(len(s["shards"]) for s in splits.values()),
        bytes=images * _row_bytes(image_size),
        seconds=round(time.perf_counter() - started, 3),
    )


class _SplitPacker:
    """Writes one split's shards, labels and row keys, reusing the old pack's rows of images
    whose content did not change and decoding the rest; collects the damaged images."""

    def __init__(
        self, directory: Path, size: int, keys: dict[ImageSource, str], old: _OldRows
    ) -> None:
        self.directory, self.size, self.keys, self.old = directory, size, keys, old
        self.bad: dict[str, str] = {}
        self.reused = 0

    def pack(
        self, pool: Executor, stem: str, items: list[tuple[ImageSource, int]], workers: int | None
    ) -> dict[str, Any]:
        """The split's entry in the index, once its files are written."""
        writer = _ShardWriter(self.directory, stem, _row_bytes(self.size))
        labels: list[int] = []
        row_keys: list[str] = []
        try:
            for start in range(0, len(items), DECODE_BATCH):
                batch = items[start : start + DECODE_BATCH]
                for (path, label), row in zip(batch, self._rows(pool, batch, workers), strict=True):
                    if isinstance(row, str):
                        self.bad[str(path)] = row
                        continue
                    writer.write(row)
                    labels.append(label)
                    row_keys.append(self.keys[path])
            shards = writer.close()
        except BaseException:
            writer.abort()
            raise
        atomic_write(
            self.directory / f"{stem}.labels",
            lambda fh: fh.write(np.asarray(labels, dtype=np.int64).tobytes()),
        )
        atomic_write_json({"keys": row_keys}, self.directory / f"{stem}.keys.json")
        return {
            "count": len(labels),
            "shards": shards,
            "labels": f"{stem}.labels",
            "keys": f"{stem}.keys.json",
        }

    def _rows(
        self, pool: Executor, batch: list[tuple[ImageSource, int]], workers: int | None
    ) -> list[bytes | str]:
        """Each image's row (the old pack's, or freshly decoded), or why it is unusable."""
        rows: list[bytes | str | None] = [self.old.get(self.keys[p]) for p, _ in batch]
        missing = [i for i, row in enumerate(rows) if row is None]
        decoded = pool.map(
            _decode_row,
            [batch[i][0] for i in missing],
            [self.size] * len(missing),
            chunksize=max(1, len(missing) // (4 * (workers or os.cpu_count() or 1))),
        )
        for i, fresh in zip(missing, decoded, strict=True):
            rows[i] = fresh
        self.reused += len(batch) - len(missing)
        return [row for row in rows if row is not None]


def _referenced(index: dict[str, Any] | None) -> set[str]:
    names = {INDEX, LOCK}
    for split in (index or {}).get("splits", {}).values():
        names.update(s["file"] for s in split.get("shards", []))
        names.update(n for n in (split.get("labels"), split.get("keys")) if n)
    return names


def _remove_unreferenced(
    directory: Path, index: dict[str, Any] | None, locked: bool = True
) -> None:
    """Old packs and the leftovers of an interrupted one; what the index names stays. Temp
    files go only under the lock: unlocked, they may be another pack's work in progress."""
    keep = _referenced(index)
    for path in directory.iterdir():
        if path.name in keep or not path.is_file():
            continue
        if locked or not path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)


def remove_shards(root: Path) -> None:
    """Drop the packed copy (packing switched off): the trainer then reads the loose files."""
    directory = root / SHARD_DIR
    if directory.is_dir():
        with _pack_lock(directory) as locked:
            (directory / INDEX).unlink(missing_ok=True)
            _remove_unreferenced(directory, None, locked)
        (directory / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: a pack's temp files, left to it
            directory.rmdir()


class ShardSplit(Dataset[tuple[torch.Tensor, int]]):
    """Rows of one split across its shard files, mapped lazily (after DataLoader workers fork)."""

    def __init__(self, shards: list[tuple[Path, int]], labels: np.ndarray, size: int) -> None:
        self.paths = [p for p, _ in shards]
        self.ends = list(np.cumsum([n for _, n in shards]))
        self.labels, self.size = labels, size
        self.row_bytes = _row_bytes(size)
        self._maps: list[np.ndarray | None] = [None] * len(shards)

    def __len__(self) -> int:
        return len(self.labels)

    def _map(self, i: int) -> np.ndarray:
        mapped = self._maps[i]
        if mapped is None:
            mapped = np.memmap(self.paths[i], dtype=np.uint8, mode="r").reshape(
                -1, 3, self.size, self.size
            )
            self._maps[i] = mapped
        return mapped

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        shard = bisect.bisect_right(self.ends, index)
        row = index - (self.ends[shard - 1] if shard else 0)
        return torch.from_numpy(np.array(self._map(shard)[row])), int(self.labels[index])

    def gather(
        self, indices: Sequence[int], out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``indices`` as one uint8 (N, 3, S, S) batch, and their labels: each row copied
        once, from the mapped file straight into ``out`` (a pinned buffer, on a GPU machine),
        where the per-image path copies it again to collate the batch and once more to pin it.
        """
        index = np.asarray(indices, dtype=np.int64)
        if out is None:
            out = torch.empty((len(index), 3, self.size, self.size), dtype=torch.uint8)
        rows = out.numpy()
        shards = np.searchsorted(self.ends, index, side="right")
        starts = np.concatenate([[0], self.ends])[shards]
        pairs = zip(shards.tolist(), (index - starts).tolist(), strict=True)
        for i, (shard, row) in enumerate(pairs):
            rows[i] = self._map(shard)[row]
        return out, torch.from_numpy(self.labels[index])


def open_shards(root: Path, image_size: int) -> DatasetInfo | str:
    """The packed dataset, or a sentence saying why the loose files must be read instead."""
    directory = root / SHARD_DIR
    index = read_json_object(directory / INDEX)
    if index is None:
        return "no packed shards"
    if index.get("format") != PACK_FORMAT:
        return f"shards are format {index.get('format')}, this trainer reads {PACK_FORMAT}"
    if index.get("image_size") != image_size:
        return f"shards were packed at {index.get('image_size')} px; the model reads {image_size}"
    try:
        version = current_version(root)
    except DatasetError as exc:  # e.g. a split packed then removed: the scorer needs only one
        return f"the folder no longer holds what was packed ({exc})"
    if index.get("version") != version:
        return f"shards hold data version {index.get('version')}; the folder holds {version}"
    splits: dict[str, SplitData] = {}
    row = _row_bytes(image_size)
    for name, split in index["splits"].items():
        shards = [(directory / s["file"], int(s["count"])) for s in split["shards"]]
        for path, count in shards:
            actual = path.stat().st_size if path.is_file() else -1
            if actual != count * row:
                return f"shard {path.name} is {actual} bytes, expected {count * row}"
        labels = np.fromfile(directory / split["labels"], dtype=np.int64)
        if len(labels) != split["count"]:
            return f"{split['labels']} holds {len(labels)} labels, expected {split['count']}"
        skipped = [f"{root / s}" for s in split.get("skipped", [])]
        splits[name] = SplitData(ShardSplit(shards, labels, image_size), skipped)
    return DatasetInfo("image-folders (packed shards)", list(index["class_names"]), splits)
