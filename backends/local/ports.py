"""A free port for a server this process starts a little later (Azurite, a registry, a relay).

Why not port 0's: the kernel hands out a port 0 bind from its ephemeral range, and the port is
free only at that moment. Until the server binds it (seconds for Azurite, a minute and more
for the service's relay, started after Azurite and Prefect), the kernel may give the same port
to the local end of any outgoing connection, or to any other port 0 bind: the server then
fails to start, "already in use". Ports below that range the kernel gives out only when asked
for by number, so here one is picked there, checked free, and reserved with a lock file held
until this process ends, so that two processes picking at once (test workers, a demo beside
a test run) do not take the same one.
"""

from __future__ import annotations

import random
import socket
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

LOCKS = Path(tempfile.gettempdir()) / "retrain-ports"
LOWEST = 10_000  # below: ports well-known services use
_held: list[FileLock] = []  # the reservations: held as long as this process


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free on 127.0.0.1, outside the kernel's ephemeral range, that no other process
    picking here holds; port 0's where that range leaves no room below it."""
    low, _ = ephemeral_range()
    if low - LOWEST < 1_000:
        return _kernels()
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(LOWEST, low)
        if _reserved(port) and _bindable(port):
            return port
    raise RuntimeError(f"no free port between {LOWEST} and {low} after 200 tries")


def _reserved(port: int) -> bool:
    """Whether this process now holds the port's lock file (True where locks cannot be kept:
    the bind check alone then stands)."""
    lock = FileLock(LOCKS / f"{port}.lock", timeout=0, mode=0o666)
    try:
        LOCKS.mkdir(mode=0o1777, exist_ok=True)
        lock.acquire()
    except Timeout:
        return False
    except OSError:
        return True
    _held.append(lock)
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernels() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
