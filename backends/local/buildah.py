"""Build the training image on this machine with buildah, and push it to the local registry.

The local target's counterpart of ACR Tasks: the same docker/Dockerfile, its cpu variant (the
CPU torch wheel, Horovod with Gloo) on a Debian base made with debootstrap (docker/base.sh),
built with chroot isolation (no container engine or OCI runtime is needed, or works here) and
pushed to the registry of backends.oci. The tag is the content tag of everything
the image is built from plus the variant's build arguments, so an image already in the
registry is never built again, and a change to the training code rebuilds its layer only
(buildah's layer cache keeps the others).

What the build reads from this machine is mounted into its RUN steps under /run/retrain-host,
and a last layer removes the empty mount points, so nothing of it is in the image: pip's own
configuration (index, extra indexes, CA bundle: a TLS-intercepting proxy needs it, and binding
it over the image's own bundle would break dpkg) and the folder holding the CPU torch wheel,
read-only; pip's download cache, and the Horovod wheel cache that `make setup` filled
(scripts/install_horovod.sh keys it by torch and Python version, which the image shares with
this machine's venv: Debian 12's Python 3.11 and the same torch wheel), so the image reuses the
wheel instead of compiling Horovod a second time, and a wheel the image compiles (the gpu
variant's) is kept for the next build.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

from filelock import FileLock

from backends.image import ImageResult, content_tag, image_inputs
from backends.lines import pipe_lines
from backends.oci import ImageRegistry, cache_dir

DOCKERFILE = "docker/Dockerfile"
BASE_SCRIPT = "docker/base.sh"
HOST = "/run/retrain-host"  # where the build's RUN steps see what they read from this machine
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu/torch/"
OnLine = Callable[[str], None]


class BuildError(RuntimeError):
    """buildah cannot build or push the image here; the message says why and what to do."""


def unavailable_reason() -> str | None:
    """Why images cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "building the image with buildah needs root (chroot isolation)"
    missing = [t for t in ("buildah", "debootstrap", "docker-registry") if not shutil.which(t)]
    if missing:
        return f"{', '.join(missing)} not installed: `make setup` installs them as root"
    return None


_drivers: dict[Path, str] = {}


def storage_driver(root: Path) -> str:
    """overlay where the kernel mounts it on this file system (no copies of layers), else vfs
    (every layer a full copy: slower, and several GB of disk)."""
    if root not in _drivers:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as probe:
            dirs = [Path(probe) / d for d in ("lower", "upper", "work", "merged")]
            for d in dirs:
                d.mkdir()
            lower, upper, work, merged = dirs
            options = f"lowerdir={lower},upperdir={upper},workdir={work}"
            mounted = subprocess.run(
                ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
                capture_output=True,
                check=False,
            )
            if mounted.returncode == 0:
                subprocess.run(["umount", str(merged)], check=False)
        _drivers[root] = "overlay" if mounted.returncode == 0 else "vfs"
    return _drivers[root]


class Buildah:
    """buildah on a storage folder of its own (not the machine's /var/lib/containers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.driver = storage_driver(root)

    def command(self, *args: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.root / "storage"),
            "--runroot",
            str(self.root / "runroot"),
            "--storage-driver",
            self.driver,
            *args,
        ]

    def output(self, *args: str) -> str:
        done = subprocess.run(self.command(*args), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(f"buildah {args[0]} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def stream(self, args: list[str], on_line: OnLine, cwd: Path | None = None) -> None:
        proc = subprocess.Popen(
            self.command(*args),
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            errors="replace",
        )
        assert proc.stdout is not None
        tail: list[str] = []

        def keep(line: str) -> None:
            tail.append(line)
            del tail[:-30]
            on_line(line)

        pipe_lines(proc.stdout, keep)
        if proc.wait() != 0:
            raise BuildError(f"buildah {args[0]} failed ({proc.returncode}):\n" + "\n".join(tail))

    def image_size(self, name: str) -> str:
        """As buildah reports it (e.g. '1.69 GB': its layers, unpacked)."""
        return self.output("images", "--format", "{{.Size}}", name).strip()

    def remove_all(self) -> None:
        """Every container and image of this storage, and the mount the overlay driver keeps
        on its own folder, so that the folder can be deleted."""
        for args in (("rm", "--all"), ("rmi", "--all", "--force")):
            subprocess.run(self.command(*args), capture_output=True, check=False)
        home = self.root / "storage" / self.driver
        mounted = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        if str(home) in mounted:
            subprocess.run(["umount", str(home)], capture_output=True, check=False)

    def has_image(self, name: str) -> bool:
        done = subprocess.run(
            self.command("images", "--quiet", name), capture_output=True, text=True, check=False
        )
        return done.returncode == 0 and bool(done.stdout.strip())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build of a tag (or of the base) at a time on this machine: several sessions may
    share its cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path):
        yield


def horovod_wheel_cache() -> Path:
    """scripts/install_horovod.sh's cache (the same default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("HOROVOD_WHEEL_CACHE") or Path(base) / "retrain-horovod-wheels")


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """pip's effective configuration on this machine (files and PIP_* variables), by key."""
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        with contextlib.suppress(ValueError, SyntaxError):
            settings[name] = str(ast.literal_eval(value))
    return settings


