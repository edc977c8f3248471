"""Azurite, the Azure Storage emulator, as the local target's Blob service.

Started from the copy `make setup` installs into node_modules, on a free loopback port, with
the API-version check off (the SDK speaks a newer version than Azurite knows). The account key
below is Azurite's published development key, not a secret of anyone's: anyone on the machine
can write with it. ``AZURITE_ACCOUNTS`` (``devstoreaccount1:<base64 key>``, Azurite's own
setting, read from the environment, never a command line) gives the account a key of its own
instead, and Azurite then refuses the published one: ``make service`` does so.

One Azurite per data folder. Azurite keeps its blob index in memory and writes it back to the
folder as a whole: two of them on one folder (``make azurite`` and ``make demo`` both use
``.demo/azurite``) each overwrite the other's index, and blobs written through one are gone
once both have stopped. So the folder is locked (a file lock on ``azurite.lock`` in it) before
Azurite starts, and a descriptor of the lock is handed down to Azurite itself: the kernel
holds the lock as long as either process lives (an Azurite left running after its starter was
killed still holds it) and drops it when both are gone, so a stale lock never blocks. The file
names the holder, for the error a second start gets.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout

from backends.local.ports import free_port
from backends.local.processes import stop

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
DEFAULT_PORT = 10000  # Azurite's own default: where `make azurite` serves the local target
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
LOCK_FILE = "azurite.lock"  # in the data folder: whoever holds it runs Azurite on that folder


class FolderInUseError(RuntimeError):
    """Another Azurite runs on the data folder; the message names the folder and the holder."""


ACCOUNTS_ENV = "AZURITE_ACCOUNTS"


def connection_string(port: int, key: str | None = None) -> str:
    """The account's connection string; its key ``key``, else the one ``AZURITE_ACCOUNTS``
    gives it, else the published development key."""
    key = key or account_key()
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
    )


def account_key() -> str:
    """The key ``AZURITE_ACCOUNTS`` gives the account (its first), else the published one."""
    for entry in os.environ.get(ACCOUNTS_ENV, "").split(";"):
        name, _, keys = entry.strip().partition(":")
        if name == ACCOUNT and keys:
            return keys.split(":")[0]
    return DEV_KEY


def _port_free(port: int) -> bool:
    """No listener on the port (connections of a stopped server in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _holder(text: str) -> str:
    """Who holds the folder, from what the holder wrote into the lock file."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return "another process (it recorded nothing about itself)"
    parts = []
    if doc.get("azurite_pid"):
        parts.append(f"Azurite (pid {doc['azurite_pid']}) on 127.0.0.1:{doc.get('port')}")
    parts.append(f"started by pid {doc.get('pid')} ({doc.get('command', '?')})")
    if doc.get("since"):
        parts.append(f"at {doc['since']}")
    return " ".join(parts)


def _lock_folder(location: Path) -> tuple[FileLock, int]:
    """The held lock on ``location``, with a duplicate of its descriptor for Azurite to
    inherit; or FolderInUseError."""
    inherited: list[int] = []
    lock = FileLock(
        location / LOCK_FILE,
        timeout=0,
        preserve_lock_file=True,  # the file names its holder; and no fallback to marker files
        on_acquired=lambda fd: inherited.append(os.dup(fd)),
    )
    try:
        lock.acquire()
    except Timeout:
        holder = _holder((location / LOCK_FILE).read_text(errors="replace"))
        raise FolderInUseError(
            f"Azurite's data folder {location} is in use by {holder}: two Azurites on one "
            "folder overwrite each other's blob index (blobs are lost). Stop that one first "
            "(Ctrl-C in its terminal), or give this one another folder"
        ) from None
    return lock, inherited[-1]


def _describe_holder(location: Path, port: int, azurite_pid: int | None) -> None:
    (location / LOCK_FILE).write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "azurite_pid": azurite_pid,
                "port": port,
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200],
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
            }
        )
    )


@contextmanager
def running_azurite(location: Path, port: int | None = None) -> Iterator[str]:
    """Run Azurite's Blob service until the block exits; yields its connection string.

    Its output goes to ``location/azurite.log``; ``--silent`` turns off its access log, a line
    per request, which would otherwise fill that file (or the terminal of whoever started it:
    a worker's, in the service set-up). The folder is locked for Azurite's life (see the module
    docstring): a second start on it raises FolderInUseError naming the running one."""
    binary = ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} is missing: run `make setup` (npm ci installs Azurite)")
    location = location.resolve()
    location.mkdir(parents=True, exist_ok=True)
    # First: the folder's holder says more than a taken port.
    lock, inherited = _lock_folder(location)
    try:
        if port is None:
            port = free_port()
        elif not _port_free(port):  # else the wait below would find the other server and use it
            raise RuntimeError(
                f"127.0.0.1:{port} is already in use (another Azurite?): stop it or pick "
                "another port"
            )
        _describe_holder(location, port, None)
        with _serve(binary, location, port, inherited) as conn:
            yield conn
    finally:
        os.close(inherited)
        lock.release()


@contextmanager
def _serve(binary: Path, location: Path, port: int, lock_fd: int) -> Iterator[str]:
    log = open(location / "azurite.log", "ab")  # noqa: SIM115  # closed below
    proc = subprocess.Popen(
        [
            str(binary),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(location),
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        pass_fds=(lock_fd,),  # Azurite holds the folder's lock too, for as long as it runs
    )
    try:
        _describe_holder(location, port, proc.pid)
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"Azurite exited with {proc.returncode}; see {location}/azurite.log"
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Azurite did not listen on port {port} within 30 s"
                    ) from None
                time.sleep(0.1)
        yield connection_string(port)
    finally:
        stop(proc)
        log.close()
