"""Batch nodes for the fake Batch service that really run the tasks, as a node's agent does.

For a task a node gets: its mounts under ``$AZ_BATCH_NODE_MOUNTS_DIR`` (the scripts share as the
Files mount presents it, and the NFS folder), resource files fetched through their URLs into the
working directory, the task's environment settings plus the variables Batch sets, and the
command lines run without a shell. A task with container settings runs in its image when the
nodes are given an image puller (:mod:`tests.fakes.container`), as Batch runs a container task:
pulled from the registry, the node's Batch root mapped in at the same path, the task's
environment on top of the image's, host networking, the task working directory as the
container's. Without one, commands run with this checkout's virtualenv.

Every node of the pool is an emulated host (:mod:`tests.fakes.hosts`), and a multi-instance task
runs as Batch runs it: the coordination command on every node, all of which must exit 0 before
the application command runs on the primary only; a failing subtask fails the task (the service
then retries it up to ``maxTaskRetryCount``); at the end of an attempt every process the task
started on any node is stopped, as the task's container would be. Subtask states are kept for
``list_subtasks``, and each node keeps the task's ``stdout.txt`` and ``stderr.txt`` in its task
directory, where Batch keeps them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from tests.fakes.batch import Attempt, FakeBatch
from tests.fakes.container import Bind, Container, ImagePuller, PulledImage
from tests.fakes.hosts import Hosts, HostsFile, Node

BIN = str(Path(sys.executable).parent)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MASTER_PORT = 6000  # Batch's own port in AZ_BATCH_MASTER_NODE; the tasks must not use it


def fetch_resources(task: dict[str, Any], wd: Path) -> None:
    """The task's resource files, downloaded as the node agent does (a bad SAS fails here)."""
    for resource in task.get("resourceFiles", []):
        reply = requests.get(resource["httpUrl"], timeout=60)
        reply.raise_for_status()
        target = wd / resource["filePath"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(reply.content)


def working_files(wd: Path) -> dict[str, bytes]:
    return {p.relative_to(wd).as_posix(): p.read_bytes() for p in wd.rglob("*") if p.is_file()}


def _seconds(duration: str | None, default: float = 600) -> float:
    """An ISO 8601 duration as Batch sends it (PT6H, P1DT2H, PT90S)."""
    match = re.fullmatch(
        r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?", duration or ""
    )
    if not duration or not match:
        return default
    d, h, m, s = (float(g or 0) for g in match.groups())
    return ((d * 24 + h) * 60 + m) * 60 + s


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Subtask:
    """One instance of a multi-instance task on one node (index 0: the primary)."""

    index: int
    node: Node
    node_id: str
    task_dir: Path  # as this machine sees it
    state: str = "preparing"
    exit_code: int | None = None
    times: dict[str, str] = field(default_factory=dict)
    previous: tuple[str, str] | None = None
    container: Container | None = None  # the task's container on this node, if it has one

    def set(self, state: str) -> None:
        now = _now()
        self.previous = (self.state, self.times.get("stateTransitionTime", now))
        self.state = state
        self.times["stateTransitionTime"] = now
        if state == "running":
            self.times["startTime"] = now
        if state == "completed":
            self.times["endTime"] = now

    @property
    def wd(self) -> Path:
        return self.task_dir / "wd"

    def stdout(self) -> str:
        return _read(self.task_dir / "stdout.txt")

    def stderr(self) -> str:
        return _read(self.task_dir / "stderr.txt")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class TaskRun:
    """One attempt of a task on the pool's nodes."""

    job_id: str
    task_id: str
    subtasks: list[Subtask]
    coordination: str | None
    command: str
    exit_code: int | None = None
    failed_node: str | None = None  # the node whose coordination command failed
    started: float = 0.0  # wall-clock times: the attempt, and its application command
    application_started: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def primary(self) -> Subtask:
        return self.subtasks[0]

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise TimeoutError(f"task {self.task_id} still running after {timeout} s")
        assert self.exit_code is not None
        return self.exit_code


class PoolNodes:
    """A pool's nodes as emulated hosts, running tasks as Batch runs them.

    ``nodes`` are (node id, address) pairs, the first being where a single-instance task runs;
    without them, the nodes are those of the attached fake service's pool when its first task
    starts. ``scripts`` fills a node's scripts mount (the Files share as it is when the task
    starts). ``root`` holds each node's Batch root; every node sees its own at ``root/batch``.
    ``images`` pulls a container task's image (its ``containerSettings.imageName``, or what
    ``aliases`` maps that name to) and the task then runs in it; without it every task runs
    on the nodes' own files.
    """

    def __init__(
        self,
        root: Path,
        nodes: list[tuple[str, str]] | None,
        nfs_dir: Path,
        scripts: Callable[[Path], None],
        hosts_file: HostsFile = "loopback",
        read_only_hosts: bool = False,
        cpus: list[list[int]] | None = None,
        images: ImagePuller | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.root, self.nfs_dir, self.scripts = root, nfs_dir, scripts
        self.images, self.aliases = images, aliases or {}
        # Batch does not say whether a node's coordination command and the task's application
        # command share one container. The pipeline assumes they do (its sshd outlives the
        # coordination command); True runs the other reading: each coordination command in a
        # container of its own, gone with everything in it once the command exits.
        self.coordination_in_own_container = False
        self.batch_root = root / "batch"  # the same path on every node
        self.hosts_file, self.read_only_hosts, self.cpus = hosts_file, read_only_hosts, cpus
        self.hosts: Hosts | None = None
        self.ids: list[str] = []
        self.commands: list[tuple[str, str]] = []  # (node id, command line) in the order run
        self.runs: list[TaskRun] = []
        self._lock = threading.Lock()  # one task at a time: a node has one task slot
        self.batch: FakeBatch | None = None  # the service whose tasks these run (see attach)
        if nodes is not None:
            self._boot(nodes)

    def _boot(self, nodes: list[tuple[str, str]]) -> None:
        hosts = Hosts(
            self.root / "nodes",
            nodes,
            self.batch_root,
            self.hosts_file,
            read_only_hosts=self.read_only_hosts,
            cpus=self.cpus,
        )
        hosts.__enter__()
        self.hosts, self.ids = hosts, [node_id for node_id, _ in nodes]

    def __enter__(self) -> PoolNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hosts is not None:
            self.hosts.close()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.hosts or [])

    def node(self, node_id: str) -> Node:
        assert self.hosts is not None, "no nodes yet"
        return self.hosts[self.ids.index(node_id)]

    def host_path(self, node_id: str, path: str) -> Path:
        """Where this machine sees ``path``, a path as the node sees it."""
        rel = Path(path).relative_to(self.batch_root)
        return self.node(node_id).root / rel

    # -- a task ------------------------------------------------------------------------------
    def start(
        self,
        task: dict[str, Any],
        job_id: str,
        node_ids: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> TaskRun:
        """Start one attempt of ``task`` (a Batch task body) on its nodes; returns at once."""
        multi = task.get("multiInstanceSettings")
        count = multi.get("numberOfInstances", 1) if multi else 1
        chosen = (node_ids or self.ids)[:count]
        if len(chosen) < count:
            raise ValueError(f"task {task['id']} needs {count} nodes; the pool has {len(chosen)}")
        rel = Path("workitems") / job_id / "job-1" / task["id"]
        subtasks = []
        for i, node_id in enumerate(chosen):
            node = self.node(node_id)
            task_dir = node.root / rel
            shutil.rmtree(task_dir, ignore_errors=True)  # a retry starts in a fresh directory
            for sub in ("wd", "shared"):
                (task_dir / sub).mkdir(parents=True)
            self._mounts(node)
            subtasks.append(Subtask(i, node, node_id, task_dir))
        fetch_resources(task, subtasks[0].task_dir / "wd")  # task resource files: primary only
        image = self._image(task)
        if image is not None:
            for sub in subtasks:
                sub.container = self._container(sub, image, rel)
        run = TaskRun(
            job_id,
            task["id"],
            subtasks,
            multi.get("coordinationCommandLine") if multi else None,
            task["commandLine"],
        )
        envs = [self._environment(task, job_id, run, s, env or {}) for s in subtasks]
        timeout = _seconds(task.get("constraints", {}).get("maxWallClockTime"))
        self.runs.append(run)
        threading.Thread(target=self._run, args=(run, envs, timeout), daemon=True).start()
        return run

    def _image(self, task: dict[str, Any]) -> PulledImage | None:
        """The task's image, pulled (once per node set: the nodes share one image cache)."""
        settings = task.get("containerSettings")
        if self.images is None or not settings:
            return None
        name = settings["imageName"]
        return self.images.pull(self.aliases.get(name, name))

    def _container(self, sub: Subtask, image: PulledImage, rel: Path) -> Container:
        """What Batch maps into a Linux container task: the node's Batch root at the same path
        (the task folders and file mounts with it), and the host's network and names."""
        container = Container(image, sub.node.root.parent / "containers" / rel.name)
        binds = [
            Bind(self.batch_root, str(self.batch_root)),
            # The NFS mount is a link to this folder (as the node sees it): the same in here.
            Bind(self.nfs_dir.resolve(), str(self.nfs_dir.resolve())),
            Bind(sub.node.hosts_file, "/etc/hosts", self.read_only_hosts),
            Bind(Path("/etc/resolv.conf"), "/etc/resolv.conf", True),
        ]
        container.start(sub.node.run_in_mounts, binds)
        return container

    def _mounts(self, node: Node) -> None:
        mounts = node.root / "fsmounts"
        mounts.mkdir(exist_ok=True)
        scripts = mounts / "scripts"
        shutil.rmtree(scripts, ignore_errors=True)
        self.scripts(scripts)
        self.nfs_dir.mkdir(parents=True, exist_ok=True)
        if not (mounts / "nfs").is_symlink():
            (mounts / "nfs").symlink_to(self.nfs_dir.resolve(), target_is_directory=True)

    def _environment(
        self, task: dict[str, Any], job_id: str, run: TaskRun, sub: Subtask, extra: dict[str, str]
    ) -> dict[str, str]:
        addresses = [s.node.address for s in run.subtasks]
        inside = self.batch_root / sub.task_dir.relative_to(sub.node.root)
        # A container task: the image's environment, the task's settings over it (Batch maps
        # every task variable in); the image decides PATH.
        base = (
            sub.container.image.environment() if sub.container else {"PATH": f"{BIN}:{SYSTEM_PATH}"}
        )
        env = {"LANG": "C.UTF-8", **base, **extra}
        env.update({e["name"]: e["value"] for e in task.get("environmentSettings", [])})
        env.update(
            {
                # A task's $HOME need not be the passwd home of the user it runs as.
                "HOME": str(inside),
                "AZ_BATCH_NODE_ID": sub.node_id,
                "AZ_BATCH_JOB_ID": job_id,
                "AZ_BATCH_TASK_ID": task["id"],
                "AZ_BATCH_NODE_ROOT_DIR": str(self.batch_root),
                "AZ_BATCH_NODE_MOUNTS_DIR": str(self.batch_root / "fsmounts"),
                "AZ_BATCH_TASK_DIR": str(inside),
                "AZ_BATCH_TASK_WORKING_DIR": str(inside / "wd"),
            }
        )
        if "multiInstanceSettings" in task:
            env.update(
                {
                    "AZ_BATCH_HOST_LIST": ",".join(addresses),
                    "AZ_BATCH_NODE_LIST": ";".join(addresses),
                    "AZ_BATCH_MASTER_NODE": f"{addresses[0]}:{MASTER_PORT}",
                    "AZ_BATCH_IS_CURRENT_NODE_MASTER": "true" if sub.index == 0 else "false",
                    "AZ_BATCH_TASK_SHARED_DIR": str(inside / "shared"),
                }
            )
        return env

    def _run(self, run: TaskRun, envs: list[dict[str, str]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            run.started = time.time()
            try:
                for sub in run.subtasks:
                    sub.set("running")
                code = self._coordinate(run, envs, deadline) if run.coordination else 0
                if code == 0 and self.coordination_in_own_container:
                    self._new_containers(run)
                if code == 0:
                    run.application_started = time.time()
                    primary = self._popen(run.primary, envs[0], run.command)
                    code = self._wait([primary], deadline, run.subtasks)[0][0]
            except Exception as exc:  # the agent reports what broke as a failed task
                with open(run.primary.task_dir / "stderr.txt", "a") as err:
                    err.write(f"node agent: {exc}\n")
                code = -1
            finally:
                for sub in run.subtasks:  # the task's container ends on every node
                    try:
                        sub.node.kill_processes()
                        if sub.container is not None:
                            sub.container.stop(sub.node.run_in_mounts)
                    except Exception as exc:  # reported as a failed task, as above
                        with open(run.primary.task_dir / "stderr.txt", "a") as err:
                            err.write(f"node agent: ending the task on {sub.node_id}: {exc}\n")
                        code = -1
                    if sub.state != "completed":
                        sub.set("completed")
                run.exit_code = code
                run.done.set()

    def _new_containers(self, run: TaskRun) -> None:
        """The coordination commands' containers end (their processes with them); the
        application command gets a container of its own on the primary."""
        for sub in run.subtasks:
            if sub.container is not None:
                sub.node.kill_processes()
                sub.container.stop(sub.node.run_in_mounts)
        primary = run.primary
        if primary.container is not None:
            primary.container = self._container(primary, primary.container.image, Path(run.task_id))

    def _coordinate(self, run: TaskRun, envs: list[dict[str, str]], deadline: float) -> int:
        """Every node's coordination command; the first to fail stops the others."""
        command = run.coordination or ""
        subs = run.subtasks
        procs = [self._popen(sub, env, command) for sub, env in zip(subs, envs, strict=True)]
        ended = self._wait(procs, deadline, subs, stop_on_failure=True)
        for sub, (code, _) in zip(subs, ended, strict=True):
            sub.exit_code = code
        failures = [
            (sub, code)
            for sub, (code, stopped) in zip(subs, ended, strict=True)
            if code and not stopped
        ]
        if not failures:  # all stopped at the deadline, or all succeeded
            return next((code for code, _ in ended if code), 0)
        run.failed_node = failures[0][0].node_id
        return failures[0][1]

    def _popen(self, sub: Subtask, env: dict[str, str], command: str) -> subprocess.Popen[str]:
        self.commands.append((sub.node_id, command))
        inside = self.batch_root / sub.task_dir.relative_to(sub.node.root)
        with (
            open(sub.task_dir / "stdout.txt", "a") as out,
            open(sub.task_dir / "stderr.txt", "a") as err,
        ):
            root = sub.container.root if sub.container else None
            return sub.node.popen(shlex.split(command), env, inside / "wd", out, err, root)

    def _wait(
        self,
        procs: list[subprocess.Popen[str]],
        deadline: float,
        subtasks: list[Subtask],
        stop_on_failure: bool = False,
    ) -> list[tuple[int, bool]]:
        """(exit code, stopped by us) of each; on a failure (if asked) or past the deadline,
        the others are stopped."""
        while True:
            codes = [p.poll() for p in procs]
            if None not in codes:
                break
            if stop_on_failure and any(c not in (0, None) for c in codes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if None in codes:
            for sub in subtasks:
                sub.node.kill_processes()
        return [(p.wait(timeout=30), code is None) for p, code in zip(procs, codes, strict=True)]

    # -- the fake Batch service's executor ----------------------------------------------------
    def attach(self, batch: FakeBatch) -> None:
        """Run the fake service's tasks on these nodes; it lists subtasks from here."""
        self.batch = batch
        batch.executor = self

    def __call__(self, task: dict[str, Any], env: dict[str, str]) -> Attempt:
        pool_nodes = self._pool_nodes(env["AZ_BATCH_POOL_ID"])
        with self._lock:
            if self.hosts is None:
                self._boot([(n["id"], n["ipAddress"]) for n in pool_nodes])
        by_address = {n["ipAddress"]: n["id"] for n in pool_nodes}
        hosts = env.get("AZ_BATCH_HOST_LIST", "").split(",")
        node_ids = [by_address[a] for a in hosts if a in by_address] or None
        self._forward_urls(task, node_ids)
        run = self.start(task, env["AZ_BATCH_JOB_ID"], node_ids)
        code = run.wait()
        primary = run.primary
        return Attempt(code, primary.stdout() + primary.stderr(), working_files(primary.wd))

    def preempted(self, node_id: str, task_nodes: list[str]) -> None:
        """Spot capacity taken back (the fake service's ``preempt``): the node's VM is gone,
        every process on it killed at once, and the task it ran ends on its other nodes (the
        service requeues it). A new VM in its place starts with an empty Batch root. Returns
        once the attempt has ended everywhere."""
        if self.hosts is None:
            return
        for other in [node_id, *(n for n in task_nodes if n != node_id)]:
            self.node(other).kill_processes()
        for run in self.runs:
            if node_id in [sub.node_id for sub in run.subtasks]:
                run.done.wait(timeout=120)
        shutil.rmtree(self.node(node_id).root / "workitems", ignore_errors=True)

    def _pool_nodes(self, pool_id: str) -> list[dict[str, Any]]:
        assert self.batch is not None, "attach() the nodes to a fake Batch service first"
        return list(self.batch.nodes.get(pool_id, []))

    def _forward_urls(self, task: dict[str, Any], node_ids: list[str] | None) -> None:
        """Services on this machine's loopback that the task is pointed at (Azurite)."""
        for setting in task.get("environmentSettings", []):
            url = urlsplit(setting["value"]) if "://" in setting["value"] else None
            if url and url.hostname in ("127.0.0.1", "localhost") and url.port:
                for node_id in node_ids or self.ids[:1]:
                    self.node(node_id).forward(url.port)

    def subtasks(self, job_id: str, task_id: str) -> list[dict[str, Any]]:
        """The newest attempt's secondaries, as ``list_subtasks`` returns them."""
        runs = [r for r in self.runs if (r.job_id, r.task_id) == (job_id, task_id)]
        if not runs:
            return []
        assert self.batch is not None
        pool_id = self.batch.jobs[job_id]["poolInfo"]["poolId"]
        root = f"workitems/{job_id}/job-1/{task_id}"
        listing = []
        for sub in runs[-1].subtasks[1:]:
            node_url = f"{self.batch.url}/pools/{pool_id}/nodes/{sub.node_id}"
            item: dict[str, Any] = {
                "id": sub.index,
                "nodeInfo": {
                    "affinityId": f"TVM:{sub.node_id}",
                    "nodeUrl": node_url,
                    "poolId": pool_id,
                    "nodeId": sub.node_id,
                    "taskRootDirectory": root,
                    "taskRootDirectoryUrl": f"{node_url}/files/{root}",
                },
                "state": sub.state,
                **sub.times,
            }
            if sub.previous:
                item["previousState"], item["previousStateTransitionTime"] = sub.previous
            if sub.state == "completed" and sub.exit_code is not None:
                item["exitCode"] = sub.exit_code
                item["result"] = "success" if sub.exit_code == 0 else "failure"
                if sub.exit_code != 0:
                    item["failureInfo"] = {
                        "category": "usererror",
                        "code": "FailureExitCode",
                        "message": "The task process exited with an unexpected exit code",
                    }
            listing.append(item)
        return listing
