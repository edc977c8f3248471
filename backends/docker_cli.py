"""Build and push with the docker CLI, for users who have a Docker engine and a registry login.

ACR Tasks is the default on Azure (no engine needed); this builder is for registries other than
ACR or for building on a workstation. An existing tag is detected with ``docker manifest
inspect`` and not rebuilt.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from backends.image import ImageResult
from backends.lines import pipe_lines


class DockerUnavailableError(RuntimeError):
    """No docker CLI, or no engine behind it; the message says which and what to use instead."""


def _run(args: list[str], cwd: Path, on_line: Callable[[str], None]) -> int:
    proc = subprocess.Popen(
        args, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    pipe_lines(proc.stdout, on_line)
    return proc.wait()


def docker_build(root: Path, reference: str, on_line: Callable[[str], None]) -> ImageResult:
    if shutil.which("docker") is None:
        raise DockerUnavailableError("image.builder docker: no docker CLI on PATH; use acr")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        raise DockerUnavailableError(
            "image.builder docker: no Docker engine is reachable (docker info: "
            f"{info.stderr.strip().splitlines()[-1] if info.stderr.strip() else 'failed'}); "
            "use image.builder acr, which builds in the registry"
        )
    probe = subprocess.run(
        ["docker", "manifest", "inspect", reference], capture_output=True, check=False
    )
    if probe.returncode == 0:
        return ImageResult(reference, False, "tag already in the registry")
    for args in (
        ["docker", "build", "-f", "docker/Dockerfile", "-t", reference, "."],
        ["docker", "push", reference],
    ):
        if _run(args, root, on_line) != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed for {reference}")
    return ImageResult(reference, True, "built and pushed with the docker CLI")
