"""``--profile-steps N``: N training steps recorded by the PyTorch profiler, for TensorBoard.

The trace goes where TensorBoard's profiler view (the ``torch-tb-profiler`` plugin) looks for
it: any folder under the log directory that holds ``<worker>.<timestamp>.pt.trace.json`` files
is one of its runs. Here that is ``<output-dir>/tensorboard/profile/``, beside the run's scalars,
so ``tensorboard --logdir <output-dir>/tensorboard`` shows both; the same file opens in Perfetto
or ``chrome://tracing``. Rank 0 records (it owns every output file; its steps are every rank's,
collectives included), skipping the first two steps: the first pays one-off costs (memory
allocation, cuDNN's algorithm search, compilation) that say nothing about the steady state.

Off by default; off, nothing of the profiler is created, and the training loop asks only
whether there is one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

WAIT_STEPS = 1  # the first step: allocation, cuDNN's search, compilation
WARMUP_STEPS = 1  # the profiler's own start-up, discarded


def trace_dir(output_dir: Path) -> Path:
    """Where a run's profiler traces are written: a run of TensorBoard's profiler view."""
    return output_dir / "tensorboard" / "profile"


def step_profiler(steps: int | None, output_dir: Path, rank: int, device: torch.device) -> Any:
    """A started profiler that records ``steps`` steps after the skipped ones, or None when
    ``steps`` is unset or this is not rank 0. Call ``.step()`` after each training step and
    ``.stop()`` at the end of the epoch (which writes the trace if the epoch was short)."""
    if not steps or rank != 0:
        return None
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(
        activities=activities,
        schedule=schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir(output_dir)), f"rank{rank}"),
        record_shapes=True,
        profile_memory=True,
    )
    profiler.start()
    return profiler
