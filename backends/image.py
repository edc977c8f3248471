"""The training image: a content-addressed tag, and builders (none on the local target).

The tag is a hash of everything that goes into the image (docker/, training/ and the pinned
dependencies), so an unchanged image is never rebuilt and a changed one never reuses a tag.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from backends.share import collect_files, file_sha256

IMAGE_INPUTS = ["docker", "training"]
LOCK_FILES = ["constraints.txt", "pyproject.toml", "scripts/install_horovod.sh"]


def content_tag(root: Path) -> str:
    files = collect_files(root, IMAGE_INPUTS)
    for rel in LOCK_FILES:
        files[rel] = root / rel
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{file_sha256(files[rel])}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class ImageResult:
    reference: str
    built: bool
    reason: str


def build_local(root: Path, repository: str) -> ImageResult:
    """The local target runs the trainer as processes: nothing to build, the tag is recorded."""
    return ImageResult(
        f"{repository}:{content_tag(root)}",
        False,
        "not needed: the local target runs the trainer as local processes",
    )
