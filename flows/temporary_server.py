"""The temporary Prefect server a command-line run starts when no server is configured.

Without ``PREFECT_API_URL``, Prefect starts an API server of its own in a subprocess for the
run and stops it at exit. Two of its defaults hurt on the machines this project runs on:

- it waits 20 s (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``) for the server to
  answer; a fresh SQLite database's migrations on a busy 2-core machine take longer, and the
  run then dies before its first step with "Timed out while attempting to connect to
  ephemeral Prefect API server";
- its telemetry heartbeat (``PREFECT_SERVER_ANALYTICS_ENABLED``) posts to Prefect's servers,
  and on a machine without internet prints "Failed to send telemetry" (or, with the database
  busy, a 60-line traceback) into the run's terminal.

Both are changed only where the person has not set them (environment or Prefect profile), and
only for a run that starts such a server: a configured server is theirs to set up.

``kept_server`` starts a server that outlives the run, for ``make demo DEMO_ARGS=--keep``: the
run's page stays open in the UI until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Long enough for the migrations of a new database on a loaded 2-core machine (see the README);
# only a server that never answers waits it out in full.
STARTUP_TIMEOUT_SECONDS = 180


def _updates() -> dict[Any, Any]:
    """The settings this module changes, less those the person has set."""
    from prefect.settings import (
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        get_current_settings,
    )

    server = get_current_settings().server
    updates: dict[Any, Any] = {}
    if "startup_timeout_seconds" not in server.ephemeral.model_fields_set:
        updates[PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = STARTUP_TIMEOUT_SECONDS
    if "analytics_enabled" not in server.model_fields_set:
        updates[PREFECT_SERVER_ANALYTICS_ENABLED] = False
    return updates


@contextlib.contextmanager
def temporary_server_settings(say: Callable[[str], None]) -> Iterator[None]:
    """For the block: when no server is configured, say that a temporary one starts and how to
    avoid it, and give it the settings above (the server process inherits them)."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    if PREFECT_API_URL.value():
        yield
        return
    with temporary_settings(updates=_updates()):
        say(
            "no PREFECT_API_URL: starting a temporary Prefect server for this run (up to "
            f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s on a busy machine); "
            "to skip this, keep one running (`prefect server start`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
        yield


@contextlib.contextmanager
def kept_server(port: int, log: Path) -> Iterator[str]:
    """A Prefect server, its UI included, on 127.0.0.1:``port`` for the block; yields its API's
    URL. Unlike the temporary server, it is there for a person to look at the runs it records,
    for as long as the block lasts. It keeps them where the temporary server does (the database
    in Prefect's home, unless one is configured), with the temporary server's settings above.
    It runs in a session of its own: a Ctrl-C in the terminal reaches this process, which then
    stops the server's whole process group in order."""
    env = {**os.environ, **{setting.name: str(value) for setting, value in _updates().items()}}
    prefect = Path(sys.executable).parent / "prefect"
    command = [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}/api"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the Prefect server exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Prefect server did not answer at {url} within "
                    f"{STARTUP_TIMEOUT_SECONDS} s; see {log}"
                )
            time.sleep(0.5)
        yield url
    finally:
        _stop_group(proc)


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
            return int(response.status) == 200
    except (OSError, ValueError):
        return False


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM to the server's process group (the server and the workers it started), then
    SIGKILL after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
