"""A node's address on the interface the ranks talk over, and its host name resolving to it.

Run by ``prepare_node.sh`` on every node of a multi-node job. It fails the node, naming it, when
the interface the job is set to use (``eth0``, ``ib0`` on InfiniBand sizes) is missing or has no
IPv4 address: every rank must bind the same interface, and a node without it would only show up
later as a connection error on another node.

It also makes the node's host name resolve to that address. Gloo, MPI and NCCL fall back to the
host name wherever an interface is not pinned, and Ubuntu's default hosts file maps the name to
127.0.1.1: a peer told to connect there connects to itself. The hosts file is rewritten in place
(in a container it is a bind mount, which a rename cannot replace); a node where it cannot be
written goes on with a warning, since the job pins its interface.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path

import psutil


class NodeAddressError(RuntimeError):
    """The node cannot take part: the message says why."""


def interface_address(interface: str) -> str:
    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        found = ", ".join(sorted(addresses)) or "none"
        raise NodeAddressError(f"no interface {interface} (this node has: {found})")
    for addr in addresses[interface]:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise NodeAddressError(f"interface {interface} has no IPv4 address")


def resolved(name: str) -> list[str]:
    """IPv4 addresses the name resolves to here, in resolver order; empty when it does not."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def pin_host_name(hosts: str, name: str, address: str) -> str:
    """``hosts`` with ``name`` mapped to ``address`` only; every other entry kept as it was."""
    lines, mapped = [], False
    for line in hosts.splitlines():
        entry, hash_, comment = line.partition("#")
        fields = entry.split()
        if len(fields) < 2 or name not in fields[1:]:
            lines.append(line)
            continue
        if fields[0] == address:
            mapped = True
            lines.append(line)
            continue
        rest = [f for f in fields[1:] if f != name]
        if rest:
            lines.append(" ".join([fields[0], *rest]) + (f" {hash_}{comment}" if hash_ else ""))
    if not mapped:
        lines.append(f"{address} {name}")
    return "\n".join(lines) + "\n"


def ensure_host_name_resolves(hosts_file: Path, name: str, address: str) -> str:
    """What was done, in words; raises OSError when the hosts file cannot be written."""
    before = resolved(name)
    if before[:1] == [address]:
        return f"{name} resolves to {address}"
    text = hosts_file.read_text()
    with open(hosts_file, "r+") as fh:  # in place: a bind-mounted file cannot be renamed over
        fh.write(pin_host_name(text, name, address))
        fh.truncate()
    was = ", ".join(before) or "nothing"
    return f"{name} resolved to {was}; {hosts_file} now maps it to {address}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--interface", required=True)
    parser.add_argument("--node", default=socket.gethostname(), help="the node's name in messages")
    parser.add_argument("--hosts-file", type=Path, default=Path("/etc/hosts"))
    args = parser.parse_args(argv)
    try:
        address = interface_address(args.interface)
        if ipaddress.ip_address(address).is_loopback:
            raise NodeAddressError(f"{args.interface} is a loopback interface ({address})")
    except NodeAddressError as exc:
        print(f"prepare_node: node {args.node}: {exc}", file=sys.stderr)
        return 1
    name = socket.gethostname()
    try:
        done = ensure_host_name_resolves(args.hosts_file, name, address)
    except OSError as exc:
        done = (
            f"warning: {name} does not resolve to {address} and {args.hosts_file} cannot be "
            f"written ({exc.strerror})"
        )
    print(f"prepare_node: node {args.node}: {args.interface} {address}; {done}", file=sys.stderr)
    print(address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
