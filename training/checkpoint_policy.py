"""When the trainer checkpoints inside an epoch, and the heartbeat orchestrators read.

Besides the checkpoint at each epoch's end, a checkpoint is written every ``--checkpoint-minutes``
and at once when a node of the job is told it will be preempted (``training.preemption``): a
retry then resumes inside the epoch, at the first batch not yet trained, so a preemption costs at
most the interval, or nothing but the notice's seconds. Every rank must checkpoint at the same
batch (the checkpoint gathers every rank's state), so they agree: at agreement points, the same
batch on every rank, one small allreduce sums each rank's votes (its interval is over by its
clock; its node has a notice) and proposals for the next point. The points are spaced to come
about every ``AGREE_SECONDS`` of training, by the batch time the ranks measured, so the
collective costs nothing next to the steps and a notice is acted on within seconds. With neither
an interval nor a notice source, there are no agreement points and nothing changes.

The heartbeat is rank 0's ``HEARTBEAT {json}`` line every ``--heartbeat-seconds``: the epoch, the
batches done and in all, and the seconds since the previous one. Rank 0 passes a batch only
once every rank has passed its gradient exchange, so its heartbeat is the job's progress; the
orchestrator's stall deadline (``backends/progress_deadline.py``) counts it, so a long epoch is
not taken for a hung one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

from training.preemption import Notice

AGREE_SECONDS = 2.0  # training time between two agreement points, about
MAX_AGREE_BATCHES = 10_000
STOP_SECONDS = 5.0  # rank 0 looks for a stop request at most this often


class NoticeSource(Protocol):
    """What hands this node's preemption notices over (training.preemption.PreemptionWatcher)."""

    def take(self) -> Notice | None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Decision:
    """A checkpoint every rank takes now: ``reason`` is "interval", "preemption" or "stop"
    (a stop was requested: training ends at this checkpoint); ``notice`` is set on the ranks
    whose node was notified."""

    reason: str
    notice: Notice | None = None


class CheckpointPolicy:
    """Decides, the same on every rank, at which batches of an epoch to checkpoint.

    ``accumulate``: batches per optimizer step; points fall on step boundaries only, never with
    gradients half accumulated. ``watching``: whether any rank has a ``watcher``. ``clock`` is
    the test's to move."""

    def __init__(
        self,
        minutes: float | None,
        watcher: NoticeSource | None,
        accumulate: int = 1,
        watching: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        agree_seconds: float = AGREE_SECONDS,
        stop: Callable[[], bool] | None = None,
        stop_seconds: float = STOP_SECONDS,
    ) -> None:
        self.interval = minutes * 60 if minutes else None
        self.watcher, self.accumulate, self.clock = watcher, accumulate, clock
        # Whether some rank watches for notices (agreed by the trainer: only one rank per node
        # has the watcher, and every rank must take part in the agreement points).
        self.watching = watcher is not None if watching is None else watching
        self.agree_seconds = agree_seconds
        self._saved = clock()
        self._every = accumulate  # batches between points; the first point comes at once
        self._next = accumulate
        self._mark = (clock(), 0)  # (time, batches done) at the last point
        self._notice: Notice | None = None
        # Whether a stop was requested (``--stop-file``): rank 0 looks, at most once per
        # ``stop_seconds``; every rank votes, so all stop at the same checkpoint.
        self.stop, self.stop_seconds = stop, stop_seconds
        self._stop_looked: float | None = None
        self._stopping = False

    @property
    def active(self) -> bool:
        return self.interval is not None or self.watching

    def start_epoch(self, done: int = 0) -> None:
        """An epoch (re)starts with ``done`` of its batches already trained."""
        self._next = done + self._every
        self._mark = (self.clock(), done)

    def due(self, done: int) -> bool:
        """Whether ranks agree after this batch (``done`` batches of the epoch trained)."""
        return self.active and done >= self._next

    def decide(self, done: int, agree: Callable[[list[float]], list[float]]) -> Decision | None:
        """Vote and agree (``agree`` sums a list across ranks; it is the one collective);
        every rank gets the same answer and the same next point."""
        now = self.clock()
        if self._notice is None and self.watcher is not None:
            self._notice = self.watcher.take()
        late = self.interval is not None and now - self._saved >= self.interval
        looked = self._stop_looked
        if (
            self.stop is not None
            and not self._stopping
            and (looked is None or now - looked >= self.stop_seconds)
        ):
            self._stop_looked, self._stopping = now, self.stop()
        mark_time, mark_done = self._mark
        per_batch = max(now - mark_time, 1e-6) / max(1, done - mark_done)
        proposal = min(float(MAX_AGREE_BATCHES), max(1.0, self.agree_seconds / per_batch))
        late_votes, notices, proposals, ranks, stops = agree(
            [float(late), float(self._notice is not None), proposal, 1.0, float(self._stopping)]
        )
        steps = max(1, int(proposals / ranks) // self.accumulate)
        self._every = steps * self.accumulate
        self._next, self._mark = done + self._every, (now, done)
        if notices > 0:
            notice, self._notice = self._notice, None
            return Decision("preemption", notice)
        if stops > 0:
            return Decision("stop")
        if late_votes > 0:
            return Decision("interval")
        return None

    def saved(self) -> None:
        """A checkpoint was taken (by time, on notice or at an epoch's end): the interval
        starts again."""
        self._saved = self.clock()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()


class Heartbeat:
    """Rank 0's ``HEARTBEAT`` lines: one when training starts and then one after a batch
    whenever ``seconds`` have passed since the last."""

    def __init__(
        self,
        stream: TextIO,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.seconds, self.clock = stream, seconds, clock
        self._last = clock()

    def emit(self, record: dict[str, object]) -> None:
        # One write: a line the checkpoint writer's thread logs must not land inside it.
        self.stream.write("HEARTBEAT " + json.dumps(record) + "\n")
        self.stream.flush()

    def start(self, epoch: int, done: int, batches: int, resumed: dict[str, object]) -> None:
        """Training (re)starts: the end of start-up, for the orchestrator's deadline."""
        self._last = self.clock()
        self.emit({"epoch": epoch, "batch": done, "batches": batches, **resumed})

    def after_batch(self, epoch: int, done: int, batches: int) -> None:
        now = self.clock()
        if now - self._last >= self.seconds:
            self.emit(
                {
                    "epoch": epoch,
                    "batch": done,
                    "batches": batches,
                    "seconds": round(now - self._last, 3),
                }
            )
            self._last = now
