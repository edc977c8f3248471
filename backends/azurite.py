"""Azurite, the Azure Storage emulator, as the local target's Blob service.

Started from the copy `make setup` installs into node_modules, on a free loopback port, with
the API-version check off (the SDK speaks a newer version than Azurite knows). The account key
below is Azurite's published development key, not a secret of anyone's.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def connection_string(port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={DEV_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    """No listener on the port (connections of a stopped server in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextmanager
def running_azurite(location: Path, port: int | None = None) -> Iterator[str]:
    """Run Azurite's Blob service until the block exits; yields its connection string.

    Its output goes to ``location/azurite.log``; ``--silent`` turns off its access log, a line
    per request, which would otherwise fill that file (or the terminal of whoever started it:
    a worker's, in the service set-up)."""
    binary = ROOT / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} is missing: run `make setup` (npm ci installs Azurite)")
    if port is None:
        port = free_port()
    elif not _port_free(port):  # else the wait below would find the other server and use it
        raise RuntimeError(
            f"127.0.0.1:{port} is already in use (another Azurite?): stop it or pick another port"
        )
    location.mkdir(parents=True, exist_ok=True)
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
    )
    try:
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
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
