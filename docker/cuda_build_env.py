"""The CUDA that Horovod is compiled against: the one torch's wheels brought, nothing else.

Runs in the image's builder stage. ``--cuda``/``--nccl`` are the Dockerfile's TORCH_CUDA and
TORCH_NCCL; the first thing checked is that the installed torch requires exactly those (its
wheel metadata), so a torch whose CUDA moved fails the build here, naming both (``--check``
does only that, before anything is installed). Then, without ``--record``: prints the shell
settings install_horovod.sh builds with (eval'd by the RUN): torch's CUDA folder (nvidia/cu13,
where ``cuda-toolkit[nvcc,cccl]`` of the same release put nvcc) as HOROVOD_CUDA_HOME, torch's
NCCL as HOROVOD_NCCL_HOME (linked shared, so the process has torch's copy only), and the GPU
architectures torch itself was built for. With ``--record``: writes what the build used
(nvcc's release, the NCCL header's version) for check_image.py to compare with what torch
loads at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def fail(message: str) -> None:
    print(f"cuda_build_env: {message}", file=sys.stderr)
    raise SystemExit(1)


def torch_requirement(name: str) -> str | None:
    """The exact version torch's metadata pins ``name`` to (extras and markers dropped)."""
    for requirement in metadata.requires("torch") or []:
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*==\s*([^;\s]+)", requirement)
        if match and match.group(1).lower().replace("_", "-") == name:
            return match.group(3)
    return None


def check_torch_pins(cuda: str, nccl: str) -> None:
    wanted = {"cuda-toolkit": cuda, "nvidia-nccl-cu13": nccl}
    for name, version in wanted.items():
        pinned = torch_requirement(name)
        if pinned != version:
            fail(
                f"torch {metadata.version('torch')} requires {name}=={pinned}, but the Dockerfile "
                f"says {version} (TORCH_CUDA/TORCH_NCCL): update both together"
            )


def package_dir(distribution: str, marker: str) -> Path:
    """The folder of ``distribution``'s files that holds ``marker`` (e.g. 'include/nccl.h')."""
    for file in metadata.files(distribution) or []:
        if str(file).endswith(marker):
            path = Path(str(file.locate())).resolve()
            return path.parents[len(Path(marker).parts) - 1]
    fail(f"{distribution} has no {marker}")
    raise AssertionError


def cuda_home() -> Path:
    return package_dir("nvidia-cuda-runtime", "include/cuda_runtime.h")


def nccl_home() -> Path:
    return package_dir("nvidia-nccl-cu13", "include/nccl.h")


def link_unversioned(lib: Path, name: str) -> None:
    """CMake looks for lib<name>.so; the wheels ship the versioned file only."""
    plain = lib / f"lib{name}.so"
    if not plain.exists():
        versioned = sorted(lib.glob(f"lib{name}.so.*"))
        if not versioned:
            fail(f"no lib{name}.so.* in {lib}")
        plain.symlink_to(versioned[0].name)


def torch_architectures() -> str:
    """The compute capabilities torch's CUDA kernels were built for, e.g. '75,80,86,90'."""
    import torch

    flags = torch._C._cuda_getArchFlags() or ""
    ccs = sorted({int(m) for m in re.findall(r"sm_(\d+)", flags)})
    if not ccs:
        fail(f"torch {torch.__version__} names no CUDA architecture ({flags!r})")
    return ",".join(map(str, ccs))


def nvcc_release(home: Path) -> str:
    out = subprocess.run(
        [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    if not match:
        fail(f"cannot read nvcc's release from: {out}")
        raise AssertionError
    return match.group(1)


def nccl_header_version(home: Path) -> str:
    text = (home / "include" / "nccl.h").read_text()
    parts = [re.search(rf"#define NCCL_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        fail(f"no NCCL version in {home / 'include' / 'nccl.h'}")
    return ".".join(m.group(1) for m in parts if m)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", required=True)
    parser.add_argument("--nccl", required=True)
    parser.add_argument("--variant", default="gpu")
    parser.add_argument("--record", type=Path)
    parser.add_argument("--check", action="store_true", help="torch's pins only, then exit")
    args = parser.parse_args()
    if args.check:
        check_torch_pins(args.cuda, args.nccl)
        print(f"cuda_build_env: torch requires CUDA {args.cuda} and NCCL {args.nccl}, as asked")
        return
    if args.record:
        import torch

        facts: dict[str, object] = {"variant": args.variant, "torch": torch.__version__}
        if args.variant == "gpu":
            check_torch_pins(args.cuda, args.nccl)
            facts.update(
                nvcc=nvcc_release(cuda_home()),
                nccl_header=nccl_header_version(nccl_home()),
                architectures=torch_architectures(),
            )
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(facts, indent=1) + "\n")
        print(f"cuda_build_env: built with {facts}", file=sys.stderr)
        return
    check_torch_pins(args.cuda, args.nccl)
    cuda, nccl = cuda_home(), nccl_home()
    if not (cuda / "bin" / "nvcc").exists():
        fail(f"no nvcc in {cuda}/bin: install cuda-toolkit[nvcc,cccl]=={args.cuda} first")
    link_unversioned(cuda / "lib", "cudart")
    if not (cuda / "lib64").exists():  # where nvcc's own profile looks for its libraries
        (cuda / "lib64").symlink_to("lib")
    link_unversioned(nccl / "lib", "nccl")
    settings = {
        "HOROVOD_CUDA_HOME": str(cuda),
        "HOROVOD_NCCL_HOME": str(nccl),
        "HOROVOD_NCCL_LINK": "SHARED",
        "HOROVOD_BUILD_CUDA_CC_LIST": torch_architectures(),
        "PATH": f"{cuda / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    for name, value in settings.items():
        print(f"export {name}='{value}'")
    print(f"cuda_build_env: {settings}", file=sys.stderr)


if __name__ == "__main__":
    main()
