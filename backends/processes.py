"""Which process a pid file names: a PID alone is not an identity.

A pid file outlives its process when the program that wrote it is killed, and the kernel hands
the same PID to another process later: a PID read back from such a file may name anything. So
a record holds the PID with the process's start time (``/proc/<pid>/stat``, in clock ticks since
boot) and the boot id; the record names a live process only while all three still match.
Without ``/proc`` nothing can be verified, and nothing is: a record is then never taken as live,
so nothing is ever signalled on its word.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from training.atomic import atomic_write_json

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    start: int  # clock ticks after boot, field 22 of /proc/<pid>/stat
    boot: str


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 onwards of /proc/<pid>/stat (``[0]`` is field 3, the state)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    return stat[stat.rindex(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return None


def record_of(pid: int) -> ProcessRecord | None:
    """The identity of a live process, or None when it has ended (or cannot be identified)."""
    start, boot = _start_time(pid), _boot_id()
    if start is None or boot is None:
        return None
    return ProcessRecord(pid, start, boot)


def write_record(record: ProcessRecord, path: Path) -> None:
    atomic_write_json(asdict(record), path)


def read_record(path: Path) -> ProcessRecord | None:
    """The record in a pid file; None for a missing file or one in any other form (a bare PID
    written by an older version cannot be verified, so it names nothing)."""
    try:
        data = json.loads(path.read_text())
        return ProcessRecord(int(data["pid"]), int(data["start"]), str(data["boot"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def is_alive(record: ProcessRecord) -> bool:
    """True while the recorded process itself runs: same PID, same start time, same boot."""
    return record_of(record.pid) == record


def is_running(record: ProcessRecord) -> bool:
    """Alive and not a zombie: a process that has exited but whose parent has not reaped it
    yet still has its /proc entry, and holds nothing (its ports and locks are free)."""
    fields = _stat_fields(record.pid) if is_alive(record) else None
    return fields is not None and fields[0] != "Z"


def kill_group(record: ProcessRecord) -> bool:
    """SIGKILL the process group the recorded process leads, if that process still runs.

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
