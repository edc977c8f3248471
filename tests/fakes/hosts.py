"""Several hosts on one machine: each emulated Batch node is a set of Linux namespaces.

A node here is what a pool node is to the task running on it: its own network stack (``lo`` and
an ``eth0`` with its own address on a bridge shared by the nodes, in a private test range), its
own host name (UTS namespace) and ``/etc/hosts`` (a bind mount in its own mount namespace), its
own process tree (PID namespace: a process started there cannot outlive the node, and killing the
node's first process powers it off), and its own Batch root directory, mounted at the same path
on every node, as Batch gives every node of a pool the same paths. Everything else is this
machine's filesystem, which is how a shared folder stands in for the pool's NFS mount.

Commands run inside a node through ``nsenter``. Needs root and ``ip``, ``unshare`` and
``nsenter`` (util-linux); :func:`unavailable_reason` says why not when they are missing.
Namespaces and links are named after the creating process, created and removed by name, and a
later session removes what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import psutil

SSHD = Path("/usr/sbin/sshd")
PREFIX_LEN = 24
_counter = itertools.count()
_NETNS = re.compile(r"^retrain-([0-9a-f]{6})[0-9a-f]-\d+$")
_BRIDGE = re.compile(r"^rtb([0-9a-f]{6})[0-9a-f]$")
CLONE_NEWNET = 0x40000000

# What a node's first process does: take the node's host name, mount its hosts file and its
# Batch root, say so, then reap the orphans reparented to it (as init does) until it is killed.
_NODE_INIT = r"""
import os, signal, socket, subprocess, sys, time
name, hosts, hosts_mode, root, mountpoint = sys.argv[1:6]
socket.sethostname(name)
subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True)
if hosts_mode == "ro":
    subprocess.run(["mount", "-o", "remount,bind,ro", "/etc/hosts"], check=True)
