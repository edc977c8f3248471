"""A fake Azure Batch account: pools, nodes, jobs, (multi-instance) tasks, task files.

State changes follow the service: a pool allocates over a few polls, nodes come up in a chosen
state, a task runs attempts until one succeeds or ``maxTaskRetryCount`` is used up, output files
are uploaded by the "node" through the ``containerUrl`` the task carries (to Azurite, so a wrong
SAS fails as it would on Azure), and terminating a job ends its running tasks. A task's attempt
is either scripted (``Attempt``) or produced by an executor that really runs the command line.
"""

from __future__ import annotations

import fnmatch
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests

from tests.fakes.transport import Recorder, Request, Response

NOW = "2026-11-22T00:00:00.000Z"


@dataclass
class Attempt:
    exit_code: int = 0
    stdout: str = ""
    files: dict[str, bytes] = field(default_factory=dict)  # relative to the working directory
    seconds: float = 0.0  # how long the attempt keeps the task running


Executor = Callable[[dict[str, Any], dict[str, str]], Attempt]


def _error(status: int, code: str, message: str) -> Response:
    return Response(
        status,
        {
            "code": code,
            "message": {"lang": "en-US", "value": f"{message}\nRequestId:0\nTime:{NOW}"},
        },
    )


def _split_pattern(pattern: str) -> tuple[str, str | None]:
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return "/".join(parts[:i]), "/".join(parts[i:])
    return pattern, None


def matched_outputs(pattern: str, destination: str, files: dict[str, bytes]) -> dict[str, bytes]:
    """Blob name -> content for Batch's OutputFile rules over the attempt's files."""
    base, glob = _split_pattern(pattern)
    found = {}
    for rel, data in files.items():
        if glob is None:
            if rel == base:
                found[destination] = data
            continue
        prefix = f"{base}/" if base else ""
        if not rel.startswith(prefix):
            continue
        rest = rel[len(prefix) :]
        if glob == "**/*" or fnmatch.fnmatch(rest, glob):
            found[f"{destination}/{rest}" if destination else rest] = data
    return found


@dataclass
class _Task:
    job_id: str
    body: dict[str, Any]
    state: str = "active"
    retry: int = 0
    attempt: Attempt | None = None
    stdout: bytes = b""
    polls: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    execution: dict[str, Any] = field(default_factory=dict)
    uploaded: list[str] = field(default_factory=list)


