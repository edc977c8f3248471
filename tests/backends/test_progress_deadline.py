"""The progress deadline both clusters end hung training attempts by
(backends/progress_deadline.py), on a clock the test moves."""

from __future__ import annotations

from backends.progress_deadline import ProgressDeadline


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bound_follows_the_slowest_recent_epoch_with_a_floor() -> None:
    clock = Clock()
    deadline = ProgressDeadline(first_epoch_seconds=100, factor=3, floor_seconds=10, clock=clock)
    clock.now = 100
    assert deadline.overdue() is None  # the first epoch may take the whole first bound
    clock.now = 100.5
    assert deadline.overdue() == "no progress for 100 s before an epoch ended"
    deadline.progress(1, 2.0)  # fast epochs: the floor holds
    clock.now += 10.5
    assert deadline.overdue() == "no progress for 10 s after epoch 1"
    for epoch, seconds in ((2, 20.0), (3, 5.0), (4, 5.0)):
        deadline.progress(epoch, seconds)
    assert deadline.bound() == 60  # 3 x the slowest of the last three (20 s)
    for epoch in (5, 6, 7):
        deadline.progress(epoch, 5.0)
    assert deadline.bound() == 15  # the slow epoch is no longer recent
    clock.now += 15.5
    assert deadline.overdue() == "no progress for 15 s after epoch 7"


def test_a_new_attempt_and_the_work_after_the_last_epoch_get_the_first_bound() -> None:
    clock = Clock()
    deadline = ProgressDeadline(first_epoch_seconds=100, factor=3, floor_seconds=10, clock=clock)
    deadline.progress(1, 1.0)
    deadline.progress(2, 1.0, last=True)  # scoring and export follow: no epoch measures them
    assert deadline.bound() == 100
    deadline.restart()
    clock.now = 50
    assert deadline.bound() == 100 and deadline.overdue() is None
