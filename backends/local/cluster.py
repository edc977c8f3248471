"""A single-node stand-in for an Azure Batch pool that runs the same task specs.

It gives each task what a Batch node gives it: a task directory with a working dir, the
``AZ_BATCH_*`` environment, the NFS and scripts mounts under ``$AZ_BATCH_NODE_MOUNTS_DIR``,
resource files fetched from Blob, and output files uploaded to Blob by the spec's patterns. So the
command lines that would go to Azure are the ones executed and tested here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from backends.cluster import TaskResult
from backends.lines import pipe_lines
from backends.local.processes import (
    ProcessRecord,
    is_alive,
    kill_group,
    read_record,
    record_of,
    write_record,
)
from backends.taskspec import NFS_MOUNT, SHARE_MOUNT, OutputSpec, TaskSpec, node_environment
from common.atomic import atomic_write_json, read_json_object

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

    from backends.cost import PoolUsage
    from backends.progress_deadline import ProgressDeadline
    from backends.spot_fallback import SpotRecord


WATCH_SECONDS = 0.5  # how often a running task's progress deadline is checked
TIMES = "times.json"  # in a task's folder: when it was created and when it ended


def _now_dt() -> datetime:
    return datetime.now(UTC)


def _now() -> str:
    return _now_dt().isoformat()


class ClusterError(RuntimeError):
    """The pool cannot run the task (not ensured, wrong size, missing tools)."""


def _split_pattern(pattern: str) -> tuple[str, str | None]:
    """('base dir', 'glob below it') for a Batch file pattern; glob None for an exact file."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return "/".join(parts[:i]) or ".", "/".join(parts[i:])
    return pattern, None


