"""Write-then-rename, so a reader sees the whole file or none: a node can die mid-write; and
the reading side of the JSON state files written this way.

Kept free of heavy imports: the orchestrator's steps use it as well as the trainer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Any, mode: int = 0o644) -> None:
    """Call ``write(file_object)`` on a temp file beside ``path``, fsync, give it ``mode``, then
    rename over it (so a script is executable from the moment it has its name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # mkstemp's 0600 would hide outputs from a scorer run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def b64md5(digest: Any) -> str:
    """A finished MD5 (a hashlib object) base64-encoded, as Blob storage writes Content-MD5."""
    return base64.b64encode(digest.digest()).decode()


def file_md5(path: Path) -> str:
    """The MD5 of a file's bytes, base64-encoded as Blob storage writes its Content-MD5."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return b64md5(digest)


def atomic_write_json(obj: object, path: Path) -> None:
    atomic_write(path, lambda fh: fh.write(json.dumps(obj, indent=2).encode()))


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when there is none to use: the file is missing, is
    not JSON (written by something else, or cut short by a full disk), or holds another type.
    For state that can be rebuilt (caches, content hashes, manifests): its absence costs work,
    never correctness."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # JSONDecodeError and UnicodeDecodeError included
        return None
    return data if isinstance(data, dict) else None
