"""The progress deadline both clusters end hung training attempts by
(backends/progress_deadline.py), on a clock the test moves."""

from __future__ import annotations

import json

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
    assert deadline.overdue() == "no progress for 100 s before training started"
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


def test_a_new_attempt_and_the_work_after_the_last_epoch_get_the_start_up_bound() -> None:
    clock = Clock()
    deadline = ProgressDeadline(
        first_epoch_seconds=100, factor=3, floor_seconds=10, clock=clock, startup_seconds=900
    )
    deadline.progress(1, 1.0)
    deadline.progress(2, 1.0, last=True)  # scoring and export follow: no heartbeat measures them
    assert deadline.bound() == 900
    deadline.restart()
    clock.now = 50
    assert deadline.bound() == 900 and deadline.overdue() is None
    # An early stop before the cap is a last epoch too; heartbeats before it are progress.
    deadline.observe(line("HEARTBEAT", {"epoch": 3, "batch": 10, "seconds": 1.0}))
    deadline.observe(line("PROGRESS", {"epoch": 3, "epochs": 30, "seconds": 1.0, "stop": False}))
    assert deadline.bound() == 10
    deadline.observe(line("PROGRESS", {"epoch": 4, "epochs": 30, "seconds": 1.0, "stop": True}))
    assert deadline.bound() == 900


def line(kind: str, record: dict[str, object]) -> str:
    return f"{kind} {json.dumps(record)}"


def test_start_up_has_a_bound_of_its_own() -> None:
    clock = Clock()
    deadline = ProgressDeadline(
        first_epoch_seconds=45, factor=3, floor_seconds=10, clock=clock, startup_seconds=600
    )
    clock.now = 599  # an image pulled, data checked: start-up may take its whole bound
    assert deadline.overdue() is None
    deadline.observe(line("HEARTBEAT", {"epoch": 1, "batch": 0, "batches": 5000}))
    clock.now += 45.5  # then the first epoch's own bound
    assert deadline.overdue() == "no progress for 45 s after batch 0 of epoch 1"


def test_a_slow_first_epoch_with_heartbeats_is_not_hung() -> None:
    """Issue 50 item 5: a healthy first epoch of 40 minutes with the bound at 45 s. Each
    heartbeat renews the first bound, then sets one from the intervals measured; the epoch
    ends, and a heartbeat that stops coming is still found."""
    clock = Clock()
    deadline = ProgressDeadline(
        first_epoch_seconds=45, factor=3, floor_seconds=10, clock=clock, startup_seconds=600
    )
    clock.now = 120
    deadline.observe(line("HEARTBEAT", {"epoch": 1, "batch": 0, "batches": 2400}))
    for batch in range(30, 2401, 30):  # 30 batches every 30 s: 40 minutes
        clock.now += 30
        assert deadline.overdue() is None, batch
        deadline.observe(line("HEARTBEAT", {"epoch": 1, "batch": batch, "seconds": 30.0}))
        assert deadline.bound() == 90  # 3 x 30 s
    clock.now += 20
    deadline.observe(line("PROGRESS", {"epoch": 1, "epochs": 3, "seconds": 2400.0}))
    assert deadline.bound() == 7200  # an epoch's length is now among the recent intervals
    deadline.observe(line("HEARTBEAT", {"epoch": 2, "batch": 30, "seconds": 30.0}))
    clock.now += 7200.5
    assert deadline.overdue() == "no progress for 7200 s after batch 30 of epoch 2"


def test_lines_that_are_not_a_record_are_no_progress() -> None:
    clock = Clock()
    deadline = ProgressDeadline(first_epoch_seconds=45, factor=3, floor_seconds=10, clock=clock)
    for text in (
        "epoch 1 batch 50: mean loss so far 0.4",  # a log line, not a heartbeat
        "HEARTBEAT {cut",
        'HEARTBEAT {"epoch": "1", "batch": 3}',
        "PROGRESS [1, 2]",
    ):
        deadline.observe(text)
    clock.now = 45.5
    assert deadline.overdue() == "no progress for 45 s before training started"
    glued = '[rank 1] warning HEARTBEAT {"epoch": 1, "batch": 7, "seconds": 2} and more'
    deadline.observe(glued)
    assert deadline.overdue() is None
