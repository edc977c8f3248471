"""The quick suite's promise, checked by running it: a test left unmarked that starts a process
or a server, itself or through a fixture, fails and names the marker it needs."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tests.conftest import ROOT, child_env

QUICK = ("-m", "quick", "-rA")
PROBE = """
import socket
import subprocess

import pytest


@pytest.fixture(scope="session")
def launched():
    subprocess.run(["true"], check=True)


def test_runs_a_program():
    subprocess.run(["true"], check=True)


def test_serves():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_through_a_session_fixture(launched):
    pass


def test_computes():
    assert sum(range(4)) == 6


@pytest.mark.processes
def test_marked():
    subprocess.run(["true"], check=True)
"""


@pytest.mark.processes
def test_a_unit_test_that_starts_something_fails_naming_the_marker() -> None:
    probe = ROOT / "tests" / f"test_probe_{uuid.uuid4().hex}.py"
    probe.write_text(PROBE)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUICK, str(probe)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        probe.unlink()
    out = done.stdout
    assert "2 failed, 1 passed, 1 deselected, 1 error" in out, out
    for name, what in [
        ("test_runs_a_program", "starts a process"),
        ("test_serves", "listens on a socket (a server)"),
        ("test_through_a_session_fixture", "starts a process"),
    ]:
        assert f"{name} {what}: mark it @pytest.mark.processes" in out, out
