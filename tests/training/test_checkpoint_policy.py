"""When the trainer checkpoints inside an epoch (training/checkpoint_policy.py), on clocks the
test moves: by time, on a preemption notice, and the same batch on every rank, whichever rank
saw the notice or ran out of time. The ranks are threads here, their one collective a sum
through a barrier, as an allreduce returns the same sum to every rank."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable

import pytest

from training.checkpoint_policy import CheckpointPolicy, Decision, Heartbeat
from training.preemption import Notice


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Notices:
    """A node's notices as the watcher hands them over: each once."""

    def __init__(self, *notices: Notice) -> None:
        self.left = list(notices)
        self.stopped = False

    def take(self) -> Notice | None:
        return self.left.pop(0) if self.left else None

    def stop(self) -> None:
        self.stopped = True


NOTICE = Notice("E1", ("node-1",), "Scheduled", "Mon, 19 Sep 2016 18:29:47 GMT", 0.0)


def alone(votes: list[float]) -> list[float]:
    return votes  # one rank: the sum is its own votes


class Allreduce:
    """A sum across ``ranks`` threads: every caller gets the same totals."""

    def __init__(self, ranks: int) -> None:
        self.parts: dict[int, list[float]] = {}
        self.barrier = threading.Barrier(ranks)

    def of(self, rank: int) -> Callable[[list[float]], list[float]]:
        def agree(votes: list[float]) -> list[float]:
            self.parts[rank] = votes
            self.barrier.wait()
            total = [sum(col) for col in zip(*self.parts.values(), strict=True)]
            self.barrier.wait()
            return total

        return agree


def test_without_an_interval_or_notices_nothing_is_agreed() -> None:
    policy = CheckpointPolicy(None, None, clock=Clock())
    assert not policy.active
    assert not any(policy.due(done) for done in range(1, 1000))


def test_a_checkpoint_by_time_at_the_first_point_after_the_interval() -> None:
    clock = Clock()
    policy = CheckpointPolicy(1.0, None, clock=clock, agree_seconds=2.0)  # 60 s
    policy.start_epoch()
    assert policy.due(1)  # the first point comes at once, to measure the batches
    clock.now = 0.1
    assert policy.decide(1, alone) is None
    # 0.1 s a batch: the next point 2 s of training later, 20 batches on.
    assert not policy.due(20) and policy.due(21)
    clock.now = 2.1
    assert policy.decide(21, alone) is None
    clock.now = 60.5  # the interval is over by the next point
    assert policy.decide(41, alone) == Decision("interval")
    policy.saved()
    clock.now = 62.5
    assert policy.decide(61, alone) is None  # the interval starts again from the checkpoint


def test_points_fall_on_whole_steps_with_accumulated_gradients() -> None:
    clock = Clock()
    policy = CheckpointPolicy(1.0, None, accumulate=4, clock=clock, agree_seconds=2.0)
    policy.start_epoch(8)  # resumed with 8 batches of the epoch done
    assert not policy.due(11) and policy.due(12)
    clock.now = 0.3
    policy.decide(12, alone)  # 0.075 s a batch: 26.7 batches, 6 whole steps of 4
    assert not policy.due(35) and policy.due(36)


def test_every_rank_checkpoints_when_one_rank_is_notified() -> None:
    """Only rank 1's node got the notice; both ranks take the checkpoint at the same batch, and
    agree on the same next point although their batches took different times."""
    clocks = [Clock(), Clock()]
    sources = [Notices(), Notices(NOTICE)]
    policies = [
        CheckpointPolicy(None, sources[r], watching=True, clock=clocks[r], agree_seconds=2.0)
        for r in range(2)
    ]
    allreduce = Allreduce(2)
    decisions: dict[int, Decision | None] = {}

    def rank(r: int) -> None:
        policies[r].start_epoch()
        clocks[r].now = 0.1 * (r + 1)  # 0.1 s a batch on rank 0, 0.2 s on rank 1
        decisions[r] = policies[r].decide(1, allreduce.of(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert decisions[1] == Decision("preemption", NOTICE)
    assert decisions[0] == Decision("preemption", None)  # the checkpoint, not the notice
    # Proposals of 20 and 10 batches: both ranks' next point is at their mean, 15 on.
    assert [p.due(15) for p in policies] == [False, False]
    assert [p.due(16) for p in policies] == [True, True]
    policies[1].close()
    assert sources[1].stopped


def test_a_notice_is_acted_on_once() -> None:
    clock = Clock()
    policy = CheckpointPolicy(None, Notices(NOTICE), clock=clock)
    clock.now = 1.0
    assert policy.decide(1, alone) == Decision("preemption", NOTICE)
    clock.now = 2.0
    assert policy.decide(2, alone) is None


@pytest.mark.parametrize("late_rank", [0, 1])
def test_the_interval_ends_for_all_when_it_ends_for_one(late_rank: int) -> None:
    clocks = [Clock(), Clock()]
    policies = [CheckpointPolicy(0.5, None, clock=clocks[r]) for r in range(2)]
    allreduce = Allreduce(2)
    decisions: dict[int, Decision | None] = {}

    def rank(r: int) -> None:
        clocks[r].now = 31.0 if r == late_rank else 29.0  # one clock is ahead
        decisions[r] = policies[r].decide(1, allreduce.of(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert decisions == {0: Decision("interval"), 1: Decision("interval")}


def test_a_stop_request_ends_the_epoch_at_a_checkpoint_on_every_rank() -> None:
    """The budget's stop (``--stop-file``), which only rank 0 looks for, and no more than once
    per ``stop_seconds``: every rank checkpoints at the same point and stops there."""
    clocks, looked = [Clock(), Clock()], []
    requested = {"now": False}

    def stop() -> bool:
        looked.append(clocks[0].now)
        return requested["now"]

    policies = [
        CheckpointPolicy(60.0, None, clock=clocks[0], stop=stop, stop_seconds=5.0),
        CheckpointPolicy(60.0, None, clock=clocks[1]),
    ]
    allreduce = Allreduce(2)

    def point(now: float, done: int) -> dict[int, Decision | None]:
        decisions: dict[int, Decision | None] = {}

        def rank(r: int) -> None:
            clocks[r].now = now
            decisions[r] = policies[r].decide(done, allreduce.of(r))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        return decisions

    assert point(1.0, 1) == {0: None, 1: None}
    requested["now"] = True
    assert point(3.0, 20) == {0: None, 1: None}  # not looked again yet: 2 s since
    assert point(6.5, 40) == {0: Decision("stop"), 1: Decision("stop")}
    assert looked == [1.0, 6.5]


def test_heartbeats_say_the_batches_done_every_few_seconds() -> None:
    clock, out = Clock(), io.StringIO()
    beat = Heartbeat(out, seconds=10, clock=clock)
    beat.start(2, 40, 100, {"resumed_from": 1})
    for done in range(41, 101):
        clock.now += 0.5
        beat.after_batch(2, done, 100)
    lines = [json.loads(line.removeprefix("HEARTBEAT ")) for line in out.getvalue().splitlines()]
    assert lines[0] == {"epoch": 2, "batch": 40, "batches": 100, "resumed_from": 1}
    assert [b["batch"] for b in lines[1:]] == [60, 80, 100]
    assert all(b["seconds"] == 10.0 for b in lines[1:])
