"""A port for a server started a little later: never one the kernel may hand out on its own in
the meantime, and never one another process picking here holds (a service test lost its
relay's port, picked by binding port 0, to something else in the 90 s before the relay
started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backends.local.ports import LOWEST, _reserved, ephemeral_range, free_port
from tests.conftest import ROOT, child_env

PICKER = """
import sys
from backends.local.ports import free_port
print(" ".join(str(free_port()) for _ in range(60)), flush=True)
sys.stdin.read()  # holds its ports until told to end
"""


def test_a_port_is_below_the_range_the_kernel_hands_out_and_free() -> None:
    import socket

    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST <= port < low for port in ports)
    assert len(set(ports)) == len(ports)  # this process holds each it picked
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free to bind


@pytest.mark.processes
def test_two_processes_picking_at_once_never_share_a_port() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", PICKER],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ours = {free_port() for _ in range(60)}
        assert child.stdout is not None
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == 60 and not ours & theirs
        assert not any(_reserved(port) for port in sorted(theirs)[:5])  # held by the child
    finally:
        child.communicate("", timeout=30)
    # Its reservations end with it.
    assert all(_reserved(port) for port in sorted(theirs)[:5])
