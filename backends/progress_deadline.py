"""How long a training attempt may go without progress before it is ended.

A rank stuck in a collective (a NIC that drops packets, a frozen node, a stopped process) hangs
every other rank in its allreduce, and nothing fails until NCCL's or Gloo's own timeouts, or the
task's maximum run time, hours later. The trainer says what it does on stdout: a ``HEARTBEAT``
line when training starts and then every few seconds of training (the batches done), and a
``PROGRESS`` line at each epoch's end. Each of them is progress. An attempt is hung when the next
sign takes far longer than the recent ones did, or, before any was measured, longer than a
bound of its own:

- start-up (``stall_startup_seconds``): from the attempt's start to the trainer's first line
  (node preparation, the data opened and checked, the model built, a checkpoint loaded);
- the first measured progress (``stall_first_epoch_seconds``): from then to the first heartbeat
  or epoch end; each heartbeat renews it, so a first epoch may take as long as its batches need
  (it grows with the data), while a first epoch that stops is still found;
- after that, ``factor`` times the slowest of the recent intervals (heartbeats' and epochs'),
  never under ``floor_seconds``;
- after the last epoch (the cap's, or the one an early stop ended on: ``"stop": true``),
  start-up's bound again: the test split scored, the model exported and checked, work no
  heartbeat measures.

Both clusters (the local stand-in and Batch) ask this one object when an attempt is overdue;
the training step hands it every line of the task's output (:meth:`ProgressDeadline.observe`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.config import RetryConfig

RECENT = 3  # the slowest of these intervals sets the bound: one slow interval is not a stall


def trainer_record(line: str, kind: str) -> dict[str, Any] | None:
    """The record of a trainer's ``<kind> {json}`` line (PROGRESS, HEARTBEAT), or None where it
    cannot be read. Text either side of the object is ignored: the line is a log line, and a
    line glued to it by another writer on the same pipe must not fail a training going well."""
    try:
        record, _ = json.JSONDecoder().raw_decode(line.split(f"{kind} ", 1)[1])
    except (IndexError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


class ProgressDeadline:
    """The bound since the attempt's last sign of progress (the module docstring's phases)."""

    def __init__(
        self,
        first_epoch_seconds: float,
        factor: float,
        floor_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        startup_seconds: float | None = None,
    ) -> None:
        self.first_epoch_seconds, self.factor = first_epoch_seconds, factor
        self.floor_seconds, self.clock = floor_seconds, clock
        self.startup_seconds = first_epoch_seconds if startup_seconds is None else startup_seconds
        self._lock = threading.Lock()
        self._durations: deque[float] = deque(maxlen=RECENT)
        self._since = clock()
        self._epoch: int | None = None
        self._batch: int | None = None
        self._started = False
        self._last = False

    @classmethod
    def of(cls, retries: RetryConfig) -> ProgressDeadline:
        return cls(
            retries.stall_first_epoch_seconds,
            retries.stall_factor,
            retries.stall_floor_seconds,
            startup_seconds=retries.stall_startup_seconds,
        )

    def restart(self) -> None:
        """A new attempt starts: it has trained nothing yet, so start-up's bound holds."""
        with self._lock:
            self._durations.clear()
            self._since, self._epoch, self._batch = self.clock(), None, None
            self._started = self._last = False

    def observe(self, line: str) -> None:
        """One line of the task's output: a ``HEARTBEAT`` or ``PROGRESS`` line is progress."""
        if "HEARTBEAT " in line and (beat := trainer_record(line, "HEARTBEAT")) is not None:
            epoch, batch = beat.get("epoch"), beat.get("batch")
            if isinstance(epoch, int) and isinstance(batch, int):
                self.heartbeat(epoch, batch, _seconds(beat.get("seconds")))
        elif "PROGRESS " in line and (record := trainer_record(line, "PROGRESS")) is not None:
            epoch = record.get("epoch")
            if isinstance(epoch, int):
                # The cap, or an early stop: the trainer scores and exports next.
                last = epoch == record.get("epochs") or record.get("stop") is True
                self.progress(epoch, _seconds(record.get("seconds")), last=last)

    def heartbeat(self, epoch: int, batch: int, seconds: float | None) -> None:
        """Training started (``seconds`` None), or goes on: ``batch`` of ``epoch`` done,
        ``seconds`` after the previous heartbeat."""
        with self._lock:
            self._since, self._epoch, self._batch = self.clock(), epoch, batch
            self._started, self._last = True, False
            if seconds is not None:
                self._durations.append(seconds)

    def progress(self, epoch: int, seconds: float | None, last: bool = False) -> None:
        """An epoch ended (``seconds``: how long it took, when the trainer says). After the
        ``last`` one the trainer scores and exports the model, work no heartbeat measures:
        start-up's bound holds again."""
        with self._lock:
            self._since, self._epoch, self._batch = self.clock(), epoch, None
            self._started, self._last = True, last
            if seconds is not None:
                self._durations.append(seconds)

    def bound(self) -> float:
        with self._lock:
            if not self._started or self._last:
                return self.startup_seconds
            if not self._durations:
                return self.first_epoch_seconds
            return max(self.floor_seconds, self.factor * max(self._durations))

    def overdue(self) -> str | None:
        """Why the attempt is hung (``no progress for N s after epoch E``), or None."""
        bound = self.bound()
        with self._lock:
            if self.clock() - self._since <= bound:
                return None
            if not self._started:
                where = "before training started"
            elif self._epoch is None:
                where = "before an epoch ended"
            elif self._batch is not None:
                where = f"after batch {self._batch} of epoch {self._epoch}"
            else:
                where = f"after epoch {self._epoch}"
        return f"no progress for {bound:.0f} s {where}"
