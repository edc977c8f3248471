"""The data gate's checks on a folder on this machine, before it is uploaded as a data version
(``python -m cli.data upload``): a folder the gate would refuse fails here, naming its files,
before a byte is sent.

The same rules, not a copy of them: the manifest's rows are built by the gate's own functions
(``gate.manifest``: a file's split and class from its path, a tar shard's samples as the trainer
reads them, class folders beside shards, the same content in train and test) and judged by the
gate's own suites (``gate.suites``), so layout, splits, classes, counts per class, file kinds
by name and empty files are decided exactly as at the run. What only decoding an image can
tell (its size, its bands, whether every pixel decodes) is left empty here, which the suites
do not count against a row: the gate decides it when the run reads the uploaded version.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from imagedata.images import is_image_name
from imagedata.webdataset import is_tar_name

# Decided only by decoding, at the run's gate: left empty (unknown) here.
_UNDECODED = {"width": None, "height": None, "channels": None, "readable": None}


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
        return {**_UNDECODED, "md5": b64md5(hashlib.md5(data, usedforsecurity=False))}

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
        elif file.size and is_image_name(file.rel):
            loose.append({**_path_fields(file.rel, file.size), **_UNDECODED, "md5": file.md5})
        else:  # empty, or a kind the trainer does not read: the gate's row says unreadable
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
