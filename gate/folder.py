"""The data gate's checks on a folder on this machine, before it is uploaded as a data version
(``python -m cli.data upload``): a folder the gate would refuse fails here, naming its files,
before a byte is sent.

The same rules, not a copy of them: the manifest's rows are built by the gate's own functions
(``gate.manifest``: a file's split and class from its path, a tar shard's samples as the trainer
reads them, class folders beside shards, the same content in train and test) and judged by the
gate's own suites (``gate.suites``), so layout, splits, classes, counts per class, file kinds
by name and empty files are decided exactly as at the run.

The gate's cheap checks of each image run here too, with its own limits, so a version it would
refuse is never marked complete (nothing a run reads can fix a complete version): a file over
``imagedata.images.MAX_IMAGE_BYTES`` is unreadable by its size, unread; every other image's
header is read by ``imagedata.images.open_image``, which gives its width, height and bands
without decoding a pixel and refuses one over ``MAX_PIXELS`` or not PNG or JPEG by content, as
the gate's decode would. The header's width and height are the stored ones, before an EXIF
turn that may swap them: the same verdict, since the gate bounds both sides alike. Whether
every pixel decodes is left empty here (the suites do not count it against a row): the gate
decides it when the run reads the uploaded version.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from backends.version_upload import LocalFile
from common.atomic import b64md5
from core.config import ValidationConfig
from gate.manifest import (
    _UNREAD,
    _flag_class_names,
    _flag_leaks,
    _flag_mixed_splits,
    _path_fields,
    _shard_rows,
    shard_samples,
)
from gate.report import examples
from gate.suites import run_expectations
from imagedata.images import MAX_IMAGE_BYTES, ImageTooLarge, is_image_name, open_image
from imagedata.webdataset import is_tar_name

# Decided only by decoding, at the run's gate: left empty (unknown) here.
_UNDECODED = {"width": None, "height": None, "channels": None, "readable": None}


def _header(source: Path | IO[bytes]) -> dict[str, Any]:
    """What an image's header tells the gate's rules, nothing decoded: width, height and bands
    (``readable`` left to the run's decode), or ``readable`` False where the gate's decode
    would fail at the header (over the pixel limit, not PNG or JPEG by content)."""
    try:
        with open_image(source) as image:
            width, height = image.size
            return {
                **_UNDECODED,
                "width": width,
                "height": height,
                "channels": len(image.getbands()),
            }
    except ImageTooLarge as exc:  # as the gate records it: its sides, unreadable
        return {**_UNDECODED, "width": exc.width, "height": exc.height, "readable": False}
    except Exception:  # PIL raises many types for what it cannot identify, as at the gate
        return {**_UNDECODED, "readable": False}


@dataclass(frozen=True)
class FolderCheck:
    """The gate's verdict on a folder's names, sizes and contents, before any decode."""

    success: bool
    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]

    def problems(self) -> list[str]:
        """One line per failed expectation: which, how many rows, the files behind it."""
        return [
            f"{r['expectation']}({r['column'] or r['table']}): "
            f"{r['unexpected'] if r['unexpected'] is not None else 'failed'} unexpected, "
            f"e.g. {', '.join(examples(self.rows, r)) or '-'}"
            for r in self.records
            if not r["success"]
        ]


def _shard(path: Path) -> dict[str, Any]:
    """A tar shard's samples as the gate describes them (``gate.manifest``), each member's MD5
    from its bytes, nothing decoded; or ``error``: why the trainer could not read it."""

    def undecoded(data: bytes) -> dict[str, Any]:
        return {
            **_header(io.BytesIO(data)),
            "md5": b64md5(hashlib.md5(data, usedforsecurity=False)),
        }

    try:
        with open(path, "rb") as fh:
            return shard_samples(fh, undecoded)
    except OSError as exc:  # the file itself, before any shard is read
        return {"error": str(exc)}


def folder_rows(files: list[LocalFile]) -> list[dict[str, Any]]:
    """The gate's manifest rows of the folder: as ``gate.manifest.build_manifest`` builds them
    from a listing and its reads, with the decoded fields left empty."""
    loose: list[dict[str, Any]] = []
    shards: list[dict[str, Any]] = []
    for file in files:
        if file.size and is_tar_name(file.rel):
            shards += _shard_rows(file.rel, file.size, _shard(file.path))
        elif file.size and is_image_name(file.rel) and file.size <= MAX_IMAGE_BYTES:
            loose.append(
                {**_path_fields(file.rel, file.size), **_header(file.path), "md5": file.md5}
            )
        else:  # empty, too large, or a kind the trainer does not read: unreadable, as at the gate
            loose.append({**_path_fields(file.rel, file.size), **_UNREAD, "md5": file.md5})
    _flag_mixed_splits(shards, loose)
    rows = loose + shards
    _flag_class_names(rows)
    _flag_leaks(rows)
    return rows


def check_folder(files: list[LocalFile], rules: ValidationConfig) -> FolderCheck:
    """The gate's suites over the folder's rows (their Data Docs are thrown away)."""
    rows = folder_rows(files)
    with tempfile.TemporaryDirectory(prefix="folder-check-") as docs:
        success, records = run_expectations(rows, rules, Path(docs))
    return FolderCheck(success, rows, records)