class FakeBatch:
    host = "retrainbatch.westeurope.batch.azure.com"
    account = "retrainbatch"

    def __init__(self) -> None:
        self.requests = Recorder()
        self.pools: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, list[dict[str, Any]]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.tasks: dict[tuple[str, str], _Task] = {}
        self.node_state = "idle"
        self.node_errors: list[dict[str, Any]] = []
        self.allocation_polls = 2
        self.run_polls = 1
        self.scripts: dict[str, list[Attempt]] = {}  # task id prefix -> attempts in order
        self.executor: Executor | None = None
        self._alloc: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        return f"https://{self.host}"

    # -- dispatch -----------------------------------------------------------------------------
    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        auth = req.headers.get("Authorization", "")
        if not (auth.startswith(f"SharedKey {self.account}:") or auth.startswith("Bearer ")):
            return _error(401, "AuthenticationFailed", "Server failed to authenticate the request")
        parts = [p for p in req.path.split("/") if p]
        with self._lock:
            return self._route(req, parts)

    def _route(self, req: Request, p: list[str]) -> Response:
        m = req.method
        if p == ["pools"] and m == "POST":
            return self._create_pool(req.json())
        if p[:1] == ["pools"] and len(p) >= 2:
            pool_id = p[1]
            if len(p) == 2 and m == "GET":
                return self._get_pool(pool_id)
            if len(p) == 2 and m == "DELETE":
                return self._delete_pool(pool_id)
            if p[2:] == ["resize"] and m == "POST":
                return self._resize(pool_id, req.json())
            if p[2:] == ["stopresize"] and m == "POST":
                self.pools[pool_id]["allocationState"] = "steady"
                return Response(202)
            if p[2:] == ["disableautoscale"] and m == "POST":
                self.pools[pool_id]["enableAutoScale"] = False
                return Response(200)
            if p[2:] == ["nodes"] and m == "GET":
                return Response(200, {"value": self.nodes.get(pool_id, [])})
        if p == ["jobs"] and m == "POST":
            body = req.json()
            if body["id"] in self.jobs:
                return _error(409, "JobExists", "The specified job already exists.")
            self.jobs[body["id"]] = {**body, "state": "active", "creationTime": NOW}
            return Response(201)
        if p == ["jobs"] and m == "GET":
            wanted = req.query.get("$filter", "")
            jobs = [
                j for j in self.jobs.values() if f"state eq '{j['state']}'" in wanted or not wanted
            ]
            return Response(200, {"value": jobs})
        if p[:1] == ["jobs"] and len(p) >= 2:
            job_id = p[1]
            if job_id not in self.jobs:
                return _error(404, "JobNotFound", "The specified job does not exist.")
            if len(p) == 2 and m == "GET":
                return Response(200, self.jobs[job_id])
            if p[2:] == ["terminate"] and m == "POST":
                return self._terminate(job_id)
            if p[2:] == ["tasks"] and m == "POST":
                return self._create_task(job_id, req.json())
            if len(p) >= 4 and p[2] == "tasks":
                key = (job_id, p[3])
                if key not in self.tasks:
                    return _error(404, "TaskNotFound", "The specified task does not exist.")
                if len(p) == 4 and m == "GET":
                    return Response(200, self._get_task(key))
                if p[4:] == ["subtasksinfo"]:
                    return Response(200, {"value": self._subtasks(key)})
                if p[4:5] == ["files"] and m == "GET":
                    return self._file(key, "/".join(p[5:]), req.headers.get("ocp-range"))
        return _error(400, "InvalidUri", f"the fake does not serve {m} {req.path}")

    # -- pools --------------------------------------------------------------------------------
    def add_pool(self, body: dict[str, Any], steady_nodes: int | None = None) -> None:
        """Put a pool in place, as if created earlier (by another run or by hand)."""
        self._create_pool(body)
        self._alloc[body["id"]] = 0
        self._settle(body["id"])

    def _create_pool(self, body: dict[str, Any]) -> Response:
        if body["id"] in self.pools:
            return _error(409, "PoolExists", "The specified pool already exists.")
        self.pools[body["id"]] = {
            **body,
            "url": f"{self.url}/pools/{body['id']}",
            "eTag": "0x1",
            "state": "active",
            "allocationState": "resizing",
            "currentDedicatedNodes": 0,
            "currentLowPriorityNodes": 0,
            "targetDedicatedNodes": body.get("targetDedicatedNodes", 0),
            "targetLowPriorityNodes": body.get("targetLowPriorityNodes", 0),
            "creationTime": NOW,
        }
        self._alloc[body["id"]] = self.allocation_polls
        return Response(201)

    def _settle(self, pool_id: str) -> None:
        pool = self.pools[pool_id]
        pool["allocationState"] = "steady"
        want = pool.get("targetDedicatedNodes", 0) + pool.get("targetLowPriorityNodes", 0)
        if pool.get("enableAutoScale"):
            want = max(want, 1)
        nodes = self.nodes.setdefault(pool_id, [])
        del nodes[want:]
        while len(nodes) < want:
            n = len(nodes)
            nodes.append(
                {
                    "id": f"tvmps_{n:04d}",
                    "state": self.node_state,
                    "ipAddress": f"10.0.0.{4 + n}",
                    "isDedicated": True,
                    "errors": self.node_errors,
                    "vmSize": pool["vmSize"],
                }
            )
        pool["currentDedicatedNodes"] = pool.get("targetDedicatedNodes", 0)
        pool["currentLowPriorityNodes"] = pool.get("targetLowPriorityNodes", 0)

    def _get_pool(self, pool_id: str) -> Response:
        pool = self.pools.get(pool_id)
        if pool is None:
            return _error(404, "PoolNotFound", "The specified pool does not exist.")
        if pool["state"] == "deleting":
            del self.pools[pool_id]
            self.nodes.pop(pool_id, None)
            return Response(200, {**pool})
        if pool["allocationState"] == "resizing":
            self._alloc[pool_id] -= 1
            if self._alloc[pool_id] <= 0:
                self._settle(pool_id)
        return Response(200, pool)

    def _resize(self, pool_id: str, body: dict[str, Any]) -> Response:
        pool = self.pools[pool_id]
        if pool["allocationState"] != "steady":
            return _error(409, "PoolNotSteady", "The pool is not in a steady state.")
        if pool.get("enableAutoScale"):
            return _error(409, "AutoScalingEnabled", "The pool has autoscale enabled.")
        pool["targetDedicatedNodes"] = body.get("targetDedicatedNodes", 0)
        pool["targetLowPriorityNodes"] = body.get("targetLowPriorityNodes", 0)
        pool["allocationState"] = "resizing"
        self._alloc[pool_id] = self.allocation_polls
        return Response(202)

    def _delete_pool(self, pool_id: str) -> Response:
        if pool_id not in self.pools:
            return _error(404, "PoolNotFound", "The specified pool does not exist.")
        self.pools[pool_id]["state"] = "deleting"
        return Response(202)

    # -- jobs and tasks -----------------------------------------------------------------------
    def _create_task(self, job_id: str, body: dict[str, Any]) -> Response:
        key = (job_id, body["id"])
        if key in self.tasks:
            return _error(409, "TaskExists", "The specified task already exists.")
        if self.jobs[job_id]["state"] != "active":
            return _error(409, "JobCompleted", "The specified job is already in a completed state.")
        self.tasks[key] = _Task(job_id, body)
        return Response(201)

    def _script_for(self, task_id: str) -> list[Attempt]:
        for prefix, attempts in self.scripts.items():
            if task_id.startswith(prefix):
                return attempts
        return [Attempt()]

    def _node_env(self, task: _Task) -> dict[str, str]:
        pool_id = self.jobs[task.job_id]["poolInfo"]["poolId"]
        nodes = self.nodes.get(pool_id, [])
        count = task.body.get("multiInstanceSettings", {}).get("numberOfInstances", 1)
        ips = [n["ipAddress"] for n in nodes[:count]] or ["10.0.0.4"]
        return {
            "AZ_BATCH_POOL_ID": pool_id,
            "AZ_BATCH_JOB_ID": task.job_id,
            "AZ_BATCH_TASK_ID": task.body["id"],
            "AZ_BATCH_HOST_LIST": ",".join(ips),
            "AZ_BATCH_NODE_LIST": ";".join(ips),
            "AZ_BATCH_IS_CURRENT_NODE_MASTER": "true",
            **{e["name"]: e["value"] for e in task.body.get("environmentSettings", [])},
        }

    def _start_attempt(self, task: _Task) -> None:
        task.state, task.polls, task.stdout = "running", 0, b""
        task.finished = threading.Event()
        task.execution = {"startTime": NOW, "retryCount": task.retry, "requeueCount": 0}
        if self.executor is None:
            script = self._script_for(task.body["id"])
            task.attempt = script[min(task.retry, len(script) - 1)]
            task.stdout = task.attempt.stdout.encode()
            deadline = time.monotonic() + task.attempt.seconds
            threading.Timer(max(0.0, deadline - time.monotonic()), task.finished.set).start()
            return
        executor, env = self.executor, self._node_env(task)

        def run() -> None:
            task.attempt = executor(task.body, env)
            task.stdout = task.attempt.stdout.encode()
            task.finished.set()

        threading.Thread(target=run, daemon=True).start()

    def _get_task(self, key: tuple[str, str]) -> dict[str, Any]:
        task = self.tasks[key]
        task.polls += 1
        if task.state == "active":
            self._start_attempt(task)
        elif task.state == "running" and task.finished.is_set() and task.polls > self.run_polls:
            self._end_attempt(task)
        return self._task_json(task)

    def _end_attempt(self, task: _Task) -> None:
        attempt = task.attempt or Attempt(exit_code=-1)
        limit = task.body.get("constraints", {}).get("maxTaskRetryCount", 0)
        if attempt.exit_code != 0 and task.retry < limit:
            task.retry += 1
            self._start_attempt(task)
            return
        task.state = "completed"
        task.execution.update({"endTime": NOW, "exitCode": attempt.exit_code})
        if attempt.exit_code == 0:
            task.execution["result"] = "success"
        else:
            task.execution["result"] = "failure"
            task.execution["failureInfo"] = {
                "category": "usererror",
                "code": "FailureExitCode",
                "message": "The task process exited with an unexpected exit code",
            }
        self._upload_outputs(task, attempt)

    def _upload_outputs(self, task: _Task, attempt: Attempt) -> None:
        files = {**attempt.files, "../stdout.txt": task.stdout, "../stderr.txt": b""}
        success = attempt.exit_code == 0
        for out in task.body.get("outputFiles", []):
            condition = out.get("uploadOptions", {}).get("uploadCondition", "taskSuccess")
            if (condition == "taskSuccess" and not success) or (
                condition == "taskFailure" and success
            ):
                continue
            dest = out["destination"]["container"]
            base, _, sas = dest["containerUrl"].partition("?")
            if not sas:  # identity upload: the fake has no identity to act as
                continue
            for blob, data in matched_outputs(
                out["filePattern"], dest.get("path", ""), files
            ).items():
                reply = requests.put(
                    f"{base}/{blob}?{sas}",
                    data=data,
                    headers={"x-ms-blob-type": "BlockBlob", "x-ms-version": "2025-01-05"},
                    timeout=30,
                )
                reply.raise_for_status()  # a SAS without write permission fails here
                task.uploaded.append(blob)

    def _task_json(self, task: _Task) -> dict[str, Any]:
        out = {
            **task.body,
            "state": task.state,
            "url": f"{self.url}/jobs/{task.job_id}/tasks/{task.body['id']}",
            "eTag": "0x1",
            "creationTime": NOW,
        }
        if task.execution:
            out["executionInfo"] = dict(task.execution)
            out["nodeInfo"] = {
                "nodeId": "tvmps_0000",
                "poolId": self.jobs[task.job_id]["poolInfo"]["poolId"],
            }
        return out

    def _subtasks(self, key: tuple[str, str]) -> list[dict[str, Any]]:
        listing = getattr(self.executor, "subtasks", None)
        if listing is not None:  # nodes that really run the subtasks know their states
            return list(listing(*key))
        task = self.tasks[key]
        count = task.body.get("multiInstanceSettings", {}).get("numberOfInstances", 1)
        state = {"active": "preparing"}.get(task.state, task.state)
        subs = []
        for i in range(1, count):  # the secondaries; the primary is the task itself
            sub: dict[str, Any] = {
                "id": i,
                "state": state,
                "nodeInfo": {"nodeId": f"tvmps_{i:04d}"},
            }
            if task.state == "completed":
                sub["exitCode"] = 0
            subs.append(sub)
        return subs

    def _file(self, key: tuple[str, str], name: str, ocp_range: str | None) -> Response:
        task = self.tasks[key]
        if name != "stdout.txt" or task.state == "active":
            return _error(404, "FileNotFound", f"The specified file {name} does not exist.")
        start = int(ocp_range.split("=", 1)[1].split("-", 1)[0]) if ocp_range else 0
        return Response(200, task.stdout[start:], {"Content-Type": "application/octet-stream"})

    def _terminate(self, job_id: str) -> Response:
        job = self.jobs[job_id]
        job["state"] = "completed"
        for task in self.tasks.values():
            if task.job_id == job_id and task.state != "completed":
                task.state = "completed"
                task.execution.update(
                    {
                        "endTime": NOW,
                        "result": "failure",
                        "failureInfo": {
                            "category": "usererror",
                            "code": "TaskEnded",
                            "message": "The task was ended because its job was terminated",
                        },
                    }
                )
        return Response(202)

    # -- for assertions -----------------------------------------------------------------------
    def bodies(self, method: str, path: str) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests.find(method, path)]
