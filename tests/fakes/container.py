"""Container images on the emulated Batch nodes: pulled from a registry, run as Batch runs them.

A node's container engine, in the parts a Batch container task uses. ``ImagePuller.pull``
fetches an image over the registry's distribution API (manifest, config and layers, each
checked against its digest) and unpacks every layer once into a folder of its own, with the
OCI whiteouts turned into overlayfs ones, as Docker's overlay2 driver stores layers; a layer
already unpacked (the same digest) is not fetched again, so a code change pulls its own small
layer only. ``Container`` is one task's container on one node: an overlay of the image's layers
with a writable layer of its own, mounted inside the node's mount namespace, with what Batch
maps into a container task (the node's whole Batch root at the same path, the node's
``/etc/hosts``, the node's network: host networking) and ``/proc``, ``/dev`` and ``/sys``.
Commands enter the node's namespaces and then the container's root (chroot), so everything a
task starts, the sshd its coordination command leaves running and whatever that sshd starts for
another node's ranks, runs from the image's files.

(``podman run`` and OCI runtimes cannot start containers on these machines; an overlay and a
chroot inside the node's own namespaces give the same file system view.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class PullError(RuntimeError):
    """The image cannot be pulled: the message names the reference and what went wrong."""


@dataclass(frozen=True)
class PulledImage:
    reference: str
    digest: str  # the manifest's
    layers: tuple[Path, ...]  # unpacked, bottom first
    env: tuple[str, ...]  # the image config's Env
    workdir: str

    def environment(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.env if "=" in item)


def split_reference(reference: str) -> tuple[str, str, str]:
    """(registry host:port, repository, tag) of ``host:port/repo/name:tag``."""
    host, _, rest = reference.partition("/")
    repository, _, tag = rest.rpartition(":")
    if not (host and repository and tag):
        raise PullError(f"{reference!r} is not registry/repository:tag")
    return host, repository, tag


class ImagePuller:
    """Pulls over plain HTTP (a loopback registry) into ``cache``, shared by the nodes."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        (cache / "layers").mkdir(parents=True, exist_ok=True)

    def _get(self, url: str, accept: str | None = None) -> bytes:
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return bytes(response.read())
        except OSError as exc:
            raise PullError(f"GET {url}: {exc}") from exc

    def pull(self, reference: str) -> PulledImage:
        host, repository, tag = split_reference(reference)
        base = f"http://{host}/v2/{repository}"
        raw = self._get(f"{base}/manifests/{tag}", MANIFEST_TYPES)
        manifest = json.loads(raw)
        if "layers" not in manifest:
            raise PullError(f"{reference}: not an image manifest ({manifest.get('mediaType')})")
        config = json.loads(self._blob(base, manifest["config"]["digest"]))
        layers = tuple(self._layer(base, layer) for layer in manifest["layers"])
        image_config = config.get("config") or {}
        return PulledImage(
            reference,
            "sha256:" + hashlib.sha256(raw).hexdigest(),
            layers,
            tuple(image_config.get("Env") or ()),
            image_config.get("WorkingDir") or "/",
        )

    def _blob(self, base: str, digest: str) -> bytes:
        data = self._get(f"{base}/blobs/{digest}")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise PullError(f"blob {digest} arrived with other content")
        return data

    def _layer(self, base: str, layer: dict[str, str]) -> Path:
        digest = layer["digest"]
        target = self.cache / "layers" / digest.replace(":", "-")
        if target.is_dir():
            return target
        with FileLock(self.cache / "pull.lock"):
            if target.is_dir():
                return target
            with tempfile.TemporaryDirectory(dir=self.cache) as work:
                blob = Path(work) / "blob"
                self._download(f"{base}/blobs/{digest}", blob, digest)
                unpacked = Path(work) / "layer"
                unpacked.mkdir()
                unpack_layer(blob, unpacked, layer.get("mediaType", ""))
                unpacked.rename(target)
        return target

    @staticmethod
    def _download(url: str, path: Path, digest: str) -> None:
        sha = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=300) as response, open(path, "wb") as out:
                while chunk := response.read(1 << 20):
                    sha.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            raise PullError(f"GET {url}: {exc}") from exc
        if "sha256:" + sha.hexdigest() != digest:
            raise PullError(f"layer {digest} arrived with other content")


def unpack_layer(blob: Path, target: Path, media_type: str) -> None:
    """A layer tar into ``target``, its whiteouts as overlayfs reads them: a deleted file is a
    0/0 character device, a directory whose lower contents are hidden has the opaque xattr.
    (``media_type`` says whether it is compressed; GNU tar finds that out itself.)"""
    done = subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "-xf", str(blob), "-C", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise PullError(f"unpacking a {media_type or 'layer'}: {done.stderr.strip()[-500:]}")
    for top, _dirs, files in os.walk(target):
        for name in files:
            if not name.startswith(WHITEOUT):
                continue
            os.unlink(os.path.join(top, name))
            if name == OPAQUE:
                os.setxattr(top, "trusted.overlay.opaque", b"y")
            else:
                os.mknod(os.path.join(top, name[len(WHITEOUT) :]), stat.S_IFCHR | 0o600, 0)


# Runs a command in a node's mount and PID namespaces, where a container's mounts live.
RunInNode = Callable[[list[str]], subprocess.CompletedProcess[str]]


@dataclass
class Bind:
    source: Path  # as the node sees it
    target: str  # inside the container
    read_only: bool = False


class Container:
    """One task's container on one node. Set up and torn down through ``run_in_node``, which
    runs a command in the node's mount and PID namespaces (the mounts live there only)."""

    def __init__(self, image: PulledImage, folder: Path) -> None:
        self.image, self.folder = image, folder
        self.root = folder / "merged"

    def _script(self, binds: list[Bind]) -> str:
        upper, work = self.folder / "upper", self.folder / "work"
        lower = ":".join(str(p) for p in reversed(self.image.layers))
        lines = [
            "set -e",
            f"mkdir -p {upper} {work} {self.root}",
            f"mount -t overlay overlay -o lowerdir={lower},upperdir={upper},workdir={work} "
            f"{self.root}",
            f"mount -t proc proc {self.root}/proc",
            f"mount --rbind /dev {self.root}/dev",
            f"mount --rbind /sys {self.root}/sys",
        ]
        for bind in binds:
            inside = f"{self.root}{bind.target}"
            make = f"mkdir -p {inside}" if bind.source.is_dir() else f"touch {inside}"
            lines += [make, f"mount --bind {bind.source} {inside}"]
            if bind.read_only:
                lines.append(f"mount -o remount,bind,ro {inside}")
        return "\n".join(lines)

    def start(self, run_in_node: RunInNode, binds: list[Bind]) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        done = run_in_node(["sh", "-c", self._script(binds)])
        if done.returncode != 0:
            raise RuntimeError(f"container of {self.image.reference}: {done.stderr.strip()}")

    def command(self, argv: list[str], cwd: str | Path | None) -> list[str]:
        """argv run inside the container, from the node (after entering its namespaces)."""
        chdir = [f"--chdir={cwd}"] if cwd is not None else []
        return ["chroot", str(self.root), "/usr/bin/env", *chdir, *argv]

    def stop(self, run_in_node: RunInNode) -> None:
        run_in_node(["umount", "-R", str(self.root)])
        shutil.rmtree(self.folder, ignore_errors=True)
