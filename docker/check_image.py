"""The image's last check before its code layer: fail the build, not the first job on Batch.

Runs in the final stage with the Dockerfile's arguments and the facts the builder recorded
(docker/cuda_build_env.py). Both variants: Horovod imports with the backends it must have,
no compiler reached the image, torch is the pinned version. The gpu variant also: torch is the
CUDA build the Dockerfile names (its metadata's cuda-toolkit and nvidia-nccl-cu13 pins), Horovod
was compiled by the nvcc of torch's CUDA release against the NCCL header of the NCCL torch
loads, and once torch and Horovod are loaded the process maps exactly one libcudart and one
libnccl, both torch's, with no other copy anywhere on the image's disk. None of it needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

COMPILERS = ("gcc", "g++", "cc", "c++", "nvcc")
SKIP = {"/proc", "/sys", "/dev", "/run"}


def fail(message: str) -> None:
    print(f"check_image: {message}", file=sys.stderr)
    raise SystemExit(1)


def major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def mapped(pattern: str) -> set[str]:
    """Files of this process's memory map whose name matches ``pattern``."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and re.search(pattern, os.path.basename(parts[5])):
            found.add(os.path.realpath(parts[5]))
    return found


def on_disk(pattern: str) -> set[str]:
    found = set()
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in SKIP]
        for name in files:
            if re.search(pattern, name):
                found.add(os.path.realpath(os.path.join(top, name)))
    return found


def check_gpu(torch_cuda: str, torch_nccl: str, build: dict[str, str]) -> list[str]:
    import horovod.torch as hvd
    import torch

    seen = []
    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a CPU build; the gpu variant needs PyPI's CUDA build")
    if major_minor(torch.version.cuda) != major_minor(torch_cuda):
        fail(f"torch was built with CUDA {torch.version.cuda}, the Dockerfile says {torch_cuda}")
    seen.append(f"torch CUDA {torch.version.cuda}")
    if major_minor(build["nvcc"]) != major_minor(torch.version.cuda):
        fail(f"Horovod was compiled with nvcc {build['nvcc']}, torch with {torch.version.cuda}")
    seen.append(f"Horovod compiled by nvcc {build['nvcc']} for sm {build['architectures']}")
    loaded = ".".join(map(str, torch.cuda.nccl.version()))
    if not build["nccl_header"] == torch_nccl == loaded:
        fail(
            f"NCCL: Horovod compiled against {build['nccl_header']}, torch loads {loaded}, the "
            f"Dockerfile says {torch_nccl}"
        )
    seen.append(f"NCCL {loaded} (Horovod's header, torch's library)")
    if not (hvd.nccl_built() and hvd.mpi_built() and hvd.gloo_built()):
        fail(
            f"Horovod lacks a backend: nccl {hvd.nccl_built()}, mpi {hvd.mpi_built()}, "
            f"gloo {hvd.gloo_built()}"
        )
    nvidia = str(Path(torch.__file__).resolve().parents[1] / "nvidia")
    for lib in ("cudart", "nccl"):
        pattern = rf"^lib{lib}\.so"
        in_process, files = mapped(pattern), on_disk(pattern)
        if len(in_process) != 1 or not next(iter(in_process)).startswith(nvidia):
            fail(f"the process maps {sorted(in_process) or 'no'} lib{lib}; want torch's only")
        strays = sorted(f for f in files if not f.startswith(nvidia))
        if strays:
            fail(f"lib{lib} outside torch's wheels: {strays}")
        seen.append(f"one lib{lib}: {next(iter(in_process))}")
    return seen


def check_onnx() -> str:
    """Rank 0 exports model.onnx and runs it before keeping it (training/onnx_export.py): the
    exporter (onnx, onnxscript) and onnxruntime must work together in the image."""
    import numpy as np
    import onnxruntime
    import torch

    layer = torch.nn.Linear(3, 2).eval()
    sample = torch.ones(2, 3)
    try:
        program = torch.onnx.export(layer, (sample,), dynamo=True, verbose=False)
        session = onnxruntime.InferenceSession(
            program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        (got,) = session.run(None, {session.get_inputs()[0].name: sample.numpy()})
    except Exception as exc:
        fail(f"ONNX export or onnxruntime fails in the image: {type(exc).__name__}: {exc}")
    with torch.no_grad():
        want = layer(sample).numpy()
    if not np.allclose(got, want, atol=1e-5):
        fail(f"onnxruntime computes {got.tolist()} where torch computes {want.tolist()}")
    return f"onnxruntime {onnxruntime.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["gpu", "cpu"], required=True)
    parser.add_argument("--torch-cuda", required=True)
    parser.add_argument("--torch-nccl", required=True)
    parser.add_argument("--build", type=Path, required=True)
    args = parser.parse_args()
    build = json.loads(args.build.read_text())
    import horovod
    import horovod.torch as hvd
    import torch

    seen = [f"torch {torch.__version__}", f"horovod {horovod.__version__}"]
    if build.get("torch") != torch.__version__:
        fail(f"Horovod was built for torch {build.get('torch')}; the image has {torch.__version__}")
    if not hvd.gloo_built():
        fail("Horovod was built without Gloo")
    compilers = [c for c in COMPILERS if shutil.which(c)]
    if compilers:
        fail(f"compilers reached the final image: {compilers}")
    if args.variant == "gpu":
        seen += check_gpu(args.torch_cuda, args.torch_nccl, build)
    else:
        if torch.version.cuda is not None:
            fail(f"the cpu variant has torch's CUDA {torch.version.cuda} build")
        if hvd.nccl_built():
            fail("the cpu variant's Horovod was built with NCCL")
    seen.append(check_onnx())
    print(f"check_image: {args.variant} image ok: " + "; ".join(seen))
    print(f"check_image: torch {metadata.version('torch')} requires {metadata.requires('torch')}")


if __name__ == "__main__":
    main()