class LocalCluster:
    retries_in_service = False
    shared = False  # a folder on this machine: only processes here can use it

    def __init__(
        self,
        work_dir: Path,
        pool_id: str,
        nodes: int,
        nfs_dir: Path,
        share_dir: Path,
        outputs: ContainerClient,
        python: str = sys.executable,
    ) -> None:
        pools = (work_dir / "pools").resolve()
        self.root = (pools / pool_id).resolve()
        # release() deletes below the root: whatever the id (config validation is the first
        # line), the root is one folder directly inside work_dir/pools, never a path elsewhere.
        if self.root.parent != pools:
            raise ClusterError(
                f"pool id {pool_id!r} names a folder outside {pools}: use letters, digits, "
                "'-' and '_'"
            )
        self.pool_id, self.nodes = pool_id, nodes
        self.nfs_dir, self.share_dir = nfs_dir, share_dir
        self.outputs, self.python = outputs, python
        self._running: dict[str, subprocess.Popen[str]] = {}
        self._lock = threading.Lock()

    @property
    def state_file(self) -> Path:
        return self.root / "pool.json"

    def state(self) -> str:
        try:
            return str(json.loads(self.state_file.read_text())["state"])
        except FileNotFoundError:
            return "absent"

    def _set_state(self, state: str, **extra: object) -> None:
        atomic_write_json(
            {"id": self.pool_id, "state": state, "nodes": self.nodes, "time": time.time(), **extra},
            self.state_file,
        )

    def ensure_pool(self) -> dict[str, object]:
        """Idempotent: create the node (its mounts), or find it steady."""
        if self.nodes != 1:
            raise ClusterError(
                f"the local target has one node; pool asks for {self.nodes} "
                "(set pool.dedicated_nodes=1, pool.low_priority_nodes=0)"
            )
        horovodrun = Path(self.python).parent / "horovodrun"
        if not horovodrun.exists():
            raise ClusterError(f"{horovodrun} not found: run `make setup`")
        existed = self.state() == "steady"
        mounts = self.root / "node" / "mounts"
        mounts.mkdir(parents=True, exist_ok=True)
        for name, target in ((NFS_MOUNT, self.nfs_dir), (SHARE_MOUNT, self.share_dir)):
            target.mkdir(parents=True, exist_ok=True)
            link = mounts / name
            if link.is_symlink() and link.resolve() != target.resolve():
                link.unlink()
            if not link.exists():
                link.symlink_to(target.resolve(), target_is_directory=True)
        # The node's allocation time, as Batch records a node's: kept while the pool stays up.
        allocated = self._read_state().get("allocated") if existed else None
        self._set_state("steady", cpus=os.cpu_count(), allocated=allocated or _now())
        return {"pool": self.pool_id, "created": not existed, "nodes": 1, "cpus": os.cpu_count()}

    def _read_state(self) -> dict[str, object]:
        return read_json_object(self.state_file) or {}

    def _environment(self, spec: TaskSpec, task_dir: Path) -> dict[str, str]:
        bindir = str(Path(self.python).parent)
        # A Batch node never sees the orchestrator's environment; neither does a local task.
        env = node_environment(os.environ)
        env.update(spec.environment)
        env.update(
            {
                "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}",
                "RETRAIN_PYTHON": self.python,
                "AZ_BATCH_POOL_ID": self.pool_id,
                "AZ_BATCH_JOB_ID": "local",
                "AZ_BATCH_TASK_ID": spec.id,
                "AZ_BATCH_NODE_ID": "local-node-0",
                "AZ_BATCH_HOST_LIST": "localhost",
                "AZ_BATCH_NODE_LIST": "localhost",
                "AZ_BATCH_MASTER_NODE": "localhost:6000",
                "AZ_BATCH_IS_CURRENT_NODE_MASTER": "true",
                "AZ_BATCH_NODE_MOUNTS_DIR": str((self.root / "node" / "mounts").resolve()),
                "AZ_BATCH_TASK_DIR": str(task_dir),
                "AZ_BATCH_TASK_WORKING_DIR": str(task_dir / "wd"),
                "AZ_BATCH_TASK_SHARED_DIR": str(task_dir / "shared"),
            }
        )
        return env

    def _run(
        self,
        key: str,
        command: str,
        env: dict[str, str],
        cwd: Path,
        log: Path,
        on_line: Callable[[str], None],
        timeout: float,
        deadline: ProgressDeadline | None = None,
        stalls: list[str] | None = None,
    ) -> int:
        # Batch command lines are executed without a shell: split like Batch does.
        proc = subprocess.Popen(
            shlex.split(command),
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with self._lock:
            self._running[key] = proc
        pidfile = self.root / "running" / f"{key}.pid"
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        record = record_of(proc.pid)  # None: it already ended, nothing to stop
        if record is not None:
            write_record(record, pidfile)  # lets release() from another process stop it
        timer = threading.Timer(timeout, self._kill, args=(key,))
        timer.start()
        ended = threading.Event()
        if deadline is not None:
            threading.Thread(
                target=self._watch,
                args=(key, deadline, ended, on_line, stalls if stalls is not None else []),
                daemon=True,
            ).start()
        try:
            assert proc.stdout is not None
            with open(log, "a") as out:
                pipe_lines(proc.stdout, on_line, copy=out)
            return proc.wait()
        finally:
            ended.set()
            timer.cancel()
            pidfile.unlink(missing_ok=True)
            with self._lock:
                self._running.pop(key, None)

    def _watch(
        self,
        key: str,
        deadline: ProgressDeadline,
        ended: threading.Event,
        on_line: Callable[[str], None],
        stalls: list[str],
    ) -> None:
        """End the task once the deadline finds it hung; the reason goes to its log."""
        while not ended.wait(WATCH_SECONDS):
            reason = deadline.overdue()
            if reason is not None:
                stalls.append(reason)
                on_line(f"task {key}: {reason}: ending the attempt")
                self._kill(key)
                return

    def _kill(self, key: str) -> None:
        """The task's whole tree: its process group, and what left the group (launchers put
        each rank in a session of its own), a stopped rank included (SIGKILL ends it too)."""
        import psutil

        with self._lock:
            proc = self._running.get(key)
        if proc is None or proc.poll() is not None:
            return
        try:
            below = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            below = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()

    def run_task(
        self,
        spec: TaskSpec,
        on_line: Callable[[str], None] = lambda _: None,
        deadline: ProgressDeadline | None = None,
    ) -> TaskResult:
        """One attempt (Prefect retries the step here); one the ``deadline`` finds hung is
        ended, and the result names why in ``stalls``."""
        if self.state() != "steady":
            raise ClusterError(f"pool {self.pool_id} is {self.state()}: ensure it first")
        if spec.instances != 1:
            raise ClusterError(
                f"task {spec.id} asks for {spec.instances} nodes; the local pool has 1"
            )
        started = time.perf_counter()
        created = _now()  # from here on the node is the task's, as from a Batch task's creation
        self._wait_for_free_node(spec, on_line)
        task_dir = (self.root / "tasks" / f"{spec.id}-{int(time.time() * 1000)}").resolve()
        for sub in ("wd", "shared"):
            (task_dir / sub).mkdir(parents=True)
        try:
            return self._run_in(spec, task_dir, on_line, deadline, started)
        finally:
            atomic_write_json({"created": created, "ended": _now()}, task_dir / TIMES)

    def _run_in(
        self,
        spec: TaskSpec,
        task_dir: Path,
        on_line: Callable[[str], None],
        deadline: ProgressDeadline | None,
        started: float,
    ) -> TaskResult:
        for resource in spec.resources:
            target = task_dir / "wd" / resource.file_path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as fh:
                self.outputs.download_blob(resource.blob).readinto(fh)
        env = self._environment(spec, task_dir)
        log = task_dir / "stdout.txt"
        (task_dir / "stderr.txt").touch()  # merged into stdout.txt here; Batch keeps both
        code = 0
        stalls: list[str] = []
        if deadline is not None:
            deadline.restart()
        # The coordination command first, as Batch runs it; the task's own only if it passed.
        for command in (spec.coordination_command, spec.command_line):
            if command and code == 0:
                code = self._run(
                    spec.id,
                    command,
                    env,
                    task_dir / "wd",
                    log,
                    on_line,
                    spec.max_wall_clock_seconds,
                    deadline,
                    stalls,
                )
        uploaded = self._upload_outputs(spec.outputs, task_dir / "wd", success=code == 0)
        return TaskResult(code, task_dir, uploaded, time.perf_counter() - started, stalls=stalls)

    def _wait_for_free_node(self, spec: TaskSpec, on_line: Callable[[str], None]) -> None:
        """One task per node, as on the Batch pool (task_slots_per_node=1): a task left running
        by a killed orchestrator finishes first, then this one starts (and resumes from the
        checkpoints it wrote)."""
        announced = False
        while busy := self.running_tasks():
            if not announced:
                on_line(f"task {spec.id} waits for {', '.join(sorted(busy))} to finish")
                announced = True
            time.sleep(0.5)

    def _upload_outputs(self, outputs: list[OutputSpec], wd: Path, success: bool) -> list[str]:
        uploaded = []
        for spec in outputs:
            if spec.condition == "tasksuccess" and not success:
                continue
            if spec.condition == "taskfailure" and success:
                continue
            base, pattern = _split_pattern(spec.pattern)
            if pattern is None:
                files = [(wd / base, spec.destination)] if (wd / base).is_file() else []
            else:
                root = (wd / base).resolve()
                files = [
                    (p, f"{spec.destination}/{p.relative_to(root).as_posix()}")
                    for p in sorted(root.glob(pattern))
                    if p.is_file()
                ]
            for path, blob in files:
                with open(path, "rb") as fh:
                    self.outputs.upload_blob(blob, fh, overwrite=True)
                uploaded.append(blob)
        return uploaded

    def running_tasks(self) -> dict[str, int]:
        """Task id -> process group of every task still running, from any process.

        A pid file counts only while the process it records (PID, start time, boot) still
        runs: one left by a killed orchestrator whose PID now names another process is stale.
        """
        return {key: record.pid for key, record in self._running_records().items()}

    def _running_records(self) -> dict[str, ProcessRecord]:
        found = {}
        for pidfile in (self.root / "running").glob("*.pid"):
            record = read_record(pidfile)
            if record is not None and is_alive(record):
                found[pidfile.stem] = record
        return found

    # -- usage: the node's time as Batch would bill it (backends/cost.py); priced only when
    # pool.hourly_price is set, but measured, so estimates can be checked against it here.
    def node_allocations(self) -> list[datetime] | None:
        allocated = self._read_state().get("allocated")
        if self.state() != "steady" or not isinstance(allocated, str):
            return []
        return [datetime.fromisoformat(allocated)]

    def clock(self) -> datetime:
        return datetime.now(UTC)

    def usage(self, run_id: str, since: datetime, allocations: list[datetime]) -> PoolUsage:
        from backends.cost import PoolUsage, Span, phase_of_task

        state = self._read_state()
        released = state.get("time") if self.state() == "released" else None
        until = datetime.fromtimestamp(released, UTC) if isinstance(released, float) else _now_dt()
        tasks: dict[str, list[Span]] = {}
        for task_dir in sorted((self.root / "tasks").glob(f"*{run_id}*")):
            phase = phase_of_task(task_dir.name)
            times = read_json_object(task_dir / TIMES)
            if phase is None or times is None or not isinstance(times.get("created"), str):
                continue
            ended = times.get("ended")
            end = datetime.fromisoformat(ended) if isinstance(ended, str) else until
            tasks.setdefault(phase, []).append(Span(datetime.fromisoformat(times["created"]), end))
        return PoolUsage([Span(max(a, since), until) for a in allocations], tasks)

    def spot_record(self) -> SpotRecord | None:
        return None  # one dedicated node: this machine

    def release(self) -> dict[str, object]:
        """Stop the tasks this pool started and mark it released (scaled to zero).

        Works from any process (a cancellation hook, a new flow run), like resizing a Batch pool.
        Only process groups whose leader is verified against its pid file are signalled.
        """
        running = self._running_records()
        keys = [key for key, record in running.items() if kill_group(record)]
        was = self.state()
        if was != "absent":
            self._set_state("released")
        shutil.rmtree(self.root / "node", ignore_errors=True)
        return {"pool": self.pool_id, "was": was, "killed_tasks": keys}
