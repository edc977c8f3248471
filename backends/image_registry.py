"""The local target's container registry: Debian's ``docker-registry`` (distribution 2.8).

A real OCI registry on loopback, holding its images in a folder of this machine's cache, so an
image pushed once is found by every later build (the tag names the content: an existing tag is
never built again) and by the emulated Batch nodes, which pull from it as Batch nodes pull from
ACR. Several registry processes may serve the same folder (distribution's filesystem storage
supports it). At the configured loopback address the registry is shared by every user on
this machine (a nightly run's build step beside a sensor's, one test worker beside another):
the first to find none there starts it, and the last to leave stops it, so no user's registry
vanishes while another is asking it for a tag or pushing to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from backends.azurite import free_port
from backends.processes import (
    ProcessRecord,
    is_running,
    read_record,
    record_of,
    stop,
    write_record,
)

BINARY = "docker-registry"
MANIFESTS = ", ".join(
    [
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    ]
)


def cache_dir() -> Path:
    """Where the image tools keep their state on this machine (registry, build storage)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retrain-image"


class RegistryError(RuntimeError):
    """The registry cannot be reached or started; the message says which address and why."""


class ImageRegistry:
    """A registry at ``host:port`` spoken to over plain HTTP (loopback only)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _request(self, method: str, path: str) -> int:
        request = urllib.request.Request(
            f"http://{self.address}{path}", method=method, headers={"Accept": MANIFESTS}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def answers(self) -> bool:
        """Whether a registry (the distribution API, /v2/) listens at the address."""
        try:
            request = urllib.request.Request(f"http://{self.address}/v2/")
            with urllib.request.urlopen(request, timeout=5) as response:
                return "Docker-Distribution-Api-Version" in response.headers
        except urllib.error.HTTPError as exc:
            return "Docker-Distribution-Api-Version" in exc.headers
        except OSError:
            return False

    def has_tag(self, repository: str, tag: str) -> bool:
        status = self._request("HEAD", f"/v2/{repository}/manifests/{tag}")
        if status in (200, 404):
            return status == 200
        raise RegistryError(f"registry {self.address}: HEAD {repository}:{tag} answered {status}")


def _config(storage: Path, address: str) -> str:
    return (
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}\n"
    )


def _run_dir() -> Path:
    run_dir = cache_dir() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _await(address: str, running: Callable[[], bool], log_path: Path) -> None:
    """Until the registry just started at ``address`` answers; an error naming the log when it
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


def _start(address: str, storage: Path, config: Path) -> subprocess.Popen[bytes]:
    """``docker-registry`` serving ``storage`` at ``address`` as this process's child."""
    config.write_text(_config(storage, address))
    log_path = _run_dir() / "registry.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log)
    try:
        _await(address, lambda: proc.poll() is None, log_path)
    except RegistryError:
        stop(proc)
        raise
    return proc


# Starts the registry in a session of its own and exits at once, so the registry is no process's
# child: it outlives the user that started it, no signal to that user's group or process tree
# reaches it, and init reaps it. Paths are positional parameters, never part of the script.
_DETACH = '"$0" serve "$1" >>"$2" 2>&1 </dev/null & echo $!'


def _start_shared(address: str, storage: Path, config: Path) -> ProcessRecord:
    """``docker-registry`` serving ``storage`` at ``address`` for every user of the address."""
    config.write_text(_config(storage, address))
    log_path = _run_dir() / "registry.log"
    launched = subprocess.run(
        ["sh", "-c", _DETACH, BINARY, str(config), str(log_path)],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
    )
    record = record_of(int(launched.stdout))
    if record is None:
        raise RegistryError(f"{BINARY} at {address} exited at once: see {log_path}")
    try:
        _await(address, lambda: is_running(record), log_path)
    except RegistryError:
        _stop(record)
        raise
    return record


def _stop(record: ProcessRecord) -> None:
    """SIGTERM the recorded registry if that very process still runs; SIGKILL after 10 s."""
    if not is_running(record):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while is_running(record):
        if time.monotonic() > deadline + 10:
            raise RegistryError(f"{BINARY} (pid {record.pid}) did not end on SIGKILL")
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
        time.sleep(0.05)


def _stop_recorded(pid_file: Path) -> None:
    """Stop the registry the pid file names (a PID alone names nothing: see backends.processes)."""
    record = read_record(pid_file)
    pid_file.unlink(missing_ok=True)
    if record is not None:
        _stop(record)


@contextmanager
def _flocked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def _leased(address: str, storage: Path) -> Iterator[None]:
    """The registry at a loopback ``address`` for as long as any process on this machine uses it.

    Flows on one machine share the configured address (nightly beside a sensor's run, a test
    worker beside another): whoever finds no registry there starts one, and the last user to
    leave stops it, whoever started it. Each user holds a shared lock on the address's users
    file while it uses the registry; the start and the stop are decided under the address's
    gate lock, where leaving user tries the users lock exclusively: only the last one gets it.
    The kernel drops a killed user's locks, so a crash never keeps a registry alive for good:
    the next user finds it running, uses it, and stops it when it leaves.
    """
    name = address.replace(":", "_")
    run_dir = _run_dir()
    gate, pid_file = run_dir / f"registry-{name}.gate", run_dir / f"registry-{name}.pid"
    users = os.open(run_dir / f"registry-{name}.users", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with _flocked(gate):
            fcntl.flock(users, fcntl.LOCK_SH)
            if not ImageRegistry(address).answers():
                _stop_recorded(pid_file)  # one that no longer answers, if it still runs
                config = run_dir / f"registry-{name}.yml"
                write_record(_start_shared(address, storage, config), pid_file)
        yield
    finally:
        with _flocked(gate):
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # others still use it
            else:
                _stop_recorded(pid_file)
            os.close(users)


@contextmanager
def local_registry(address: str | None, storage: Path | None = None) -> Iterator[ImageRegistry]:
    """A registry at ``address`` until the block exits: at a loopback address, one shared with
    every other user of that address on this machine (started when none listens, stopped by the
    last to leave); at another address, the one listening there; with no address, one of this
    block's own on a free loopback port."""
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
    storage = storage or cache_dir() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    if address is not None:
        with _leased(address, storage):
            yield ImageRegistry(address)
        return
    address = f"127.0.0.1:{free_port()}"
    config = _run_dir() / f"registry-{os.getpid()}-{address.replace(':', '_')}.yml"
    proc = _start(address, storage, config)
    try:
        yield ImageRegistry(address)
    finally:
        stop(proc)
        with contextlib.suppress(OSError):
            config.unlink()
