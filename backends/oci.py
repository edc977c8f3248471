"""The local target's container registry as its users speak to it: the distribution API over
plain HTTP on loopback. Which registry process serves an address, and for how long, is
``backends.local.oci_server``'s concern.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

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
