"""``--profile-steps``: the steps recorded under either engine, read back the way TensorBoard's
profiler view reads them (the torch-tb-profiler plugin's own run discovery and loader)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch_tb_profiler import utils as plugin_utils
from torch_tb_profiler.io.cache import Cache
from torch_tb_profiler.profiler.loader import RunLoader

from tests.conftest import ENGINES_REPEATED, run_trainer


def _plugin_runs(logdir: Path) -> list[Path]:
    """The folders the plugin shows as runs: those holding a PyTorch trace file."""
    return [
        Path(root)
        for root, _, files in os.walk(logdir)
        if any(plugin_utils.is_chrome_trace_file(f) for f in files)
    ]


@pytest.mark.processes
@pytest.mark.parametrize("engine", ENGINES_REPEATED)
def test_profiled_steps_open_in_tensorboards_profiler_view(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("--epochs", "2", "--batch-size", "16", "--profile-steps", "3")
    result = run_trainer(1, "synthetic:300", out, *args, engine=engine)
    assert result.returncode == 0, result.output
    logdir = out / "tensorboard"
    assert list(logdir.glob("events.out.tfevents.*"))  # the scalars, beside the trace
    (run_dir,) = _plugin_runs(logdir)
    assert run_dir == logdir / "profile"
    assert [p.name.split(".")[0] for p in run_dir.iterdir()] == ["rank0"]  # one trace, epoch 1
    with Cache() as cache:
        run = RunLoader(run_dir.name, str(run_dir), cache).load()
    assert "rank0" in run.workers  # (DDP's collectives add the plugin's distributed view, "All")
    (span,) = run.get_spans("rank0")
    profile = run.get_profile("rank0", span)
    assert {"Overview", "Operator", "Trace", "Memory"} <= {v.display_name for v in profile.views}
    # the two steps skipped (first step, profiler warm-up), then the three recorded
    assert [row[0] for row in profile.overview["steps"]["rows"]] == ["2", "3", "4"]


@pytest.mark.processes
def test_no_trace_unless_asked(tmp_path: Path) -> None:
    result = run_trainer(
        1, "synthetic:100", tmp_path / "out", "--epochs", "1", "--batch-size", "16"
    )
    assert result.returncode == 0, result.output
    assert not (tmp_path / "out" / "tensorboard" / "profile").exists()
    assert _plugin_runs(tmp_path / "out" / "tensorboard") == []
