"""The end of a task on an emulated node: what Batch reports as ended has let go of its ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.fakes.hosts import Hosts, Node
from tests.nodes_helpers import listen_on, require_emulated_nodes

pytestmark = pytest.mark.processes

PORTS = range(2200, 2240)
_BIND = """
import socket, sys
for port in map(int, sys.argv[1:]):
    try:
        socket.create_server(("0.0.0.0", port)).close()
    except OSError as exc:
        print(port, exc)
"""


_LISTEN_THREADED = """
import socket, sys, threading, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
for _ in range(4):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("listening", flush=True)
time.sleep(600)
"""


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that have not exited: a zombie has once its last thread has (until
    then the threads still exiting hold its files and ports)."""
    running = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def _listen_threaded(node: Node, port: int) -> subprocess.Popen[str]:
    """A process of several threads on ``node`` holding ``port``, as a trainer holds its
    rendezvous port; returns once it listens."""
    proc = node.popen(
        [sys.executable, "-c", _LISTEN_THREADED, str(port)], {}, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def test_ports_of_killed_processes_are_free_when_the_kill_returns(tmp_path: Path) -> None:
    """A task's processes are killed when it ends, and the next task on the node binds the
    same ports at once (a retried task's sshd on 2222): every port a killed process held is
    free when ``kill_processes`` returns, not a moment later once the kernel has run the
    dying processes' exits."""
    require_emulated_nodes()
    mount = tmp_path / "mnt"
    mount.mkdir()
    with Hosts(tmp_path / "nodes", [("n0", "10.211.0.4")], mount) as hosts:
        (node,) = hosts.nodes
        for _ in range(3):
            holders = [(listen_on if port % 2 else _listen_threaded)(node, port) for port in PORTS]
            killed = node.kill_processes()
            assert len(killed) >= len(PORTS)
            assert _running(killed) == [], "killed processes still running after the kill"
            taken = node.run([sys.executable, "-c", _BIND, *map(str, PORTS)])
            assert taken.returncode == 0, taken.stderr
            assert taken.stdout == "", f"ports still held after the kill:\n{taken.stdout}"
            for proc in holders:
                proc.wait(timeout=30)
                if proc.stdout is not None:
                    proc.stdout.close()
