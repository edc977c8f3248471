"""Packed data as producers upload it: a split as WebDataset tar shards.

``<split>/NNNNNN.tar``, each member a field of a sample: ``<key>.png|jpg|jpeg`` (the image) and
``<key>.cls`` (its class, as text: a name or a number), the key being the member's path up to
the first dot of its file name, as WebDataset groups them. Other fields (``.json``, ``.txt``) are
allowed and ignored.

Why: a dataset of millions of small images costs staging and the gate a request per image. As
a few hundred tar files of some hundred MB it moves at large-file speed, and nothing unpacks
it: the readers (the gate, the shard packer, the trainer's loose reader, the scorer) read each
image's bytes at its offset inside the tar. Only uncompressed tars: an image member must be
readable at an offset (a gzipped tar would have to be inflated from its start for every read).

Torch-free: the data gate imports it in the orchestrator.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO

from training.images import is_image_name, suffix

TAR_SUFFIX = ".tar"
LABEL_FIELD = "cls"
# A class as text, in a .cls member: longer is not a class but another file under that name.
MAX_LABEL_BYTES = 256


class ShardError(ValueError):
    """A tar shard that cannot be read as samples; the message names the shard and the key."""


def is_tar_name(name: str | PurePath) -> bool:
    return suffix(name) == TAR_SUFFIX


@dataclass(frozen=True)
class TarMember:
    """One image inside a tar shard on disk: read at its offset, never extracted."""

    tar: Path
    name: str
    offset: int
    size: int

    def __str__(self) -> str:  # how reports and skip lists name it
        return f"{self.tar}/{self.name}"

    def read(self) -> bytes:
        with open(self.tar, "rb") as fh:
            data = os.pread(fh.fileno(), self.size, self.offset)
        if len(data) != self.size:
            raise OSError(f"{self}: {len(data)} of {self.size} bytes (the tar is cut short)")
        return data

    def open(self) -> IO[bytes]:
        return io.BytesIO(self.read())


@dataclass(frozen=True)
class Sample:
    """A sample of a shard: its key, its image member and its class."""

    key: str
    image: tarfile.TarInfo
    label: str


def _field(name: str) -> tuple[str, str]:
    """The sample key and the field (extension, lower case) of a member's name."""
    folder, _, base = name.rpartition("/")
    stem, _, field = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), field.lower()


def samples(tar: tarfile.TarFile, where: str) -> list[Sample]:
    """Every sample of an opened shard (``where``: how errors name it), in the shard's order.

    A sample with an image and no class, or a class and no image, two images, or a class that
    is not short text, is an error naming the key: a guessed label would train on a wrong one.
    """
    images: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, tarfile.TarInfo] = {}
    order: list[str] = []
    for member in tar.getmembers():
        if not member.isfile():
            continue
        key, field = _field(member.name)
        if field == LABEL_FIELD:
            labels[key] = member
        elif is_image_name(member.name) and "." not in field:
            if key in images:
                raise ShardError(f"{where}: sample {key!r} has two images")
            images[key] = member
        else:
            continue
        if key not in order:
            order.append(key)
    _check_complete(tar, where)
    found = []
    for key in order:
        image, label = images.get(key), labels.get(key)
        if image is None:
            raise ShardError(f"{where}: sample {key!r} has a .cls member and no .png/.jpg image")
        if label is None:
            raise ShardError(f"{where}: sample {key!r} ({image.name}) has no .cls member")
        found.append(Sample(key, image, _label(tar, label, f"{where}: sample {key!r}")))
    return found


