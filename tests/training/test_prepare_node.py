"""prepare_node.sh on one node: a GPU node whose GPUs torch cannot use fails, saying so.

A node that lost its driver (or a container started without its GPUs) still lists its GPUs in
``nvidia-smi -L``; torch then sees none and the trainer would quietly run on the CPU. The
coordination command compares the two. ``nvidia-smi`` here is a stand-in printing what the real
one prints on a two-GPU node; torch is this machine's (the CPU build: it sees none), or the same
torch told by a ``sitecustomize`` to report two devices.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.processes  # each test runs a script or servers of its own

SCRIPT = ROOT / "training" / "prepare_node.sh"
TWO_GPUS = (
    "GPU 0: NVIDIA A100 80GB PCIe (UUID: GPU-6f3b2a1e-0000-0000-0000-000000000000)\n"
    "GPU 1: NVIDIA A100 80GB PCIe (UUID: GPU-6f3b2a1e-0000-0000-0000-000000000001)\n"
)


def _prepare(tmp_path: Path, nvidia_smi: str | None, torch_sees: int | None = None) -> Any:
    mounts = tmp_path / "mounts"
    for name in ("nfs", "scripts"):
        (mounts / name).mkdir(parents=True, exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        tool.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "AZ_BATCH_NODE_MOUNTS_DIR": str(mounts),
        "AZ_BATCH_NODE_ID": "tvmps_0007",
        "RETRAIN_PYTHON": sys.executable,
        "RETRAIN_ENGINE": "ddp",  # one node: the engine's import, then the GPU check
        "HOME": str(tmp_path),
    }
    if torch_sees is not None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import torch\n"
            "torch.cuda.is_available = lambda: True\n"
            f"torch.cuda.device_count = lambda: {torch_sees}\n"
        )
        env["PYTHONPATH"] = str(site)
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_gpus_listed_by_the_driver_but_not_seen_by_torch_fail_the_node(tmp_path: Path) -> None:
    done = _prepare(tmp_path, f"printf '{TWO_GPUS}'")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "prepare_node: node tvmps_0007: nvidia-smi lists 2 GPU(s) but torch sees 0 (torch "
        in done.stderr
    )
    assert "built for CUDA None" in done.stderr and "check the driver" in done.stderr


def test_a_node_whose_gpus_torch_sees_goes_on(tmp_path: Path) -> None:
    done = _prepare(tmp_path, f"printf '{TWO_GPUS}'", torch_sees=2)
    assert done.returncode == 0, done.stderr
    assert "prepare_node: node tvmps_0007: 2 GPU(s), all visible to torch" in done.stdout


@pytest.mark.parametrize(
    "nvidia_smi",
    [None, "echo 'No devices were found'; exit 6"],
    ids=["no-driver-tools", "no-gpus"],
)
def test_a_node_without_gpus_goes_on_on_the_cpu(tmp_path: Path, nvidia_smi: str | None) -> None:
    """CPU nodes (and this machine) have no GPU to lose: nothing to compare."""
    done = _prepare(tmp_path, nvidia_smi)
    assert done.returncode == 0, done.stderr
    assert "prepare_node: torch" in done.stdout and "GPU(s)" not in done.stdout
