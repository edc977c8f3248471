"""The benchmarks' code at toy sizes: the figures are not checked, what they are made of is.

The --gpu path (AMP scaler, channels_last inputs, Horovod synchronize) runs here on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pipeline import critical_path
from flows.steps import ALWAYS
from tests.conftest import BIN, ENGINES_REPEATED, ROOT, child_env


@pytest.mark.parametrize("engine", ENGINES_REPEATED)
def test_gpu_mode_runs_under_either_launcher(engine: str, tmp_path: Path, horovodrun: Path) -> None:
    report = tmp_path / "report.json"
    if engine == "ddp":
        launcher = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    else:
        launcher = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
        launcher.append(sys.executable)
    cmd = [
        *launcher,
        "-m",
        "bench.train_throughput",
        "--gpu",
        "--engine",
        engine,
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
    assert data["gpus"] == 2 and data["engine"] == engine
    assert data["images_per_sec_per_gpu"] > 0
    assert data["images_per_sec_total"] > data["images_per_sec_per_gpu"]


def test_critical_path_takes_the_longest_branch() -> None:
    durations = dict.fromkeys(ALWAYS, 1.0)
    durations["stage-data"] = 5.0
    seconds, path = critical_path(durations)
    assert path == [
        "validate-data",
        "fit-to-data",
        "check-up-to-date",
        "stage-data",
        "run-training",
        "collect-and-score",
        "promote",
        "release-pool",
        "report",
    ]
    assert seconds == 13.0  # eight steps of 1 s and the 5 s branch; the other branches overlap
    # The local cluster trains without the image: a long build runs beside training and only
    # the report waits for it.
    durations["build-image"] = 20.0
    seconds, path = critical_path(durations)
    assert path == ["validate-data", "fit-to-data", "check-up-to-date", "build-image", "report"]
    assert seconds == 24.0


@pytest.mark.processes
def test_quick_bench_writes_a_report_from_measurements(tmp_path: Path) -> None:
    """Staging, loading and the trainer at toy sizes, then the page rendered from their JSON."""
    results, page = tmp_path / "results", tmp_path / "performance.md"
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--quick",
        "--only",
        "staging",
        "loading",
        "trainer",
        "--scratch",
        str(tmp_path / "scratch"),
        "--results",
        str(results),
        "--output",
        str(page),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    staging = json.loads((results / "staging.json").read_text())
    # Both tools staged every file at every delay (the bench refuses differing trees).
    # With Azurite on a core of its own too, where there are two cores to part.
    apart = len(os.sched_getaffinity(0)) > 1
    assert bool(staging["large_apart"]) == apart
    for part, files in (("small", 300), ("large", 2), ("large_apart", 2)):
        for case in staging[part].values():
            assert case["step"]["files"] == case["rclone"]["files"] == files
            assert case["step"]["resync_seconds"] > 0
            assert case["rclone"]["resync_cpu_seconds"] > 0
            # Azurite served both: its CPU is counted whichever tool asked.
            assert case["step"]["server_cpu_ms_per_file"] > 0
            assert case["rclone"]["server_cpu_ms_per_file"] > 0
    # Its thousands of kept files went once every benchmark had run (bench.staging.run).
    assert not (tmp_path / "scratch" / "staging").exists()
    changed = staging["resync_one_percent"]
    assert changed["downloaded"] == changed["changed_blobs"] == changed["decoded"] == 3
    assert changed["reused"] == 297
    # The same 300 images as tar shards: staged and packed to as many rows as loose files.
    for case in staging["first_step"]["delays"].values():
        assert case["images"] == 300 and case["packed_seconds"] > 0 < case["loose_seconds"]
    loading = json.loads((results / "loading.json").read_text())
    assert all(rate > 0 for per in loading["images_per_sec"].values() for rate in per.values())
    trainer = json.loads((results / "trainer.json").read_text())
    assert trainer["shards"]["dataset"] == "image-folders (packed shards)"
    assert trainer["loose"]["dataset"] == "image-folders"
    assert trainer["identical_samples"] == trainer["samples_checked"]  # the same data both ways
    text = page.read_text()
    for heading in ("## Staging", "## Data loading", "## The trainer", "## On a GPU"):
        assert heading in text
    assert "| small files, no delay |" in text and "step / rclone" in text
    assert ("| large files, no delay, Azurite on a core of its own |" in text) == apart
    assert "| server CPU per small file (Azurite), no delay |" in text
    assert "| re-sync, nothing changed (2 large files), no delay |" in text
    assert "| 300 images, no delay |" in text and "packed / loose (time)" in text


def test_nodes_section_renders_what_was_measured() -> None:
    from bench.report import nodes

    shape = {
        "images_per_sec": 800.0,
        "wall_seconds": 9.0,
        "coordination_seconds": 1.5,
        "launch_overhead_seconds": 4.25,
        "test_accuracy": 0.9,
    }
    report = {
        "machine": "x86_64, 2 cores",
        "method": "m",
        "shapes": {
            "1 node x 2 processes": shape,
            "2 nodes x 1 process": {**shape, "images_per_sec": 600.0},
        },
        "two_nodes_over_one_images_per_sec": 0.75,
        "launch_overhead_seconds": {"1 node": 4.25, "2 nodes": 5.5},
    }
    text = "\n".join(nodes(report))
    assert "| 2 nodes x 1 process | 600 | 4.25 s | 1.50 s | 9.0 s | 0.900 |" in text
    assert "| 2 nodes x 1 process against 1 node x 2 processes, images/s | 0.75x |" in text
    assert "| launch overhead, 1 node / 2 nodes | 4.25 s / 5.50 s |" in text
    assert "Not measured on this machine: needs root" in "\n".join(nodes({"not_run": "needs root"}))
    ddp = {
        **report,
        "ddp_two_nodes_over_one_images_per_sec": 0.7,
        "ddp_over_horovod_two_nodes_images_per_sec": 1.1,
    }
    ddp_text = "\n".join(nodes(ddp))
    assert "| DDP: 2 nodes against 1, images/s | 0.7x |" in ddp_text
    assert "| DDP against Horovod on 2 nodes, images/s | 1.1x |" in ddp_text


def test_throughput_section_renders_both_engines() -> None:
    from bench.report import train_throughput

    report = {
        "method": "m",
        "plain_images_per_sec": 100.0,
        "horovod_np1_images_per_sec": 90.0,
        "horovod_np2_images_per_sec": 150.0,
        "horovod_np1_over_plain": 0.9,
        "horovod_np2_over_np1": 1.667,
        "ddp_np1_images_per_sec": 95.0,
        "ddp_np2_images_per_sec": 160.0,
        "ddp_np1_over_plain": 0.95,
        "ddp_np2_over_np1": 1.684,
        "ddp_np2_over_horovod_np2": 1.067,
    }
    text = "\n".join(train_throughput(report))
    assert "| trainer, `--engine ddp`, `torchrun --nproc-per-node 2` | 160 | 1.684 of np 1" in text
    assert "1.067 of Horovod np 2" in text


def test_image_section_renders_what_was_measured() -> None:
    from bench.report import image

    report = {
        "variant": "cpu",
        "method": "m",
        "storage_driver": "overlay",
        "load_average": 2.5,
        "base_seconds": 61.2,
        "build_seconds": 300.4,
        "cold_seconds": 361.6,
        "code_change_seconds": 3.2,
        "size": "1.69 GB",
        "checks": ["check_image: cpu image ok: torch 2.13.0+cpu"],
    }
    text = "\n".join(image(report, "## The training image"))
    assert "| from nothing, in all | 362 |" in text
    assert "| again after a change to the training code | 3 |" in text
    assert "| image size (cpu variant, layers unpacked) | 1.69 GB |" in text
    assert "    check_image: cpu image ok" in text
    skipped = "\n".join(image({"skipped": "needs root"}, "## The training image"))
    assert "Not measured on this machine: needs root." in skipped