def _check_complete(tar: tarfile.TarFile, where: str) -> None:
    """A tar ends with two zero blocks after its last member. Reading its headers stops,
    without a word, where a cut-short upload ends: the samples after the cut would be missed
    and the one it cuts through read short."""
    handle = tar.fileobj
    if handle is None:
        return
    handle.seek(tar.offset)
    end = handle.read(2 * tarfile.BLOCKSIZE)
    if len(end) < 2 * tarfile.BLOCKSIZE or end.strip(b"\0"):
        raise ShardError(f"{where}: cut short (no end-of-archive blocks after its last member)")


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> str:
    if member.size > MAX_LABEL_BYTES:
        raise ShardError(f"{where}: its .cls member is {member.size} bytes, not a class")
    handle = tar.extractfile(member)
    raw = handle.read() if handle else b""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ShardError(f"{where}: its .cls member is not UTF-8 text") from exc
    if not text or "/" in text or "\n" in text or text in (".", ".."):
        raise ShardError(f"{where}: its .cls member holds {text!r}, not a class name")
    return text


def open_shard(path: Path) -> tarfile.TarFile:
    """``path`` as an uncompressed tar, or ShardError naming it."""
    try:
        return tarfile.open(path, mode="r:")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ShardError(f"{path}: not an uncompressed tar ({exc})") from exc


def shard_members(path: Path) -> dict[str, list[TarMember]]:
    """The images of the shard at ``path`` per class (headers read, images not)."""
    with open_shard(path) as tar:
        try:
            found = samples(tar, str(path))
        except tarfile.TarError as exc:
            raise ShardError(f"{path}: damaged tar ({exc})") from exc
    classes: dict[str, list[TarMember]] = {}
    for sample in found:
        member = TarMember(path, sample.image.name, sample.image.offset_data, sample.image.size)
        classes.setdefault(sample.label, []).append(member)
    return classes


def pack_folders(
    source: Path, dest: Path, max_bytes: int = 256 * 2**20, splits: Iterable[str] = ()
) -> dict[str, int]:
    """Write the image folders under ``source`` (``<split>/<class>/<image>``) as WebDataset
    shards under ``dest`` (``<split>/NNNNNN.tar``, a new shard once one holds ``max_bytes``);
    the shards written per split. What a producer runs before uploading a large dataset."""
    written: dict[str, int] = {}
    for split_dir in sorted(p for p in source.iterdir() if p.is_dir()):
        if splits and split_dir.name not in splits:
            continue
        out = dest / split_dir.name
        out.mkdir(parents=True, exist_ok=True)
        files = [
            (f, c.name)
            for c in sorted(p for p in split_dir.iterdir() if p.is_dir())
            for f in sorted(c.iterdir())
            if f.is_file() and is_image_name(f)
        ]
        groups: list[list[tuple[Path, str]]] = []
        size = max_bytes
        for item in files:
            if size >= max_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += item[0].stat().st_size + 1536  # the image, its header and its .cls member
        key = 0
        for count, group in enumerate(groups):
            with tarfile.open(out / f"{count:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for path, label in group:
                    tar.add(path, arcname=f"{key:09d}{path.suffix.lower()}")
                    text = label.encode()
                    info = tarfile.TarInfo(f"{key:09d}.{LABEL_FIELD}")
                    info.size = len(text)
                    tar.addfile(info, io.BytesIO(text))
                    key += 1
        written[split_dir.name] = len(groups)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m training.webdataset",
        description="Pack image folders (<split>/<class>/<image>) into WebDataset tar shards "
        "(<split>/NNNNNN.tar with <key>.png|jpg and <key>.cls) to upload as a data version.",
    )
    parser.add_argument("source", type=Path, help="the folder holding train/, test/ (and val/)")
    parser.add_argument("dest", type=Path, help="where the shards go (a new folder)")
    parser.add_argument("--shard-mb", type=int, default=256, help="start a new shard past this")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        parser.error(f"{args.source} is not a folder")
    if args.dest.exists() and any(args.dest.iterdir()):
        parser.error(f"{args.dest} is not empty: shards are written into a new folder")
    for split, count in pack_folders(args.source, args.dest, args.shard_mb * 2**20).items():
        print(f"{split}: {count} shard(s) in {args.dest / split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
