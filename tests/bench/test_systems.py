"""The trainer-systems benchmarks at toy sizes (what their figures are made of, not the figures)
and the page's sections rendered from what they measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report_systems as systems
from bench.report import GPU_RESULTS, _fed_measured, render
from tests.conftest import ROOT, child_env


def _bench(module: str, *args: str, tmp_path: Path) -> dict[str, object]:
    out = tmp_path / f"{module}.json"
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, "--json", str(out)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(out.read_text()))


@pytest.mark.processes
def test_feed_measures_every_way_against_the_gpus_rate(tmp_path: Path) -> None:
    r = _bench(
        "feed",
        *("--images", "150", "--batch-size", "16"),
        *("--source", str(tmp_path / "source"), "--work", str(tmp_path / "work")),
        tmp_path=tmp_path,
    )
    rates = r["images_per_sec"]
    assert isinstance(rates, dict) and set(rates) == {"per_image", "batched", "cpu_augment"}
    assert all(v["wall"] > 0 and v["cpu"] > 0 for v in rates.values())
    assert r["images"] == 120  # the train split (one in five images is test)
    gpu = r["gpu_rate"]
    assert isinstance(gpu, dict) and gpu["images_per_sec"]
    assert set(gpu["images_per_sec"]) <= {"horovod", "ddp"}
    text = "\n".join(systems.feed(r, "## Feed"))
    assert "| whole batches (`ShardBatches`, what the trainer uses) |" in text


def test_a_feed_is_set_against_the_rate_of_the_gpu_it_ran_on(tmp_path: Path) -> None:
    """The GPU's rate comes from the result measured on the same device, else the newest: a
    feed measured on an H200 was once divided by an H100's rate of three days before."""
    from bench.feed import gpu_rates

    def result(name: str, machine: str, date: str | None, rate: float) -> Path:
        path = tmp_path / name
        row = {"step": "torch.compile", "images_per_sec": rate}
        report: dict[str, object] = {"machine": machine, "engines": {"ddp": {"steps": [row]}}}
        if date:
            report["date"] = date
        path.write_text(json.dumps(report))
        return path

    older = result("gpu_speed.json", "NVIDIA H100 80GB HBM3, 16 cores", "2026-11-23", 5469.0)
    newer = result("gpu_fed.json", "NVIDIA H200, 16 cores", "2026-11-26", 6573.0)
    paths = [older, newer, tmp_path / "absent.json"]
    assert gpu_rates(paths, "NVIDIA H100 80GB HBM3")["images_per_sec"] == {"ddp": 5469.0}
    assert gpu_rates(paths, "NVIDIA H200")["images_per_sec"] == {"ddp": 6573.0}
    chosen = gpu_rates(paths, None)  # no GPU here: the newest
    assert (chosen["machine"], chosen["date"]) == ("NVIDIA H200, 16 cores", "2026-11-26")
    assert gpu_rates(paths, "NVIDIA A100")["images_per_sec"] == {"ddp": 6573.0}
    with pytest.raises(FileNotFoundError, match="no GPU rate measured"):
        gpu_rates([tmp_path / "absent.json"])
    # Measured minutes ago in the same `make bench`, dated only once every GPU benchmark ran.
    fresh = result("gpu_speed_now.json", "NVIDIA H200, 16 cores", None, 6600.0)
    chosen = gpu_rates([*paths, fresh], "NVIDIA H200")
    assert (chosen["images_per_sec"], chosen["date"]) == ({"ddp": 6600.0}, None)


@pytest.mark.processes
def test_checkpoint_stall_times_both_ways_on_each_target(tmp_path: Path) -> None:
    r = _bench(
        "checkpoint_stall",
        *("--model", "cnn", "--image-size", "32", "--repeats", "2", "--steps", "1"),
        *("--fsync-delay-ms", "100", "--work", str(tmp_path / "work")),
        tmp_path=tmp_path,
    )
    targets = r["targets"]
    assert isinstance(targets, dict)
    assert list(targets) == ["local disk", "a share whose fsync takes 100 ms"]
    for target in targets.values():
        samples = target["samples"]
        assert len(samples["in_line"]) == len(samples["background"]) == 2
        assert target["checkpoint_mb"] > 0
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == [
        "checkpoint-3.pt",
        "checkpoint-4.pt",
    ]  # both ways wrote into one folder, keeping two
    text = "\n".join(systems.checkpoint_stall(r, "## Stall"))
    assert "| a share whose fsync takes 100 ms |" in text


