"""The gate's reads under a time bound (``validation.timeout_minutes``).

Why: a blob the gate cannot finish reading (a storage answer that never ends, a file that
sends a reader into a loop) held the run in the gate for as long as it lasted, the pool's and
the NFS folder's locks with it, and a thread pool's exit waited for the stuck read, so even
SIGTERM did not end the process. Here each read runs in a daemon thread: past the bound the
gate fails naming the blobs still being read, nothing waits for them, and the process can end
(Python cannot stop a thread; a stuck read ends with the process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class GateTimeoutError(RuntimeError):
    """The gate's reads ran past their bound; the message names the blobs still being read."""


def read_within(
    read: Callable[[int], T],
    items: Sequence[int],
    workers: int,
    seconds: float | None,
    name: Callable[[int], str],
) -> list[T]:
    """``read(item)`` for each of ``items`` on ``workers`` daemon threads, in the items'
    order; a read's exception is raised as it is; GateTimeoutError when they are not all done
    within ``seconds`` (None: no bound), naming (``name``) the items still being read."""
    results: dict[int, T] = {}
    reading: dict[int, int] = {}  # thread id -> the item it reads
    failed: list[BaseException] = []
    lock = threading.Lock()
    queue = iter(items)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                item = next(queue, None)
                if item is None:
                    return
                reading[threading.get_ident()] = item
            try:
                value = read(item)
            except BaseException as exc:  # raised in the caller's thread, as a pool would
                with lock:
                    failed.append(exc)
                stop.set()
                return
            with lock:
                results[item] = value
                del reading[threading.get_ident()]

    threads = [
        threading.Thread(target=work, name=f"gate-read-{n}", daemon=True)
        for n in range(min(workers, len(items)))
    ]
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    finally:
        stop.set()  # on a signal, an error, or the deadline: no new read starts
    if failed:
        raise failed[0]
    if any(thread.is_alive() for thread in threads):
        with lock:
            stuck = sorted(reading.values())
            done = len(results)
        names = ", ".join(name(i) for i in stuck[:5]) + (" ..." if len(stuck) > 5 else "")
        raise GateTimeoutError(
            f"{done} of {len(items)} blobs read within {seconds:g} s; still reading: "
            f"{names or 'none (the reads did not start)'}"
        )
    return [results[i] for i in items]