class HostMounts:
    """Paths of this machine a build reads, each mounted read-only at /run/retrain-host/N."""

    def __init__(self) -> None:
        self.mounts: list[tuple[Path, str]] = []

    def add(self, path: Path, name: str | None = None) -> str:
        for source, target in self.mounts:
            if source == path:
                return target
        target = f"{HOST}/{name or len(self.mounts)}"
        self.mounts.append((path, target))
        return target

    def volume_args(self) -> list[str]:
        args = []
        for source, target in self.mounts:
            mode = "rw" if target.endswith(("/horovod-wheels", "/pip-cache")) else "ro"
            args += ["-v", f"{source}:{target}:{mode}"]
        return args


def _local_url(url: str, mounts: HostMounts) -> str:
    """A file:// index or find-links location as the build sees it; others unchanged."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = Path(parts.path)
        # An index's pages link to files beside the index folder (../../files): mount its parent.
        return f"file://{mounts.add(path.parent)}/{path.name}"
    if not parts.scheme and url.startswith("/"):
        return mounts.add(Path(url))
    return url


def pip_config(settings: dict[str, str], mounts: HostMounts) -> str:
    """A pip.conf for the build's RUN steps: this machine's index, extra indexes and CA bundle,
    with local paths replaced by their mounts (find-links is the torch source's business)."""
    lines = ["[global]"]
    for key in ("index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout"):
        if settings.get(key):
            values = [_local_url(v, mounts) for v in settings[key].split()]
            lines.append(f"{key} = {' '.join(values)}")
    cert = settings.get("cert") or os.environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        lines.append(f"cert = {mounts.add(Path(cert), 'ca.crt')}")
    return "\n".join(lines) + "\n"


def cpu_torch_source(settings: dict[str, str], mounts: HostMounts, version: str) -> str:
    """Where the cpu variant's torch comes from: a find-links folder of this machine holding
    the CPU wheel of the pinned version, else PyTorch's own CPU index."""
    for location in settings.get("find-links", "").split():
        folder = Path(urlsplit(location).path if "://" in location else location)
        if folder.is_dir() and any(folder.glob(f"torch-{version}+cpu-*.whl")):
            return mounts.add(folder, "torch-wheels")
    return CPU_TORCH_INDEX


def dockerfile_arg(root: Path, name: str) -> str:
    """The default of ``ARG name=...`` in docker/Dockerfile (the first one)."""
    for line in (root / DOCKERFILE).read_text().splitlines():
        if line.startswith(f"ARG {name}="):
            return line.split("=", 1)[1].strip()
    raise BuildError(f"{DOCKERFILE} declares no ARG {name}=")


def base_image(root: Path) -> str:
    """The local base image's name: named for the script that makes it."""
    digest = hashlib.sha256((root / BASE_SCRIPT).read_bytes()).hexdigest()[:12]
    return f"localhost/retrain-base:bookworm-{digest}"


def variant_build_args(root: Path, variant: str = "cpu") -> dict[str, str]:
    """What makes the local image the cpu (or, built here once to check it, the gpu) variant
    on the local base; part of its tag."""
    return {"VARIANT": variant, "BASE_IMAGE": base_image(root)}


class LocalImageBuilder:
    """Builds a variant (cpu: the local target's) into buildah's storage and pushes it to
    ``registry``."""

    def __init__(
        self, registry: ImageRegistry, cache: Path | None = None, variant: str = "cpu"
    ) -> None:
        self.registry, self.variant = registry, variant
        self.cache = cache or cache_dir()
        self.buildah = Buildah(self.cache / "build")

    def reference(self, root: Path, repository: str) -> str:
        tag = content_tag(root, variant_build_args(root, self.variant))
        return f"{self.registry.address}/{repository}:{tag}"

    def build(self, root: Path, repository: str, on_line: OnLine, push: bool = True) -> ImageResult:
        """The image in the registry (``push``), or in buildah's storage only."""
        reference = self.reference(root, repository)
        tag = reference.rsplit(":", 1)[1]

        def there() -> bool:
            if push:
                return self.registry.has_tag(repository, tag)
            return self.buildah.has_image(reference)

        if there():
            return ImageResult(reference, False, "tag already in the registry")
        reason = unavailable_reason()
        if reason:
            raise BuildError(f"image.builder buildah: {reason} (or set image.builder: none)")
        with _locked(self.cache / "locks" / f"{tag}.lock"):
            if there():  # built meanwhile by another process
                return ImageResult(reference, False, "tag already in the registry")
            self.ensure_base(root, on_line)
            self._build(root, reference, on_line)
            self._forget_mount_points(reference)
            if not push:
                return ImageResult(reference, True, f"built with buildah ({self.buildah.driver})")
            on_line(f"pushing {reference}")
            self.buildah.stream(
                [
                    "push",
                    "--tls-verify=false",
                    "--quiet",
                    "--disable-compression",
                    reference,
                    f"docker://{reference}",
                ],
                on_line,
            )
        return ImageResult(
            reference, True, f"built with buildah ({self.buildah.driver} storage) and pushed"
        )

    def ensure_base(self, root: Path, on_line: OnLine) -> None:
        """The local base image in buildah's storage (made once: docker/base.sh)."""
        name = base_image(root)
        if self.buildah.has_image(name):
            return
        with _locked(self.cache / "locks" / "base.lock"):
            if not self.buildah.has_image(name):
                self._make_base(root, name, on_line)

    def _make_base(self, root: Path, name: str, on_line: OnLine) -> None:
        tarball = self.cache / "base" / f"{name.rsplit(':', 1)[1]}.tar"
        if not tarball.exists():
            on_line(f"base image: debootstrap Debian 12 into {tarball} (about a minute)")
            tarball.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                ["bash", str(root / BASE_SCRIPT), str(tarball)],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise BuildError(f"{BASE_SCRIPT} failed: {done.stderr.strip()[-2000:]}")
        with tempfile.TemporaryDirectory(dir=self.cache) as context:
            os.link(tarball, Path(context) / "rootfs.tar")
            (Path(context) / "Containerfile").write_text("FROM scratch\nADD rootfs.tar /\n")
            self.buildah.stream(
                ["bud", "--isolation", "chroot", "--quiet", "-t", name, context], on_line
            )

    def _forget_mount_points(self, reference: str) -> None:
        """The build's mounts leave their (empty) mount points in its layers: a last layer
        removes them, so the image holds nothing named after this machine."""
        container = self.buildah.output("from", "--pull=never", "--quiet", reference).strip()
        try:
            self.buildah.output("run", "--isolation", "chroot", container, "--", "rm", "-rf", HOST)
            self.buildah.output("commit", "--quiet", container, reference)
        finally:
            subprocess.run(self.buildah.command("rm", container), capture_output=True, check=False)

    def _build(self, root: Path, reference: str, on_line: OnLine) -> None:
        mounts = HostMounts()
        settings = pip_settings()
        args = variant_build_args(root, self.variant)
        if self.variant == "cpu":
            version = dockerfile_arg(root, "TORCH_VERSION")
            args["TORCH_FIND_LINKS"] = cpu_torch_source(settings, mounts, version)
        wheels = horovod_wheel_cache()
        wheels.mkdir(parents=True, exist_ok=True)
        args["HOROVOD_WHEEL_CACHE"] = mounts.add(wheels, "horovod-wheels")
        downloads = self.cache / "pip-cache"  # what pip fetched, for the next cold build
        downloads.mkdir(parents=True, exist_ok=True)
        args["PIP_NO_CACHE_DIR"] = ""  # empty: caching on (any value turns it off)
        args["PIP_CACHE_DIR"] = mounts.add(downloads, "pip-cache")
        with tempfile.TemporaryDirectory(dir=self.cache) as work:
            context, pip_dir = Path(work) / "context", Path(work) / "pip"
            for rel, source in image_inputs(root).items():
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, context / rel)
            pip_dir.mkdir()
            (pip_dir / "pip.conf").write_text(pip_config(settings, mounts))
            args["PIP_CONFIG_FILE"] = f"{mounts.add(pip_dir, 'pip')}/pip.conf"
            build_args = [a for k, v in sorted(args.items()) for a in ("--build-arg", f"{k}={v}")]
            self.buildah.stream(
                [
                    "bud",
                    "--isolation",
                    "chroot",
                    "--layers",
                    "--force-rm",
                    "--pull=never",
                    "-f",
                    DOCKERFILE,
                    *build_args,
                    *mounts.volume_args(),
                    "-t",
                    reference,
                    str(context),
                ],
                on_line,
            )
