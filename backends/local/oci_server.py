"""The local target's registry processes: Debian's ``docker-registry`` (distribution 2.8).

A real OCI registry on loopback, holding its images in a folder of this machine's cache, so an
image pushed once is found by every later build (the tag names the content: an existing tag is
never built again) and by the emulated Batch nodes, which pull from it as Batch nodes pull from
ACR. Several registry processes may serve the same folder (distribution's filesystem storage
supports it).

At the configured loopback address one registry serves every user of that cache folder (a
nightly run's build step beside a sensor's, one test worker beside another): the first to find
none there starts it, and the last to leave stops it, whoever started it, so no registry
vanishes while another user asks it for a tag or pushes to it. The address's files under
``<cache>/run`` decide it: a gate lock under which starts and stops are decided, a folder of
users where each user holds a lock file of its own while it uses the registry (the leaving user
that finds no other file there locked is the last), and a record of the registry process (PID
and creation time). The kernel drops a killed user's locks, and the record is written the moment
the process exists, so a user killed at any point leaves a registry the next user will stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

from backends.local.ports import free_port
from backends.local.processes import (
    ProcessRecord,
    is_running,
    read_record,
    record_of,
    stop,
    write_record,
)
from backends.oci import ImageRegistry, RegistryError, cache_dir

BINARY = "docker-registry"


def _config(storage: Path, address: str) -> str:
    # JSON strings are YAML scalars: a path with ': ', ' #' or a newline stays one path.
    return (
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {json.dumps(str(storage))}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {json.dumps(address)}\n"
    )


def _run_dir() -> Path:
    """The cache's run folder, resolved: a registry's command line names its config by this
    path, so users reaching the cache by a link or a relative path still name one file."""
    run_dir = cache_dir() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


def _await(address: str, running: Callable[[], bool], log_path: Path) -> None:
    """Until the registry at ``address`` answers; an error naming the log when the process
    exits first or does not answer within 30 s."""
    registry = ImageRegistry(address)
    deadline = time.monotonic() + 30
    while not registry.answers():
        if not running():
            raise RegistryError(
                f"{BINARY} at {address} exited: see {log_path} (is the port taken?)"
            )
        if time.monotonic() > deadline:
            raise RegistryError(f"{BINARY} at {address} did not answer within 30 s")
        time.sleep(0.1)


@contextmanager
def _private(storage: Path) -> Iterator[ImageRegistry]:
    """A registry of this block's own, a child of this process, on a free loopback port."""
    address = f"127.0.0.1:{free_port()}"
    config = _run_dir() / f"registry-{os.getpid()}-{address.replace(':', '_')}.yml"
    config.write_text(_config(storage, address))
    log_path = _run_dir() / "registry.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log)
    try:
        _await(address, lambda: proc.poll() is None, log_path)
        yield ImageRegistry(address)
    finally:
        stop(proc)
        with contextlib.suppress(OSError):
            config.unlink()


@dataclass(frozen=True)
class _Shared:
    """The files that decide who serves a loopback address, named by its port (``localhost``
    and ``127.0.0.1`` are one address)."""

    address: str
    gate: Path
    users: Path
    record: Path
    config: Path
    log: Path

    @classmethod
    def at(cls, address: str, run_dir: Path) -> _Shared:
        name = run_dir / f"registry-port-{address.rsplit(':', 1)[1]}"
        return cls(
            address,
            gate=name.with_suffix(".gate"),
            users=name.with_suffix(".users.d"),
            record=name.with_suffix(".pid"),
            config=name.with_suffix(".yml"),
            log=run_dir / "registry.log",
        )

    def _serves(self, pid: int) -> bool:
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.Error:
            return False
        return argv == [BINARY, "serve", str(self.config)]

    def ours(self, record: ProcessRecord) -> bool:
        """Whether the record names a running registry serving this address's config: a record
        that matches another live process (a hand-written or copied pid file) names nothing."""
        return is_running(record) and self._serves(record.pid)

    def unrecorded(self) -> ProcessRecord | None:
        """A registry serving this address's config that no record names: one whose user was
        killed or interrupted between its launch and the record, found by its command line."""
        for pid in psutil.pids():
            if self._serves(pid):
                record = record_of(pid)
                if record is not None and is_running(record):
                    return record
        return None


# Starts the registry in a session of its own and exits at once, so the registry is no process's
# child: it outlives the user that started it, no signal to that user's group or process tree
# reaches it, and init reaps it. Paths are positional parameters, never part of the script.
_DETACH = '"$0" serve "$1" >>"$2" 2>&1 </dev/null & echo $!'


