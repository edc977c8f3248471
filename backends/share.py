"""The scripts share: Azure Files on Azure, a directory standing in for it on the local target.

Uploads skip files whose content hash is unchanged, so a re-run with the same code touches
nothing; each file is replaced atomically so a node mounting the share never reads half a file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic import atomic_write, atomic_write_json, read_json_object

HASHES = ".content-hashes.json"


@dataclass
class UploadReport:
    uploaded: list[str] = field(default_factory=list)
    unchanged: int = 0
    digest: str = ""  # of all files together: names the code version


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def collect_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Relative share path -> local file, for every file of the given folders (no caches)."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files[path.relative_to(root).as_posix()] = path
    return files


def tree_digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()[:16]


class LocalShare:
    """A directory with the same contract as the Azure Files share."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _hashes(self) -> dict[str, str]:
        return read_json_object(self.root / HASHES) or {}

    def upload(self, files: dict[str, Path]) -> UploadReport:
        self.root.mkdir(parents=True, exist_ok=True)
        known = self._hashes()
        report = UploadReport()
        current: dict[str, str] = {}
        for rel, source in files.items():
            digest = file_sha256(source)
            current[rel] = digest
            target = self.root / rel
            if known.get(rel) == digest and target.is_file() and file_sha256(target) == digest:
                report.unchanged += 1
                continue
            with open(source, "rb") as fh:
                atomic_write(
                    target, lambda out: shutil.copyfileobj(fh, out), source.stat().st_mode & 0o777
                )
            report.uploaded.append(rel)
        atomic_write_json(current, self.root / HASHES)
        report.digest = tree_digest(current)
        return report
