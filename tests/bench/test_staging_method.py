"""How the staging benchmark measures: the server's CPU is counted, the server can be put on
a core of its own and is put back, and a choice's settings are read when it is applied."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import staging.sync
import staging.transfer
from bench.staging import LARGE_CHOICES, _choice, _flushed, apart, server_cpu, servers


@pytest.fixture
def busy_child() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this process that spins on the CPU until killed, with a second thread."""
    code = (
        "import threading\n"
        "def spin():\n"
        "    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "spin()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) < 2:  # both threads started
            assert time.monotonic() < deadline, "the spinning child did not start its thread"
            time.sleep(0.01)
        yield child
    finally:
        child.kill()
        child.wait()


def _affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets of the threads of ``pid`` (a thread that ends meanwhile is left out)."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            found.add(frozenset(os.sched_getaffinity(int(task))))
    return found


@pytest.mark.processes
def test_the_servers_are_this_processes_children_and_their_cpu_counts(
    busy_child: subprocess.Popen[bytes],
) -> None:
    assert busy_child.pid in servers()
    before = server_cpu([busy_child.pid])
    deadline = time.monotonic() + 30  # it spins: however loaded the machine, its time grows
    while server_cpu([busy_child.pid]) - before < 0.1:
        assert time.monotonic() < deadline, "a spinning child's CPU time did not grow"
        time.sleep(0.05)
    assert server_cpu([2**22 + 7]) == 0  # no such process: nothing, no error


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one usable core: nothing to put apart"
)
@pytest.mark.processes
def test_apart_puts_the_server_on_one_core_and_everything_back_after(
    busy_child: subprocess.Popen[bytes],
) -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    first = min(cpus)
    with apart([busy_child.pid]) as done:
        assert done is not None
        assert _affinities(busy_child.pid) == {frozenset({first})}  # every thread of it
        assert _affinities(os.getpid()) == {cpus - {first}}
    assert _affinities(busy_child.pid) == {cpus}
    assert _affinities(os.getpid()) == {cpus}
    with pytest.raises(RuntimeError), apart([busy_child.pid]):  # put back after a failure too
        raise RuntimeError("a measurement failed")
    assert _affinities(os.getpid()) == {cpus} == _affinities(busy_child.pid)


def test_a_choice_that_follows_another_setting_reads_it_when_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging.transfer, "PIECE", 3 << 20)
    chunk = staging.transfer.CHUNK
    with _choice(LARGE_CHOICES["each range received whole (chunk = range)"]):
        assert staging.transfer.CHUNK == 3 << 20 != chunk
    assert chunk == staging.transfer.CHUNK
    with _choice([(staging.sync, "settle", _flushed)]):  # a function is a value like any other
        assert staging.sync.settle is _flushed


def test_a_ratio_is_the_median_of_each_rounds_pair() -> None:
    """The machine slows down half way through: each tool's median lands on a slow round of
    one and a fast round of the other, but each round's pair ran under the same speed."""
    from bench.report import _paired

    m = {
        "step": {"each": {"seconds": [1.0, 1.0, 2.0, 2.0, 2.0], "resync_seconds": [0.5, 0.6]}},
        "rclone": {"each": {"seconds": [1.1, 1.1, 1.1, 2.2, 2.2], "resync_seconds": [0.5]}},
    }
    # Medians: 2.0 s against 1.1 s, "0.55x"; round by round the step is 1.1x rclone's rate.
    assert _paired(m, "seconds", 1 / 2.0, 1 / 1.1, rate=True) == "1.10x"
    # Rounds that do not pair up (or a result from before rounds were kept): the medians.
    assert _paired(m, "resync_seconds", 0.55, 0.5) == "1.10x"
    assert _paired({"step": {}, "rclone": {}}, "seconds", 2.0, 4.0) == "0.50x"