subprocess.run(["mount", "--bind", root, mountpoint], check=True)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
print("ready", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""

HostsFile = Literal["loopback", "address"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network, UTS, mount and PID namespaces)"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {', '.join(missing)} (iproute2, util-linux)"
    if not SSHD.exists():
        return f"{SSHD} is missing: install openssh-server (`make setup` does, as root)"
    probe = f"retrain-{os.getpid():06x}f-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid)


def sweep_leftovers() -> list[str]:
    """Remove the namespaces and bridges of sessions that died without cleaning up."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ", 1)[0]
        match = _NETNS.match(name)
        if match and not _alive(int(match.group(1), 16)):
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = _BRIDGE.match(name)
        if match and not _alive(int(match.group(1), 16)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@dataclass
class Node:
    """One emulated host. ``root`` is the host path of what the node sees at the pool's root."""

    name: str
    address: str
    root: Path
    hosts_file: Path
    netns: str
    cpus: tuple[int, ...] = ()  # the node's cores (all of this machine's when empty)
    init: subprocess.Popen[str] | None = None
    pid: int = 0  # the node's first process, as this machine sees it
    _namespace: str | None = None
    forwarded: set[int] = field(default_factory=set)
    _relays: list[socket.socket] = field(default_factory=list)

    def command(
        self, argv: Sequence[str], cwd: str | Path | None = None, root: Path | None = None
    ) -> list[str]:
        """argv run inside the node (its network, host name, mounts and process tree), and
        inside the container whose root file system is ``root`` (a path in the node's mounts)
        when given."""
        enter = ["nsenter", f"--target={self.pid}", "--net", "--uts", "--mount", "--pid", "--"]
        # nsenter's --wd resolves the path before entering the node's mounts: change directory
        # inside instead (inside the container's root, when there is one).
        chdir = [f"--chdir={cwd}"] if cwd is not None else []
        inside = ["chroot", str(root), "/usr/bin/env"] if root is not None else ["env"]
        # CPU affinity is no namespace: every process entering the node takes the node's cores
        # (and passes them on to what it starts, sshd's sessions included).
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        if root is None and not chdir:
            inside = []
        return [*enter, *pin, *inside, *chdir, *argv]

    def popen(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str | Path | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        root: Path | None = None,
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(argv, cwd, root), env=env, stdout=stdout, stderr=stderr, text=True
        )

    def run_in_mounts(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """argv in the node's mount and PID namespaces only (setting up a container's mounts:
        they exist in the node alone, and its /proc shows the node's processes)."""
        return subprocess.run(
            ["nsenter", f"--target={self.pid}", "--mount", "--pid", "--", *argv],
            capture_output=True,
            text=True,
            check=False,
        )

    def run(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        """Run to the end; stdout and stderr captured."""
        return subprocess.run(
            self.command(argv, cwd),
            env=env if env is not None else dict(os.environ),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def processes(self) -> list[psutil.Process]:
        """Every process running in the node except its first."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid != self.pid and _pid_namespace(proc.pid) == self._namespace:
                found.append(proc)
        return found

    def kill_processes(self, matching: str | None = None, timeout: float = 30) -> list[int]:
        """SIGKILL the node's processes (whose command line contains ``matching``, if given),
        and return once they have exited.

        Without ``matching`` this is what the end of a task's container does on Batch, which
        reports a task ended once its processes are gone: a signal sent is not a process gone,
        and until a killed process has run its exit its ports stay bound (a retried task's sshd
        found 2222 taken by the one killed a moment before, on a loaded machine). Processes
        started meanwhile (a fork racing the kill) are killed in another pass.
        """
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:  # also when new processes keep appearing
                raise TimeoutError(f"node {self.name}: processes alive {timeout} s after SIGKILL")
            sent = []
            for proc in self.processes():
                with contextlib.suppress(psutil.Error):
                    if not _running(proc):
                        continue  # exited: its files and ports are closed
                    if matching is None or matching in " ".join(proc.cmdline()):
                        proc.kill()
                        sent.append(proc)
            if not sent:
                return killed
            killed += [proc.pid for proc in sent]
            while any(_running(proc) for proc in sent) and time.monotonic() <= deadline:
                time.sleep(0.01)

    def forward(self, port: int) -> None:
        """Make 127.0.0.1:port inside the node reach 127.0.0.1:port of this machine.

        The node's route to a service the fakes run on this machine's loopback (Azurite): the
        URLs a task is given work on the node as they do where they were made.
        """
        if port in self.forwarded:
            return
        server = _listen_in(f"/run/netns/{self.netns}", port)
        self.forwarded.add(port)
        self._relays.append(server)
        threading.Thread(target=_relay_accept, args=(server, port), daemon=True).start()

    def _stop(self) -> None:
        for server in self._relays:
            with contextlib.suppress(OSError):
                server.close()
        if self.init is not None and self.init.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # the PID namespace ends with its first process
            self.init.kill()
            self.init.wait(timeout=30)


def _listen_in(netns_path: str, port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port of another network namespace.

    Only the calling thread enters the namespace, and only while it creates the socket; the
    socket stays in that namespace.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result: list[socket.socket | BaseException] = []

    def make() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(netns_path, os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {netns_path}")
            try:
                result.append(socket.create_server(("127.0.0.1", port)))
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        except BaseException as exc:
            result.append(exc)
        finally:
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=make)  # a thread of its own: it leaves with its namespace
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _relay_accept(server: socket.socket, port: int) -> None:
    while True:
        try:
            inside, _ = server.accept()
        except OSError:
            return
        try:
            outside = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            inside.close()
            continue
        outside.settimeout(None)
        for a, b in ((inside, outside), (outside, inside)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def hosts_text(name: str, address: str, style: HostsFile) -> str:
    """A node's /etc/hosts. ``loopback`` is Ubuntu's default: the node's own name on 127.0.1.1."""
    own = "127.0.1.1" if style == "loopback" else address
    return f"127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n{own} {name}\n"


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` has yet to exit. A zombie has, once its last thread has: a killed
    process's leader shows as a zombie while its other threads, which share its open files
    and ports, may still be exiting. A pid reused since is not the process."""
    try:
        if not proc.is_running():
            return False
        return proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1
    except psutil.NoSuchProcess:
        return False


class Hosts:
    """Emulated hosts on one bridge, created on enter and removed on exit (also on errors).

    ``mountpoint`` is the path every node sees its own Batch root at (an empty directory on this
    machine); ``base`` holds each node's root and hosts file. ``cpus`` gives each node cores of
    its own (for measurements: nodes otherwise share this machine's).
    """

    def __init__(
        self,
        base: Path,
        nodes: Iterable[tuple[str, str]],
        mountpoint: Path,
        hosts_file: HostsFile = "loopback",
        read_only_hosts: bool = False,
        cpus: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.base, self.mountpoint = base, mountpoint
        self.specs = list(nodes)
        self.cpus = [tuple(c) for c in cpus] if cpus else [() for _ in self.specs]
        self.hosts_style, self.read_only_hosts = hosts_file, read_only_hosts
        tag = f"{os.getpid():06x}{next(_counter) % 16:x}"
        self.bridge = f"rtb{tag}"
        self._tag = tag
        self.nodes: list[Node] = []

    def __enter__(self) -> Hosts:
        sweep_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def by_address(self, address: str) -> Node:
        return next(n for n in self.nodes if n.address == address)

    def _create(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, (name, address) in enumerate(self.specs):
            node_dir = self.base / name
            node = Node(
                name=name,
                address=address,
                root=node_dir / "root",
                hosts_file=node_dir / "hosts",
                netns=f"retrain-{self._tag}-{i}",
                cpus=self.cpus[i],
            )
            node.root.mkdir(parents=True, exist_ok=True)
            node.hosts_file.write_text(hosts_text(name, address, self.hosts_style))
            self.nodes.append(node)
            self._network(node, i)
            self._start(node)

    def _network(self, node: Node, index: int) -> None:
        outside, inside = f"rtv{self._tag}{index:x}", f"rti{self._tag}{index:x}"
        _ip("netns", "add", node.netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", node.netns)
        _ip("link", "set", outside, "master", self.bridge, "up")
        inns = ("netns", "exec", node.netns, "ip")
        _ip(*inns, "link", "set", inside, "name", "eth0")
        _ip(*inns, "addr", "add", f"{node.address}/{PREFIX_LEN}", "dev", "eth0")
        _ip(*inns, "link", "set", "eth0", "up")
        _ip(*inns, "link", "set", "lo", "up")

    def _start(self, node: Node) -> None:
        mode = "ro" if self.read_only_hosts else "rw"
        args = [str(node.hosts_file), mode, str(node.root), str(self.mountpoint)]
        unshare = ["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc"]
        node.init = subprocess.Popen(
            [
                *("ip", "netns", "exec", node.netns),
                *unshare,
                *("--propagation", "private", "--"),
                *(sys.executable, "-c", _NODE_INIT, node.name, *args),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert node.init.stdout is not None
        line = node.init.stdout.readline()
        if line.strip() != "ready":
            err = node.init.stderr.read() if node.init.stderr else ""
            raise RuntimeError(f"node {node.name} did not start: {line}{err}")
        first = psutil.Process(node.init.pid).children()
        if not first:
            raise RuntimeError(f"node {node.name}: no first process under unshare")
        node.pid = first[0].pid
        node._namespace = _pid_namespace(node.pid)

    def close(self) -> None:
        for node in self.nodes:
            node._stop()
        for node in self.nodes:
            _ip("netns", "del", node.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
