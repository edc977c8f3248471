"""training.node_address: the interface a node's ranks use, and its host name resolving to it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from training.node_address import (
    NodeAddressError,
    ensure_host_name_resolves,
    interface_address,
    main,
    pin_host_name,
)

UBUNTU = "127.0.0.1 localhost\n127.0.1.1 tvmps_0001\n\n# IPv6\n::1 localhost ip6-localhost\n"


def test_ubuntus_loopback_entry_gives_way_to_the_nodes_address() -> None:
    pinned = pin_host_name(UBUNTU, "tvmps_0001", "10.0.0.5")
    assert pinned == (
        "127.0.0.1 localhost\n\n# IPv6\n::1 localhost ip6-localhost\n10.0.0.5 tvmps_0001\n"
    )


def test_other_names_on_the_same_line_and_comments_are_kept() -> None:
    hosts = "127.0.1.1 tvmps_0001 node.internal  # set by cloud-init\n10.0.0.4 tvmps_0000\n"
    pinned = pin_host_name(hosts, "tvmps_0001", "10.0.0.5")
    assert pinned.splitlines() == [
        "127.0.1.1 node.internal # set by cloud-init",
        "10.0.0.4 tvmps_0000",
        "10.0.0.5 tvmps_0001",
    ]


def test_a_correct_hosts_file_is_left_as_it_is() -> None:
    hosts = "127.0.0.1 localhost\n10.0.0.5 tvmps_0001\n"
    assert pin_host_name(hosts, "tvmps_0001", "10.0.0.5") == hosts


def test_the_hosts_file_is_rewritten_in_place(tmp_path: Path) -> None:
    """A container's /etc/hosts is a bind mount: it must keep its inode (no rename)."""
    name = socket.gethostname()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {name}\n")
    inode = hosts.stat().st_ino
    # This machine resolves its own name through the system's hosts file, not this one: the
    # function sees that the name does not resolve to the address and rewrites the file.
    done = ensure_host_name_resolves(hosts, name, "192.0.2.77")
    assert "now maps it to 192.0.2.77" in done
    assert hosts.stat().st_ino == inode
    assert hosts.read_text() == f"127.0.0.1 localhost\n192.0.2.77 {name}\n"


def test_a_missing_interface_names_the_ones_there_are() -> None:
    with pytest.raises(NodeAddressError, match=r"no interface ib9 \(this node has: .*lo"):
        interface_address("ib9")
    assert interface_address("lo") == "127.0.0.1"


def test_a_loopback_interface_fails_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--interface", "lo", "--node", "tvmps_0003"]) == 1
    assert "prepare_node: node tvmps_0003: lo is a loopback interface" in capsys.readouterr().err
