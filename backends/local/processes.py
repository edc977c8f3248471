"""Which process a pid file names: a PID alone is not an identity.

A pid file outlives its process when the program that wrote it is killed, and the kernel hands
the same PID to another process later: a PID read back from such a file may name anything. So a
record holds the PID with the process's creation time (psutil's, which moves with every boot),
and names a live process only while both still match. A process that cannot be identified is
never taken as live, so nothing is ever signalled on its word.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from common.atomic import atomic_write_json

# The kernel counts a process's start in clock ticks (1/100 s): two reads of one process's
# creation time agree to that, and a later process given the same PID started in a later tick.
# A wall clock stepped between the reads moves psutil's figure (it adds the boot time), and the
# process then names nothing: the safe side, as nothing is signalled on an unverified word.
_TICK = 0.005


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    created: float  # psutil's create_time: seconds since the epoch


def record_of(pid: int) -> ProcessRecord | None:
    """The identity of a live process, or None when it has ended (or cannot be identified)."""
    try:
        return ProcessRecord(pid, psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def write_record(record: ProcessRecord, path: Path) -> None:
    atomic_write_json(asdict(record), path)


def read_record(path: Path) -> ProcessRecord | None:
    """The record in a pid file; None for a missing file or one in any other form (a bare PID,
    or a record of an older version, cannot be verified, so it names nothing)."""
    try:
        data = json.loads(path.read_text())
        return ProcessRecord(int(data["pid"]), float(data["created"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _process(record: ProcessRecord) -> psutil.Process | None:
    """The recorded process while it is the one recorded (same PID, created at the same time)."""
    found = record_of(record.pid)
    if found is None or abs(found.created - record.created) >= _TICK:
        return None
    with contextlib.suppress(psutil.Error):
        return psutil.Process(record.pid)
    return None


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process itself exists (a zombie included)."""
    return _process(record) is not None


def is_running(record: ProcessRecord) -> bool:
    """Alive and not a zombie: a process that has exited but whose parent has not reaped it
    yet still has its /proc entry, and holds nothing (its ports and locks are free)."""
    process = _process(record)
    try:
        return process is not None and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_group(record: ProcessRecord) -> bool:
    """SIGKILL the process group the recorded process leads, if that process still exists.

    The group is signalled only after its leader is verified; a leader that has ended takes
    its word with it (its PID may already belong to someone else's process).
    """
    if not is_alive(record):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record.pid, signal.SIGKILL)
    return True


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """End a server this process started: SIGTERM, so it can flush and close what it holds
    (Azurite its data folder, the registry its uploads), then SIGKILL after ``grace`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
