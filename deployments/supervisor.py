"""Start processes one after the other, each once the one before answers its health check,
and stop them all, whatever happens: ``make service`` (deployments/service.py) is built on it.

A component is a command with a health check (or a step that runs to completion), its output
in a log file of its own; each gets one status line. Ctrl-C or SIGTERM stops every component
started, the last first, each with its whole process tree: first its own signal, then, after a
grace period, a kill for whatever is left (a child that outlived its parent or ignored the
signal included). A component that exits on its own stops the others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_SECONDS = 30.0  # a flow run the worker started gets this long to release its pool
MARK_VARIABLE = "RETRAIN_SERVICE_MARK"
STATE_VARIABLE = "RETRAIN_SERVICE_STATE"  # a service's state folder, in its processes' environment


class ServiceError(RuntimeError):
    """A component could not start; the message names it and where its log is."""


@dataclass
class Component:
    """One process of the service (or one step, ``once``, that runs to completion)."""

    name: str
    command: list[str]
    ready: Callable[[], bool] = lambda: True  # polled until True once the process runs
    where: str = ""  # what the status line says about it: an address, a URL
    env: dict[str, str] | None = None
    popen: dict[str, Any] = field(default_factory=dict)  # account, cwd for Popen
    before: Callable[[], str | None] | None = None  # set-up first; returns a note or None
    after: Callable[[], str | None] | None = None  # once ready; returns a note or None
    before_stop: Callable[[], str | None] | None = None  # before its signal; a note or None
    port: tuple[str, int] | None = None  # must be free before it starts
    once: bool = False
    stop_signal: int = signal.SIGTERM
    signal_tree: bool = True  # False: only the main process is signalled (it stops the rest)
    timeout: float = 180.0  # seconds to become ready
    grace: float = STOP_GRACE_SECONDS  # seconds to stop before what is left is killed
    # Given to the process's environment (MARK_VARIABLE), and inherited by what it starts: a
    # process that left its tree (its parent was killed, or it started a session of its own,
    # as a worker's flow runs do) is still found and stopped with it.
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Started:
    component: Component
    proc: subprocess.Popen[Any]
    log: Path


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str, host_header: str | None = None, below: int = 300) -> bool:
    """Whether ``url`` answers with a status under ``below``."""
    request = urllib.request.Request(url, headers={"Host": host_header} if host_header else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status) < below
    except urllib.error.HTTPError as exc:
        return exc.code < below
    except (OSError, ValueError):
        return False


class Supervisor:
    """Starts components one after the other and stops them all, whatever happens between."""

    def __init__(self, log_dir: Path, say: Callable[[str], None] = print) -> None:
        self.log_dir = log_dir
        self.say = say
        self.running: list[Started] = []
        self.stop_requested = False  # set by the signal handlers: checked between polls

    def start(self, component: Component) -> None:
        if component.port and port_in_use(*component.port):
            host, port = component.port
            raise ServiceError(
                f"{component.name}: {host}:{port} is already in use by {holder(host, port)}: "
                "it is not reused; stop it, or choose another port (python -m "
                "deployments.service --help)"
            )
        began = time.monotonic()
        notes = [n for n in [component.before() if component.before else None] if n]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{component.name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                component.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**(os.environ if component.env is None else component.env)}
                | {MARK_VARIABLE: component.mark},
                start_new_session=True,  # Ctrl-C reaches the supervisor only: it stops in order
                **({"cwd": str(ROOT)} | component.popen),
            )
        started = Started(component, proc, log_path)
        self.running.append(started)
        self._wait_ready(started, began)
        if component.after:
            notes += [n for n in [component.after()] if n]
        seconds = time.monotonic() - began
        state = "done" if component.once else "ready"
        details = "; ".join([component.where, *notes]) if component.where or notes else ""
        self.say(
            f"{component.name:<11} {state:<5} {seconds:6.1f}s  {details}"
            f"{'  ' if details else ''}(log {shown(log_path)})"
        )

    def _wait_ready(self, started: Started, began: float) -> None:
        component, proc = started.component, started.proc
        while True:
            if self.stop_requested:
                raise KeyboardInterrupt
            code = proc.poll()
            if code is not None:
                if component.once and code == 0:
                    self.running.remove(started)
                    return
                raise ServiceError(
                    f"{component.name} exited with {code}"
                    f"{'' if component.once else ' before it was ready'}: "
                    f"{_tail(started.log)}(log {shown(started.log)})"
                )
            if not component.once and component.ready():
                return
            if time.monotonic() - began > component.timeout:
                raise ServiceError(
                    f"{component.name} was not ready within {component.timeout:.0f} s "
                    f"(log {shown(started.log)})"
                )
            time.sleep(0.25)

    def exited(self) -> Started | None:
        """The first long-running component that is no longer running."""
        return next((s for s in self.running if s.proc.poll() is not None), None)

    def stop(self) -> None:
        """Every started component, the last first, with its process tree."""
        while self.running:
            started = self.running.pop()
            note = ""
            if started.component.before_stop and started.proc.poll() is None:
                try:
                    note = started.component.before_stop() or ""
                except Exception as exc:  # stopping goes on: the signal and the kill follow
                    note = f"{type(exc).__name__}: {exc}"
            stopped = _stop_tree(started, started.component.grace)
            self.say(f"{started.component.name:<11} stopped{f' ({note})' if note else ''}{stopped}")


def _stop_tree(started: Started, grace: float) -> str:
    """Signal the component (its tree, or its main process), wait for the whole tree, then kill
    what is left of it: a child that outlived its parent or ignored the signal is not spared."""
    import psutil

    component, proc = started.component, started.proc
    try:
        main = psutil.Process(proc.pid)
        tree = [main, *main.children(recursive=True)]
    except psutil.NoSuchProcess:
        main, tree = None, []
    # What left the tree: a worker killed outright leaves its flow runs running (each in a
    # session of its own), holding their pools' locks; they carry the component's mark.
    strays = [p for p in marked(component.mark) if p.pid not in {q.pid for q in tree}]
    signalled = tree if component.signal_tree else tree[:1]
    for p in [*signalled, *strays]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(component.stop_signal)
    _, alive = psutil.wait_procs([*tree, *strays], timeout=grace if main or strays else 0)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    proc.wait()
    return f" (killed {len(alive)} left after {grace:.0f} s)" if alive else ""


def holder(host: str, port: int) -> str:
    """Who listens on ``host:port``, by name: the process (its pid and command) and, when it
    is a component of a service, that service's state folder. Another user's process is seen
    by root only; otherwise "another process"."""
    import psutil

    try:
        found = [
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ]
    except psutil.Error:
        found = []
    for pid in found:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            command = " ".join(process.cmdline())
            said = f"pid {pid} ({command[:120]}{'...' if len(command) > 120 else ''})"
            with contextlib.suppress(psutil.Error):
                state = process.environ().get(STATE_VARIABLE)
                if state:
                    return f"the service of {state}: {said}"
            return said
    return "another process (one this user cannot see)"


def marked(mark: str) -> list[Any]:
    """Every process carrying ``mark`` (MARK_VARIABLE), and every process below one of them
    (a process may drop the variable from its children's environment: a training task does)."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(MARK_VARIABLE) == mark:
                found[p.pid] = p
                for child in p.children(recursive=True):
                    found.setdefault(child.pid, child)
    return list(found.values())


def shown(path: Path) -> str:
    """A path as the person reads it: relative to where they are when it is below."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n  " + "\n  ".join(text) + "\n") if text else ""


def supervise(
    make: Callable[[], list[Component]],
    log_dir: Path,
    running: str,
    say: Callable[[str], None] = print,
) -> int:
    """Start the components ``make`` builds, one after the other, say ``running``, then wait
    for Ctrl-C or SIGTERM (or a component's exit); stop everything started, whatever happened.
    The exit status: 0 after a stop asked for, 1 when a component failed."""
    supervisor = Supervisor(log_dir, say)

    def request_stop(signum: int, frame: Any) -> None:
        supervisor.stop_requested = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for component in make():
            supervisor.start(component)
        say(running)
        while not supervisor.stop_requested:
            gone = supervisor.exited()
            if gone is not None:
                say(
                    f"{gone.component.name} exited with {gone.proc.returncode}: "
                    f"{_tail(gone.log)}stopping the service (log {shown(gone.log)})"
                )
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # a component that cannot start: say why, stop the others
        say(f"error: {exc}")
        code = 1
    finally:
        for s in previous:  # a second Ctrl-C must not cut the stopping short
            signal.signal(s, signal.SIG_IGN)
        supervisor.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    say("the service is stopped")
    return code
