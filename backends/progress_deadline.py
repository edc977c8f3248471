"""How long a training attempt may go without progress before it is ended.

A rank stuck in a collective (a NIC that drops packets, a frozen node, a stopped process) hangs
every other rank in its allreduce, and nothing fails until NCCL's or Gloo's own timeouts, or the
task's maximum run time, hours later. The trainer says ``PROGRESS`` once per epoch; an attempt
whose next epoch takes far longer than its recent ones (or whose first epoch never ends) is
hung, and is ended so that the retry resumes from its last checkpoint. Both clusters (the local
stand-in and Batch) ask this one object when an attempt is overdue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.config import RetryConfig

RECENT_EPOCHS = 3  # the slowest of these sets the bound: one slow epoch is not a stall


class ProgressDeadline:
    """The bound since the attempt's last sign of progress: ``first_epoch_seconds`` until an
    epoch of this attempt ends (start-up, data loading and a whole epoch fit in it), then
    ``factor`` times the slowest of the recent epochs, never under ``floor_seconds``."""

    def __init__(
        self,
        first_epoch_seconds: float,
        factor: float,
        floor_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first_epoch_seconds, self.factor = first_epoch_seconds, factor
        self.floor_seconds, self.clock = floor_seconds, clock
        self._lock = threading.Lock()
        self._durations: deque[float] = deque(maxlen=RECENT_EPOCHS)
        self._since = clock()
        self._epoch: int | None = None
        self._last = False

    @classmethod
    def of(cls, retries: RetryConfig) -> ProgressDeadline:
        return cls(
            retries.stall_first_epoch_seconds, retries.stall_factor, retries.stall_floor_seconds
        )

    def restart(self) -> None:
        """A new attempt starts: it has trained nothing yet, so the first-epoch bound holds."""
        with self._lock:
            self._durations.clear()
            self._since, self._epoch, self._last = self.clock(), None, False

    def progress(self, epoch: int, seconds: float | None, last: bool = False) -> None:
        """An epoch ended (``seconds``: how long it took, when the trainer says). After the
        ``last`` one the trainer scores and exports the model, work no epoch measures: the
        first-epoch bound holds again."""
        with self._lock:
            self._since, self._epoch, self._last = self.clock(), epoch, last
            if seconds is not None and seconds > 0:
                self._durations.append(seconds)

    def bound(self) -> float:
        with self._lock:
            if not self._durations or self._last:
                return self.first_epoch_seconds
            return max(self.floor_seconds, self.factor * max(self._durations))

    def overdue(self) -> str | None:
        """Why the attempt is hung (``no progress for N s after epoch E``), or None."""
        bound = self.bound()
        with self._lock:
            if self.clock() - self._since <= bound:
                return None
            where = (
                f"after epoch {self._epoch}" if self._epoch is not None else "before an epoch ended"
            )
        return f"no progress for {bound:.0f} s {where}"