def test_sections_render_what_was_measured() -> None:
    compile_tail = {
        "machine": "m",
        "method": "x",
        "compile_seconds": 60.0,
        "recompile_seconds": 20.5,
        "graphs_before_partial": 1,
        "graphs_after_partial": 2,
        "full_step_seconds": {"before": 0.5, "after_recompile": 0.6},
        "partial_step_seconds": 0.25,
        "padded_step_seconds": 0.5,
        "cost_against_drop_seconds": {
            "recompile_once": 20.25,
            "recompile_per_epoch_after": 0.25,
            "pad_per_epoch": 0.5,
        },
        "recompile_over_pad_per_epoch": 40.5,
        "images_deferred_by_drop": 24,
    }
    text = "\n".join(systems.compile_tail(compile_tail))
    assert "| recompile for it (what the trainer did) | 20.2 s once per process" in text
    assert "| recompiling against a padded step | 40.5x |" in text
    variant = {"images_per_sec": 10.0, "optimizer_state_mib": 90.0, "rss_added_mib": 500.0}
    sharded = {
        "machine": "m",
        "method": "x",
        "deepspeed": "installed",
        "variants": {
            "ddp": {**variant, "peak_added_mib": 600.0},
            "ddp_zero1": {**variant, "optimizer_state_mib": 45.0, "peak_added_mib": 550.0},
            "deepspeed_zero1": {"error": "Traceback ... no backend"},
        },
        "ratios": {
            "ddp_zero1": {
                "optimizer_state_over_ddp": 0.5,
                "rss_added_over_ddp": 1.0,
                "images_per_sec_over_ddp": 1.0,
            }
        },
    }
    text = "\n".join(systems.sharded_state(sharded))
    assert (
        "against plain DDP: optimizer state / memory added / images/s | 0.5x / 1.0x / 1.0x |"
        in (text)
    )
    assert "| DeepSpeed ZeRO stage 1 | failed: 'Traceback ... no backend' |" in text


def test_the_shards_fed_section_names_each_engine_measured_failed_or_not_run() -> None:
    """A run of one engine (``--engines ddp``, where Horovod is not installed) gives that
    engine's ratio and says the other was not in the run, rather than leaving it out."""
    step = {"step": "torch.compile", "images_per_sec": 6400.0}
    fed = {
        "machine": "m",
        "method": "x",
        "engines": {"ddp": {"steps": [step]}},
        "fed": {"ddp": {"images_per_sec": 6208.0, "extra": ["--augment"]}},
    }
    text = "\n".join(systems.gpu_fed(fed))
    assert "- ddp: fed from packed shards 6,208 images/s" in text
    assert "0.97 of the synthetic 6,400" in text
    assert "- horovod: not in this run." in text
    fed["fed"]["horovod"] = {"error": "Command 'horovodrun' returned 1"}
    text = "\n".join(systems.gpu_fed(fed))
    assert "- horovod: not measured (Command 'horovodrun' returned 1)." in text
    assert "not in this run" not in text


def test_the_page_gives_the_shards_fed_rate_or_says_it_awaits_a_gpu(tmp_path: Path) -> None:
    """Without the trainer's shards-fed rate among the GPU results kept in the repository, the
    page says so and names the command that measures it; with it, it gives the ratio."""
    text = render(tmp_path)
    if _fed_measured(sorted(GPU_RESULTS.glob("*.json"))):
        assert "of the synthetic" in text and "awaits a GPU" not in text
    else:
        assert "awaits a GPU" in text and systems.GPU_COMMAND in text


def test_an_empty_only_runs_no_benchmark_here(tmp_path: Path) -> None:
    """``--only`` with no names runs only the GPU benchmarks, so on a machine without a GPU
    it renders the page from the results already there, running nothing."""
    import torch

    from bench.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine, --only with no names runs the GPU benchmarks (long)")
    results, page = tmp_path / "results", tmp_path / "performance.md"
    assert main(["--only", "--results", str(results), "--output", str(page)]) == 0
    assert list(results.iterdir()) == []
    assert page.read_text().startswith("# Performance")