def _start(shared: _Shared, storage: Path) -> None:
    shared.config.write_text(_config(storage, shared.address))
    launched = subprocess.run(
        ["sh", "-c", _DETACH, BINARY, str(shared.config), str(shared.log)],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        # Its own: no user's folder is kept busy, and no user's variables (secrets, REGISTRY_*
        # overrides) reach a process every user shares.
        cwd="/",
        env={"PATH": os.environ.get("PATH", os.defpath)},
    )
    record = record_of(int(launched.stdout))
    if record is None:
        raise RegistryError(f"{BINARY} at {shared.address} exited at once: see {shared.log}")
    write_record(record, shared.record)
    try:
        _await(shared.address, lambda: shared.ours(record), shared.log)
    except BaseException:
        _stop_recorded(shared)
        raise


def _stop_recorded(shared: _Shared) -> None:
    """SIGTERM the recorded registry, SIGKILL after 10 s; the record goes once it has ended."""
    record = read_record(shared.record)
    if record is not None and shared.ours(record):
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(record.pid)
            process.terminate()
            try:
                process.wait(10)
            except psutil.TimeoutExpired:
                process.kill()
                try:
                    process.wait(10)
                except psutil.TimeoutExpired:
                    raise RegistryError(
                        f"{BINARY} (pid {record.pid}) did not end on SIGKILL"
                    ) from None
    shared.record.unlink(missing_ok=True)


def _serve(shared: _Shared, storage: Path) -> None:
    """Make sure a registry answers at the address (called under the gate)."""
    record = read_record(shared.record)
    if record is None or not shared.ours(record):
        # A launch cut short before its record was written: adopted, so the last user stops it.
        record = shared.unrecorded()
        if record is not None:
            write_record(record, shared.record)
    if ImageRegistry(shared.address).answers():
        return
    if record is not None and shared.ours(record):
        # Ours, running, not answering yet (starting, or slow under load): other users may be
        # in the middle of a push to it, so it is waited for, never replaced.
        running = record
        with contextlib.suppress(RegistryError):
            _await(shared.address, lambda: shared.ours(running), shared.log)
        if ImageRegistry(shared.address).answers():
            return
        if shared.ours(running):
            raise RegistryError(
                f"{BINARY} at {shared.address} (pid {running.pid}) runs but does not answer: "
                f"see {shared.log}"
            )
    _start(shared, storage)


def _last_to_leave(users: Path, own: Path) -> bool:
    """Whether no other user holds the address: every other user's lock file is free (a file
    left by a killed user is removed on the way)."""
    for other in users.glob("*.lock"):
        if other == own:
            continue
        lock = FileLock(other, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return False
        lock.release()
        other.unlink(missing_ok=True)
    return True


@contextmanager
def _leased(address: str, storage: Path) -> Iterator[ImageRegistry]:
    shared = _Shared.at(address, _run_dir())
    shared.users.mkdir(exist_ok=True)
    mine = FileLock(shared.users / f"{os.getpid()}-{uuid.uuid4().hex}.lock")
    mine.acquire()
    try:
        with FileLock(shared.gate):
            _serve(shared, storage)
        yield ImageRegistry(address)
    finally:
        try:
            with FileLock(shared.gate):
                if _last_to_leave(shared.users, Path(mine.lock_file)):
                    _stop_recorded(shared)
        finally:
            mine.release()
            Path(mine.lock_file).unlink(missing_ok=True)


@contextmanager
def local_registry(address: str | None, storage: Path | None = None) -> Iterator[ImageRegistry]:
    """A registry at ``address`` until the block exits: at a loopback address, the one shared by
    every user of this cache folder (started when none answers, stopped by the last to leave);
    at another address, the one listening there; with no address, one of this block's own."""
    if address is not None:
        host = address.rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost"):
            found = ImageRegistry(address)
            if found.answers():
                yield found
                return
            raise RegistryError(
                f"image.registry {address}: no registry answers there, and only a loopback "
                "address can be served from here (127.0.0.1:PORT)"
            )
    if shutil.which(BINARY) is None:
        raise RegistryError(
            f"{BINARY} is not installed: `make setup` installs it as root "
            "(apt-get install docker-registry)"
        )
    storage = (storage or cache_dir() / "registry").resolve()  # the registry runs in /
    storage.mkdir(parents=True, exist_ok=True)
    context = _private(storage) if address is None else _leased(address, storage)
    with context as registry:
        yield registry
