"""The --gpu benchmark's code path (AMP scaler, channels_last inputs, Horovod synchronize) on CPU.

No GPU exists here; this keeps the path that runs on one from rotting, at toy sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import BIN, ROOT, child_env


def test_gpu_mode_runs_under_horovodrun(tmp_path: Path, horovodrun: Path) -> None:
    report = tmp_path / "report.json"
    cmd = [
        str(BIN / "horovodrun"),
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        "-m",
        "bench.train_throughput",
        "--gpu",
        "--allow-cpu",
        "--model",
        "cnn",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--iters",
        "2",
        "--batches-per-iter",
        "2",
        "--warmup-batches",
        "1",
        "--json",
        str(report),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["gpus"] == 2
    assert data["images_per_sec_per_gpu"] > 0
    assert data["images_per_sec_total"] > data["images_per_sec_per_gpu"]
