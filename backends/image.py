"""The training image: a content-addressed tag, and what every builder shares.

The tag is a hash of everything that goes into the image (docker/, training/ and the pinned
dependencies), so an unchanged image is never rebuilt and a changed one never reuses a tag.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from backends.share import collect_files, file_sha256

IMAGE_INPUTS = ["docker", "common", "imagedata", "training"]
LOCK_FILES = ["constraints.txt", "pyproject.toml", "scripts/install_horovod.sh"]


def image_inputs(root: Path) -> dict[str, Path]:
    """Every file the image is built from: the build context, and what the tag hashes."""
    files = collect_files(root, IMAGE_INPUTS)
    for rel in LOCK_FILES:
        files[rel] = root / rel
    return files


def content_tag(root: Path, build_args: Mapping[str, str] | None = None) -> str:
    """The files the image is built from, and the build arguments that choose its variant
    (none for the image Azure runs: the Dockerfile's defaults are in the Dockerfile)."""
    files = image_inputs(root)
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{file_sha256(files[rel])}\n".encode())
    for name, value in sorted((build_args or {}).items()):
        digest.update(f"--build-arg\0{name}={value}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class ImageResult:
    reference: str
    built: bool
    reason: str


def build_local(root: Path, repository: str) -> ImageResult:
    """image.builder none on the local target: nothing built, the tag is recorded (its cluster
    runs the trainer as local processes either way)."""
    return ImageResult(
        f"{repository}:{content_tag(root)}",
        False,
        "not built (image.builder none): the local target runs the trainer as local processes",
    )


def context_archive(root: Path) -> bytes:
    """The build context as a reproducible tar.gz (sorted names, no owners or times)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for rel, path in sorted(image_inputs(root).items()):
            info = tar.gettarinfo(str(path), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    return gzip.compress(buffer.getvalue(), compresslevel=6, mtime=0)
