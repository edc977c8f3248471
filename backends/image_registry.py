"""The local target's container registry: Debian's ``docker-registry`` (distribution 2.8).

A real OCI registry on loopback, holding its images in a folder of this machine's cache, so an
image pushed once is found by every later build (the tag names the content: an existing tag is
never built again) and by the emulated Batch nodes, which pull from it as Batch nodes pull from
ACR. Several registry processes may serve the same folder (distribution's filesystem storage
supports it), so each user of it (a flow's build step, a test session) can run its own for as
long as it needs one, and uses the one already listening at its address when there is one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backends.azurite import free_port
from backends.processes import stop

BINARY = "docker-registry"
MANIFESTS = ", ".join(
    [
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    ]
)


def cache_dir() -> Path:
    """Where the image tools keep their state on this machine (registry, build storage)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retrain-image"


class RegistryError(RuntimeError):
    """The registry cannot be reached or started; the message says which address and why."""


class ImageRegistry:
    """A registry at ``host:port`` spoken to over plain HTTP (loopback only)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _request(self, method: str, path: str) -> int:
        request = urllib.request.Request(
            f"http://{self.address}{path}", method=method, headers={"Accept": MANIFESTS}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def answers(self) -> bool:
        """Whether a registry (the distribution API, /v2/) listens at the address."""
        try:
            request = urllib.request.Request(f"http://{self.address}/v2/")
            with urllib.request.urlopen(request, timeout=5) as response:
                return "Docker-Distribution-Api-Version" in response.headers
        except urllib.error.HTTPError as exc:
            return "Docker-Distribution-Api-Version" in exc.headers
        except OSError:
            return False

    def has_tag(self, repository: str, tag: str) -> bool:
        status = self._request("HEAD", f"/v2/{repository}/manifests/{tag}")
        if status in (200, 404):
            return status == 200
        raise RegistryError(f"registry {self.address}: HEAD {repository}:{tag} answered {status}")


def _config(storage: Path, address: str) -> str:
    return (
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n"
    )


@contextmanager
def local_registry(address: str | None, storage: Path | None = None) -> Iterator[ImageRegistry]:
    """A registry at ``address`` until the block exits: the one listening there, or one started
    on the shared storage folder (on a free loopback port when ``address`` is None)."""
    if address is not None:
        found = ImageRegistry(address)
        if found.answers():
            yield found
            return
        host = address.rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost"):
            raise RegistryError(
                f"image.registry {address}: no registry answers there, and only a loopback "
                "address can be served from here (127.0.0.1:PORT)"
            )
    if shutil.which(BINARY) is None:
        raise RegistryError(
            f"{BINARY} is not installed: `make setup` installs it as root "
            "(apt-get install docker-registry)"
        )
    storage = storage or cache_dir() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    if address is None:
        address = f"127.0.0.1:{free_port()}"
    run_dir = cache_dir() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / f"registry-{os.getpid()}-{address.replace(':', '_')}.yml"
    config.write_text(_config(storage, address))
    log = open(run_dir / "registry.log", "ab")  # noqa: SIM115  # closed below
    proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    registry = ImageRegistry(address)
    try:
        deadline = time.monotonic() + 30
        while not registry.answers():
            if proc.poll() is not None:
                raise RegistryError(
                    f"{BINARY} at {address} exited with {proc.returncode}: see "
                    f"{run_dir / 'registry.log'} (is the port taken?)"
                )
            if time.monotonic() > deadline:
                raise RegistryError(f"{BINARY} at {address} did not answer within 30 s")
            time.sleep(0.1)
        yield registry
    finally:
        stop(proc)
        log.close()
        with contextlib.suppress(OSError):
            config.unlink()
