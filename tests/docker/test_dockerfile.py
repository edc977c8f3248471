"""The training image's pins against the project's, and its build-time guards, without a build.

The image runs the code the tests run only if both use the same torch, and one CUDA per image
holds only if the Dockerfile's CUDA and NCCL are the ones that torch brings. These tests read
the facts from the files (docker/Dockerfile's arguments, pyproject.toml, constraints.txt, the
Makefile) and compare them with what PyPI's torch wheels require, so bumping torch in one place
and not in the other fails here, in CI, instead of in a build on ACR or a job on Batch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"

# What PyPI's torch wheels require of CUDA, from their metadata (the Requires-Dist lines of
# torch-<version>-cp311-cp311-manylinux_2_28_x86_64.whl.metadata on pypi.org). A torch bump
# needs its line here, read from the new wheel's metadata.
TORCH_CUDA_REQUIREMENTS = {
    "2.13.0": {"cuda-toolkit": "13.0.3", "nvidia-nccl-cu13": "2.29.7"},
}
# torch 2.13.0's own Requires-Dist lines for CUDA (the same source), as the build reads them.
TORCH_2_13_REQUIRES = [
    "filelock",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]"
    '==13.0.3; platform_system == "Linux"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
]


def dockerfile_args(text: str) -> dict[str, list[str]]:
    """Every default each ARG is given anywhere in the Dockerfile."""
    found: dict[str, list[str]] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S*)", text, re.M):
        found.setdefault(name, []).append(value)
    return found


def project_torch_pins() -> dict[str, str]:
    """Where the project pins torch, and to what."""
    pins = {}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins["pyproject.toml"] = next(d for d in deps if d.startswith("torch"))
    constraints = (ROOT / "constraints.txt").read_text()
    pins["constraints.txt"] = re.search(r"^torch\S*", constraints, re.M).group(0)  # type: ignore[union-attr]
    makefile = (ROOT / "Makefile").read_text()
    pins["Makefile"] = re.search(r"install \S* ?(torch\S*)", makefile).group(1)  # type: ignore[union-attr]
    return pins


def agreement_problems(dockerfile: str) -> list[str]:
    """What is wrong between the Dockerfile and the project's torch pins; empty when nothing."""
    args = dockerfile_args(dockerfile)
    problems = [f"ARG {n} has several defaults: {v}" for n, v in args.items() if len(set(v)) > 1]
    torch = (args.get("TORCH_VERSION") or [None])[0]
    for where, pin in project_torch_pins().items():
        if pin != f"torch=={torch}":
            problems.append(f"{where} pins {pin}, docker/Dockerfile TORCH_VERSION={torch}")
    facts = TORCH_CUDA_REQUIREMENTS.get(str(torch))
    if facts is None:
        problems.append(
            f"no recorded CUDA requirements for torch {torch}: add them from its wheel's metadata"
        )
    else:
        for arg, package in (("TORCH_CUDA", "cuda-toolkit"), ("TORCH_NCCL", "nvidia-nccl-cu13")):
            value = (args.get(arg) or [None])[0]
            if value != facts[package]:
                problems.append(
                    f"docker/Dockerfile {arg}={value}, torch {torch} requires "
                    f"{package}=={facts[package]}"
                )
    base = (args.get("BASE_IMAGE") or [""])[0]
    if re.search(r"cuda|nvidia", base, re.I):
        problems.append(f"BASE_IMAGE {base} brings a CUDA of its own: torch's wheels bring it")
    return problems


def test_the_image_pins_the_torch_the_project_pins_and_the_cuda_it_requires() -> None:
    assert agreement_problems(DOCKERFILE.read_text()) == []


def test_a_torch_bump_without_the_image_fails() -> None:
    """The check above can fail: one side moved without the other, each way round."""
    text = DOCKERFILE.read_text()
    bumped = text.replace("ARG TORCH_VERSION=2.13.0", "ARG TORCH_VERSION=2.14.0")
    problems = agreement_problems(bumped)
    assert any("pyproject.toml pins torch==2.13.0" in p for p in problems)
    assert any("no recorded CUDA requirements for torch 2.14.0" in p for p in problems)
    cuda12 = text.replace("ARG TORCH_CUDA=13.0.3", "ARG TORCH_CUDA=12.8.1")
    assert agreement_problems(cuda12) == [
        "docker/Dockerfile TORCH_CUDA=12.8.1, torch 2.13.0 requires cuda-toolkit==13.0.3"
    ]
    base = text.replace(
        "ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim",
        "ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04",
    )
    assert any("brings a CUDA of its own" in p for p in agreement_problems(base))


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_reads_torchs_cuda_pins_as_pypi_writes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuda_build_env.py checks the installed torch's requirements against TORCH_CUDA and
    TORCH_NCCL before compiling anything; here on torch 2.13.0's real metadata lines."""
    build_env = _module("cuda_build_env")
    monkeypatch.setattr(build_env.metadata, "requires", lambda _: TORCH_2_13_REQUIRES)
    monkeypatch.setattr(build_env.metadata, "version", lambda _: "2.13.0")
    assert build_env.torch_requirement("cuda-toolkit") == "13.0.3"
    assert build_env.torch_requirement("nvidia-nccl-cu13") == "2.29.7"
    build_env.check_torch_pins("13.0.3", "2.29.7")
    with pytest.raises(SystemExit):
        build_env.check_torch_pins("12.8.1", "2.29.7")


def _stub(folder: Path, name: str, output: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    ("holds", "libraries", "toolkit", "expected"),
    [
        ("libnccl2\nlibnccl-dev\n", "", False, "holds packages: libnccl2 libnccl-dev"),
        ("", "\tlibcudart.so.12 (libc6,x86-64) => /usr/lib/libcudart.so.12\n", False, "libcudart"),
        ("", "", True, "a CUDA toolkit at /usr/local/cuda-12.8"),
        ("", "", False, None),
    ],
)
@pytest.mark.processes
def test_the_base_check_refuses_held_packages_and_cuda(
    tmp_path: Path, holds: str, libraries: str, toolkit: bool, expected: str | None
) -> None:
    """What stopped the old image at its first RUN (NVIDIA's devel base holds libnccl2 and
    libnccl-dev) now stops the build before apt runs, saying why."""
    bin_dir, base = tmp_path / "bin", tmp_path / "base"
    bin_dir.mkdir()
    (base / "usr" / "local").mkdir(parents=True)
    if toolkit:
        (base / "usr" / "local" / "cuda-12.8").mkdir()
    _stub(bin_dir, "apt-mark", holds)
    _stub(bin_dir, "ldconfig", libraries)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VARIANT": "gpu",
        "CHECK_BASE_ROOT": str(base),
    }
    done = subprocess.run(
        ["sh", str(ROOT / "docker" / "check_base.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if expected is None:
        assert done.returncode == 0, done.stderr
        assert "no CUDA, no NCCL, no held package" in done.stdout
    else:
        assert done.returncode == 1
        assert expected in done.stderr and "BASE_IMAGE must be a plain OS image" in done.stderr
