"""The supervisor under make service (deployments/supervisor.py): each component starts once the
one before answers its health check, and Ctrl-C or SIGTERM leaves no process of it running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from backends.local.ports import free_port
from deployments.supervisor import port_in_use
from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.processes  # each test runs a script or servers of its own

# A service of three stand-ins: an HTTP server; a step that refuses to run unless that server
# answers (so it proves it was started only after the first was healthy); and a process that
# ignores SIGTERM and has a child of its own in a session of its own (what a worker running a
# flow looks like).
DRIVER = textwrap.dedent(
    """
    import sys, urllib.request
    from pathlib import Path
    from deployments.supervisor import Component, http_ok, supervise

    port, logs, extra = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    py = sys.executable
    checks = (
        "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5);"
        "open(sys.argv[2], 'w').close()"
    )
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True);"
        "open(sys.argv[1], 'w').close(); time.sleep(600)"
    )
    ready = logs.parent / "stubborn-ready"
    def make():
        parts = [
            Component("web", [py, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                      ready=lambda: http_ok(f"http://127.0.0.1:{port}/"),
                      where=f"127.0.0.1:{port}", port=("127.0.0.1", port)),
            Component("check", [py, "-c", checks, f"http://127.0.0.1:{port}/",
                                str(logs.parent / "checked")], once=True),
            Component("stubborn", [py, "-c", stubborn, str(ready)], ready=ready.exists, grace=2),
        ]
        if extra == "fail":
            parts.insert(2, Component("broken", [py, "-c", "print('no config here'); exit(3)"],
                                      ready=lambda: False))
        return parts
    code = supervise(make, logs, "all running", lambda line: print(line, flush=True))
    sys.exit(code)
    """
)


def _start(tmp_path: Path, port: int, extra: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(port), str(tmp_path / "logs"), extra],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def lines_until(proc: subprocess.Popen[str], last: str, seconds: float = 120) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith(last):
            return lines
    raise AssertionError(f"no {last!r} line:\n" + "\n".join(lines))


def process_tree(pid: int) -> list[psutil.Process]:
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_components_start_in_order_and_all_stop(tmp_path: Path, stop: signal.Signals) -> None:
    port = free_port()
    driver = _start(tmp_path, port)
    try:
        lines = lines_until(driver, "all running")
        started = [line.split()[0] for line in lines[:3]]
        assert started == ["web", "check", "stubborn"], lines
        assert lines[0].split()[1] == "ready" and f"127.0.0.1:{port}" in lines[0]
        assert lines[1].split()[1] == "done" and lines[2].split()[1] == "ready"
        assert (tmp_path / "checked").exists()  # the check ran after the server answered
        assert {p.name for p in (tmp_path / "logs").iterdir()} == {
            "web.log",
            "check.log",
            "stubborn.log",
        }
        service = process_tree(driver.pid)
        assert len(service) >= 4  # the driver, the server, the stubborn one and its child

        driver.send_signal(stop)  # what Ctrl-C in its terminal (or systemd, or kill) sends
        rest, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, rest
    stopped = [line.split()[0] for line in rest.splitlines() if line.split()[1:2] == ["stopped"]]
    assert stopped == ["stubborn", "web"], rest  # the last started goes first
    assert "killed 2 left after" in rest  # the one that ignored SIGTERM, and its child
    assert rest.rstrip().endswith("the service is stopped")
    assert [p.pid for p in service if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_component_that_fails_stops_the_ones_before_it_and_says_why(tmp_path: Path) -> None:
    port = free_port()
    driver = _start(tmp_path, port, "fail")
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == 1, out
    assert "error: broken exited with 3 before it was ready:" in out
    assert "no config here" in out and "broken.log" in out
    assert [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["stopped"]] == [
        "broken",
        "web",
    ]
    assert not (tmp_path / "stubborn-ready").exists()  # nothing after it was started
    assert not port_in_use("127.0.0.1", port)  # the server is gone


def test_a_port_in_use_is_named_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        driver = _start(tmp_path, port)
        out, _ = driver.communicate(timeout=120)
    assert driver.returncode == 1
    # Named by its holder (this test's own process: the socket is bound here), not reused.
    assert f"error: web: 127.0.0.1:{port} is already in use by pid {os.getpid()} (" in out, out
    assert "it is not reused" in out
    assert not (tmp_path / "logs" / "web.log").exists()


def test_a_killed_component_leaves_no_process_of_its_own_behind(tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL, the OOM killer): its flow run, in a session of its
    own, is no longer below it; the supervisor's stop ends it all the same."""
    driver = _start(tmp_path, free_port())
    try:
        lines_until(driver, "all running")
        (stubborn,) = [p for p in process_tree(driver.pid) if "stubborn-ready" in p.cmdline()[-1]]
        (flow_run,) = stubborn.children()
        stubborn.kill()
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 1, out
    assert "stubborn exited with -9" in out and "the service is stopped" in out
    assert not flow_run.is_running() or flow_run.status() == psutil.STATUS_ZOMBIE, out
