"""Two processes on one folder: Azurite's data folder, and the NFS folder of pipelines that
share it. Whatever the second one is (another Azurite, another pipeline with a pool of its
own), it waits or is refused, naming the holder, and nothing the first one stored is lost; a
holder that died never blocks. Recorded for docs/reliability.md ("Adversarial inputs").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from backends.azurite import FolderInUseError, free_port, running_azurite
from staging.blob import API_VERSION
from tests.conftest import ROOT, child_env
from tests.reliability import report

# ---------------------------------------------------------------------------- Azurite


def _container(connection_string: str) -> ContainerClient:
    return ContainerClient.from_connection_string(
        connection_string, "kept", api_version=API_VERSION
    )


HOLD_AZURITE = """
import sys, time
from pathlib import Path
from backends.azurite import running_azurite
with running_azurite(Path(sys.argv[1])):
    print("serving", flush=True)
    time.sleep(600)
"""


@contextmanager
def _azurite_in_another_process(location: Path) -> Iterator[subprocess.Popen[str]]:
    """A process of its own (and session: its Azurite child goes with a group kill) running
    Azurite on ``location`` until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_AZURITE, str(location)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_second_azurite_on_one_data_folder_is_refused_and_no_blob_is_lost(
    tmp_path: Path,
) -> None:
    """``make azurite`` runs; ``make demo`` (or a second ``make azurite`` on another port)
    starts on the same folder. It must be refused, naming the folder and the running one: two
    Azurites on one folder overwrite each other's blob index, and the blobs written through the
    first were gone once both had stopped."""
    location = tmp_path / "demo" / "azurite"
    with running_azurite(location) as first:
        container = _container(first)
        container.create_container()
        container.upload_blob("images/0.png", b"written through the first Azurite")
        spelled = tmp_path / "demo" / ".." / "demo" / "azurite"  # another spelling, one folder
        with pytest.raises(FolderInUseError) as refused, running_azurite(spelled):
            pass
        message = str(refused.value)
        assert str(location) in message and f"started by pid {os.getpid()}" in message
        # The user's spelling of it: `make azurite` (scripts/demo.py --serve-storage) on the
        # folder, another port.
        cli = subprocess.run(
            [
                sys.executable,
                "scripts/demo.py",
                "--serve-storage",
                "--dir",
                str(tmp_path / "demo"),
                "--port",
                str(free_port()),
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli.returncode == 2, cli.stdout + cli.stderr
        assert f"Azurite's data folder {location} is in use by Azurite (pid" in cli.stderr
        assert "Traceback" not in cli.stderr and "seeded" not in cli.stdout
    with running_azurite(location) as again:  # the folder is free once the first has stopped
        kept = _container(again).download_blob("images/0.png").readall()
    assert kept == b"written through the first Azurite"
    report.record(
        "adversarial",
        "a second Azurite on one data folder (make azurite, then make demo)",
        "refused, naming the folder and the running Azurite; the first one's blobs kept",
        message=message,
    )


def test_an_azurite_outliving_its_starter_keeps_the_folder_and_a_dead_one_frees_it(
    tmp_path: Path,
) -> None:
    """The lock lives as long as Azurite does, not only its starter: a starter killed with its
    Azurite left running still holds the folder (that Azurite still writes there); once both
    are gone, nothing stale blocks the next start."""
    location = tmp_path / "azurite"
    with _azurite_in_another_process(location) as starter:
        azurite_pid = int(
            subprocess.run(
                ["pgrep", "-P", str(starter.pid)], capture_output=True, text=True, check=True
            ).stdout.split()[0]
        )
        os.kill(starter.pid, signal.SIGKILL)  # the starter only: its Azurite runs on
        starter.wait()
        held = f"Azurite \\(pid {azurite_pid}\\)"
        with pytest.raises(FolderInUseError, match=held), running_azurite(location):
            pass
        os.kill(azurite_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{azurite_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # an orphan is reaped by init, not by us
    with running_azurite(location) as conn:  # the dead holders' lock file is still there
        assert _container(conn).create_container()
    report.record(
        "adversarial",
        "Azurite's starter killed, Azurite left running; then both killed",
        "the folder stays locked while that Azurite runs; free once it is gone (no stale lock)",
    )
