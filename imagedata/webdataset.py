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

import contextlib
import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, Self, cast

from imagedata.class_names import folders_problem, name_problem, normal
from imagedata.images import IMAGE_SUFFIXES, SPLITS, is_image_name, suffix

TAR_SUFFIX = ".tar"
LABEL_FIELD = "cls"
# A class as text, in a .cls member: longer is not a class but another file under that name.
MAX_LABEL_BYTES = 256


class ShardError(ValueError):
    """A tar shard that cannot be read as samples; the message names the shard and the key."""


class UnsafeHeaderError(ShardError):
    """A member header the reader must not follow; names the member (the caller, the shard)."""


# The extended-header records that replace a member's size, and with it where tarfile reads
# the next header.
_SIZE_RECORDS = ("size", "GNU.sparse.size", "GNU.sparse.realsize")
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _pax_records(data: bytes) -> dict[str, bytes]:
    """An extended header's records (``<length> <key>=<value>\\n``), split as tarfile does."""
    found: dict[str, bytes] = {}
    pos = 0
    while (match := _PAX_RECORD.match(data, pos)) and int(match[1]) > 0:
        length = int(match[1])
        found[match[2].decode("utf-8", "replace")] = data[match.end() : match.start(1) + length - 1]
        pos += length
    return found


def _blocks(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _number(value: bytes | None) -> int | None:
    """A record's value as tarfile reads it (not a number: tarfile reads 0)."""
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _header_problem(handle: IO[bytes], start: int, encoding: str, errors: str) -> str | None:
    """Why the header at ``start`` must not be followed, or None (see :func:`_check_header`)."""
    header = handle.read(tarfile.BLOCKSIZE)
    if header[156:157] not in _PAX_TYPES and not header[124:125] >= b"\x80":
        # The common header: a size in octal digits cannot be below zero, nor send a seek past
        # what a file can hold (tarfile names a short shard itself).
        return None
    total = handle.seek(0, io.SEEK_END)
    try:
        info = tarfile.TarInfo.frombuf(header, encoding, errors)
    except (tarfile.HeaderError, UnicodeDecodeError):
        return None  # the end of the archive, or a header tarfile refuses itself
    name, size, what = info.name, info.size, "its header"
    data = start + tarfile.BLOCKSIZE  # where the member's bytes start
    if info.type in _PAX_TYPES and 0 <= info.size <= total - data:
        handle.seek(data)
        records = _pax_records(handle.read(info.size))
        data += _blocks(info.size) + tarfile.BLOCKSIZE  # past the described member's header
        handle.seek(data - tarfile.BLOCKSIZE)
        with contextlib.suppress(tarfile.HeaderError):
            name = tarfile.TarInfo.frombuf(handle.read(tarfile.BLOCKSIZE), "utf-8", "replace").name
        name = records["path"].decode("utf-8", "replace") if "path" in records else name
        for key in _SIZE_RECORDS:
            value = _number(records.get(key))
            if value is not None and value < 0:
                size, what = value, f"its extended header's {key}"
                break
        else:
            value = _number(records.get("size"))
            if value is None:
                return None  # the described header's own size counts: checked when read
            size, what = value, "its extended header's size"
    if size < 0:
        return (
            f"member {name!r}: {what} says {size} bytes: a size below zero would send the "
            "reader back to a header it has read (refused, as GNU tar refuses it)"
        )
    if what != "its extended header's GNU.sparse.realsize" and data + size > total:
        return (
            f"cut short, or a false size: member {name!r}: {what} says {size} bytes, past the "
            f"end of the shard ({total} bytes)"
        )
    return None


def _check_header(tar: tarfile.TarFile) -> None:
    """Refuse the header at the reader's position when its size is negative or its data runs
    past the end of the shard, itself or through an extended (pax) header's size record.

    Why: tarfile takes the next header to be a member's size past its data. A negative size
    (``size=-1536``) sends it back to a header it has read, forever (CPython's CVE-2025-8194:
    a 3.5 KB shard held the gate, its memory growing, and the pool's locks); a false huge one
    (``size=1000000000000000000``) ends in an OSError from a seek. Checked on the header's
    bytes before tarfile acts on them, whatever the interpreter's own fix.
    """
    if tar.fileobj is None:
        return
    handle = cast(IO[bytes], tar.fileobj)  # the readers open files, spools and buffers: seekable
    start = handle.tell()
    try:
        problem = _header_problem(handle, start, tar.encoding or "utf-8", tar.errors)
    finally:
        handle.seek(start)
    if problem:
        raise UnsafeHeaderError(problem)


class _CheckedInfo(tarfile.TarInfo):
    """TarInfo as the readers build it: each header checked (:func:`_check_header`) first."""

    @classmethod
    def fromtarfile(cls, archive: tarfile.TarFile) -> Self:
        _check_header(archive)
        return super().fromtarfile(archive)


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

    Whatever would have a reader guess is an error naming the member: an image and no class, a
    class and no image, two of either, a class that is not short text, an image stored as a
    link or sparsely (its bytes are not at its offset), a name with dots before the image's
    extension (WebDataset would make it another field, not the image). A guessed label trains
    on a wrong one; a skipped sample goes missing without a word.
    """
    images: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, tarfile.TarInfo] = {}
    order: dict[str, None] = {}  # the keys in the shard's order (a dict: a list's `in` is O(n))
    for member in tar.getmembers():
        if member.isdir():
            continue
        key, field = _field(member.name)
        last = field.rpartition(".")[2]
        if last != LABEL_FIELD and f".{last}" not in IMAGE_SUFFIXES:
            continue  # another field (.json, .txt): not read
        if "." in field:
            raise ShardError(
                f"{where}: member {member.name!r} is field {field!r} of sample {key!r} (the key "
                "ends at the first dot of the file name): name it without dots before the "
                "extension"
            )
        if member.islnk() or member.issym():
            raise ShardError(
                f"{where}: member {member.name!r} is a link, not the bytes (pack with "
                "`tar --hard-dereference`, or `python -m imagedata.webdataset`)"
            )
        if member.issparse() or not member.isfile():
            raise ShardError(f"{where}: member {member.name!r} is not stored as a plain file")
        found = labels if field == LABEL_FIELD else images
        if key in found:
            what = "classes" if field == LABEL_FIELD else "images"
            raise ShardError(f"{where}: sample {key!r} has two {what}")
        found[key] = member
        order[key] = None
    _check_complete(tar, where)
    result = []
    for key in order:
        image, label = images.get(key), labels.get(key)
        if image is None:
            raise ShardError(f"{where}: sample {key!r} has a .cls member and no .png/.jpg image")
        if label is None:
            raise ShardError(f"{where}: sample {key!r} ({image.name}) has no .cls member")
        result.append(Sample(key, image, _label(tar, label, f"{where}: sample {key!r}")))
    return result


def _check_complete(tar: tarfile.TarFile, where: str) -> None:
    """A tar ends with zero blocks after its last member, and nothing else follows. Reading
    its headers stops, without a word, where a cut-short upload ends, and at the end of the
    first of two tars written one after the other: the samples past either would be missed."""
    handle = tar.fileobj
    if handle is None:
        return
    handle.seek(tar.offset)
    end = handle.read(2 * tarfile.BLOCKSIZE)
    if len(end) < 2 * tarfile.BLOCKSIZE or end.strip(b"\0"):
        raise ShardError(f"{where}: cut short (no end-of-archive blocks after its last member)")
    while chunk := handle.read(2**20):
        if chunk.strip(b"\0"):
            raise ShardError(
                f"{where}: data after its end-of-archive blocks (tars written one after the "
                "other?): the samples there would be missed"
            )


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> str:
    """The class a .cls member holds: its text, less one line ending (a text file's, as
    ``echo cat > a.cls`` writes it), in NFC (``imagedata.class_names``). Compared as text:
    ``7`` and ``007`` are two classes, and numbers sort as text (the model keeps the names,
    not the order). Never stripped further: ``cat `` is refused, not read as ``cat``."""
    if member.size > MAX_LABEL_BYTES:
        raise ShardError(f"{where}: its .cls member is {member.size} bytes, not a class")
    handle = tar.extractfile(member)
    raw = handle.read() if handle else b""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ShardError(f"{where}: its .cls member is not UTF-8 text") from exc
    text = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
    why = name_problem(text)
    if why or text in (".", "..") or "/" in text:
        reason = f" (the class name {why})" if why else ""
        raise ShardError(f"{where}: its .cls member holds {text!r}, not a class name{reason}")
    return normal(text)


def open_shard(path: Path | None, fileobj: IO[bytes] | None = None) -> tarfile.TarFile:
    """A shard (the file at ``path``, or ``fileobj``) as an uncompressed tar whose names are
    UTF-8, or ShardError naming it."""
    try:
        return tarfile.open(
            path,
            mode="r:",
            fileobj=fileobj,
            encoding="utf-8",
            errors="strict",
            tarinfo=_CheckedInfo,
        )
    except UnsafeHeaderError as exc:
        raise ShardError(f"{path or 'the shard'}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ShardError(f"{path or 'the shard'}: a member name is not UTF-8 ({exc})") from exc
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ShardError(f"{path or 'the shard'}: not an uncompressed tar ({exc})") from exc


def read_samples(tar: tarfile.TarFile, where: str) -> list[Sample]:
    """:func:`samples`, with a damaged tar or a member name that is not UTF-8 a ShardError."""
    try:
        return samples(tar, where)
    except UnsafeHeaderError as exc:
        raise ShardError(f"{where}: {exc}") from exc
    except (tarfile.TarError, EOFError) as exc:
        raise ShardError(f"{where}: damaged tar ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ShardError(f"{where}: a member name is not UTF-8 ({exc})") from exc


def shard_members(path: Path) -> dict[str, list[TarMember]]:
    """The images of the shard at ``path`` per class (headers read, images not)."""
    with open_shard(path) as tar:
        found = read_samples(tar, str(path))
    classes: dict[str, list[TarMember]] = {}
    for sample in found:
        member = TarMember(path, sample.image.name, sample.image.offset_data, sample.image.size)
        classes.setdefault(sample.label, []).append(member)
    return classes


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A member as every shard stores it: no owner, no time. Packing the same images again
    gives the same bytes, so the gate's cache and staging see unchanged shards."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o644
    return info


def pack_folders(source: Path, dest: Path, max_bytes: int = 256 * 2**20) -> dict[str, int]:
    """Write the image folders under ``source`` (``<split>/<class>/<image>``, the splits the
    trainer reads) as WebDataset shards under ``dest`` (``<split>/NNNNNN.tar``, a new shard
    once one holds ``max_bytes``); the shards written per split. What a producer runs before
    uploading a large dataset. Refuses, before writing, what the trainer would refuse."""
    if not (source / "train").is_dir():
        raise ValueError(f"{source} has no train/ folder (expected <split>/<class>/<image>)")
    planned: dict[str, list[tuple[Path, str]]] = {}
    for split in SPLITS:
        if not (source / split).is_dir():
            continue
        planned[split] = []
        folders = sorted(p for p in (source / split).iterdir() if p.is_dir())
        problem = folders_problem(p.name for p in folders)
        if problem:
            raise ValueError(f"{source / split}: {problem}")
        for folder in folders:
            found = sorted(f for f in folder.iterdir() if f.is_file() and is_image_name(f))
            if not found:
                raise ValueError(f"empty class folder: {folder} has no .png/.jpg/.jpeg images")
            planned[split] += [(f, normal(folder.name)) for f in found]
    written: dict[str, int] = {}
    for split, files in planned.items():
        groups: list[list[tuple[Path, str]]] = []
        size = max_bytes
        for item in files:
            if size >= max_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += item[0].stat().st_size + 1536  # the image, its header and its .cls member
        out = dest / split
        out.mkdir(parents=True, exist_ok=True)
        key = 0
        for count, group in enumerate(groups):
            with tarfile.open(out / f"{count:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for path, label in group:
                    tar.add(path, arcname=f"{key:09d}{path.suffix.lower()}", filter=_plain)
                    text = label.encode()
                    info = _plain(tarfile.TarInfo(f"{key:09d}.{LABEL_FIELD}"))
                    info.size = len(text)
                    tar.addfile(info, io.BytesIO(text))
                    key += 1
        written[split] = len(groups)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m imagedata.webdataset",
        description="Pack image folders (<split>/<class>/<image>) into WebDataset tar shards "
        "(<split>/NNNNNN.tar with <key>.png|jpg and <key>.cls) to upload as a data version.",
    )
    parser.add_argument("source", type=Path, help="the folder holding train/, test/ (and val/)")
    parser.add_argument("dest", type=Path, help="where the shards go (a new folder)")
    parser.add_argument("--shard-mb", type=int, default=256, help="start a new shard past this")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        parser.error(f"{args.source} is not a folder")
    if args.dest.exists() and (not args.dest.is_dir() or any(args.dest.iterdir())):
        parser.error(f"{args.dest} exists and is not an empty folder: shards go into a new one")
    try:
        written = pack_folders(args.source, args.dest, args.shard_mb * 2**20)
    except ValueError as exc:
        parser.error(str(exc))
    for split, count in written.items():
        print(f"{split}: {count} shard(s) in {args.dest / split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
