"""A fake Azure Batch account, as strict as the service: pools, nodes, jobs, (multi-instance)
tasks, task files.

Every request body is checked against the Batch 2025-06-01 spec's definitions (vendored in
``spec/``) and refused with HTTP 400 and Batch's error body when it does not conform; every body
the fake answers with is checked against the spec too, so the fake cannot drift either.

State moves on as on the service, one step per request the account receives (the service does
not wait for its clients): a pool resizes and then is steady, possibly with ``resizeErrors``
(account quota, allocation timeout); nodes go ``creating`` -> ``starting`` -> ``idle`` (or
``unusable`` with errors) -> ``running``; Spot nodes can be preempted, and their task goes back to
``active`` with its ``retryCount`` unchanged and a new ``stdout.txt`` when it starts again; a job
with ``onAllTasksComplete: terminatejob`` ends when all its tasks have (at once when it has none);
a multi-instance task waits until the pool has enough idle nodes, inter-node communication and
one task slot per node. Throttling (429/503 with ``Retry-After``) can be switched on at a rate.

A task's attempt is either scripted (``Attempt``) or produced by an executor that really runs
the command line (``tests/fakes/node.py``): ``FakeBatch._launch`` is the one place an attempt is
handed to it. Output files are uploaded by the "node" to Azurite through the ``containerUrl``
the task carries, after checking the SAS expiry against the account's clock (which tests can move
forward: an attempt may take hours of service time in milliseconds).
"""

from __future__ import annotations

import fnmatch
import itertools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs

import requests

from tests.fakes.scheduled_events import ScheduledEvents
from tests.fakes.schema import Problem, Schema
from tests.fakes.transport import Recorder, Request, Response

API_VERSION = "2025-06-01"
SPEC = Schema.load("batch-2025-06-01.json")
FOREVER = "P10675199DT2H48M5.4775807S"  # what the service reports for "no limit"
_MESSAGES = {
    "UnsupportedProperty": "One of the properties specified in the request body is not supported.",
    "MissingRequiredProperty": "A required property was not specified in the request body.",
    "InvalidPropertyValue": "The value provided for one of the properties in the request body "
    "is invalid.",
}
QUOTA_CODES = {
    "dedicated": "AccountCoreQuotaReached",
    "lowPriority": "AccountLowPriorityCoreQuotaReached",
}


# Which spec definition each request body of the pipeline must be (method, path pattern).
REQUEST_BODIES = (
    ("POST", re.compile(r"^/pools$"), "BatchPoolCreateOptions"),
    ("POST", re.compile(r"^/pools/[^/]+/resize$"), "BatchPoolResizeOptions"),
    ("POST", re.compile(r"^/jobs$"), "BatchJobCreateOptions"),
    ("PATCH", re.compile(r"^/jobs/[^/]+$"), "BatchJobUpdateOptions"),
    ("POST", re.compile(r"^/jobs/[^/]+/terminate$"), "BatchJobTerminateOptions"),
    ("POST", re.compile(r"^/jobs/[^/]+/tasks$"), "BatchTaskCreateOptions"),
)


def body_definition(method: str, path: str) -> str:
    for verb, pattern, definition in REQUEST_BODIES:
        if verb == method and pattern.match(path):
            return definition
    raise KeyError(f"no request body is defined for {method} {path}")


@dataclass
class Attempt:
    exit_code: int = 0
    stdout: str = ""
    files: dict[str, bytes] = field(default_factory=dict)  # relative to the working directory
    seconds: float = 0.0  # real time the attempt keeps the task running
    service_seconds: float = 0.0  # service time the attempt takes (moves the account's clock)


Executor = Callable[[dict[str, Any], dict[str, str]], Attempt]


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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


class Refused(Exception):
    """A request the service answers with an error (status, Batch error code, message)."""

    def __init__(self, status: int, code: str, message: str, values: dict[str, str] | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.values = status, code, message, values or {}


def _invalid(name: str, value: Any, reason: str) -> Refused:
    return Refused(
        400,
        "InvalidPropertyValue",
        _MESSAGES["InvalidPropertyValue"],
        {"PropertyName": name, "PropertyValue": str(value), "Reason": reason},
    )


@dataclass
class _Task:
    job_id: str
    body: dict[str, Any]
    created: datetime
    state: str = "active"
    retry: int = 0
    requeues: int = 0  # user-requested requeues (pool shrink)
    attempt: Attempt | None = None
    generation: int = 0  # bumped when an attempt is abandoned (preemption, termination)
    starts: int = 0  # attempts started, retries and requeues alike
    stdout: bytes = b""
    started: bool = False  # an attempt has run: the task has files
    running_since: int = 0  # tick the current attempt started
    finished: threading.Event = field(default_factory=threading.Event)
    execution: dict[str, Any] = field(default_factory=lambda: {"retryCount": 0, "requeueCount": 0})
    nodes: list[str] = field(default_factory=list)  # primary first
    subtasks: list[dict[str, Any]] = field(default_factory=list)
    uploaded: list[str] = field(default_factory=list)
    state_changed: datetime | None = None


class FakeBatch:
    host = "retrainbatch.westeurope.batch.azure.com"
    account = "retrainbatch"

    def __init__(self) -> None:
        self.requests = Recorder()
        self.refused: list[tuple[str, str, Problem]] = []  # (method, path, the spec problem)
        self.allow_refusals = False  # a test that sends non-conforming bodies on purpose
        self.pools: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, list[dict[str, Any]]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.tasks: dict[tuple[str, str], _Task] = {}
        # Knobs a test turns to make the service behave one way or another.
        self.allocation_ticks = 2  # requests from a resize's start to a steady pool
        self.boot_ticks = 1  # requests a node spends creating, then starting
        self.node_state = "idle"  # what a node becomes after starting (or unusable, ...)
        self.node_errors: list[dict[str, Any]] = []
        self.quota: dict[str, int | None] = {"dedicated": None, "lowPriority": None}  # nodes
        self.capacity: dict[str, int | None] = {"dedicated": None, "lowPriority": None}
        self.autoscale_nodes = 1  # what an autoscale formula evaluates to
        self.run_ticks = 1  # requests a task stays running at least
        self.throttle_every = 0  # every Nth request is throttled (0: never)
        self.throttle_status = 429
        self.retry_after = 1
        self.scripts: dict[str, list[Attempt]] = {}  # task id prefix -> attempts in order
        self.throttled = 0  # requests answered 429/503
        self.executor: Executor | None = None
        self.identity_upload: Callable[[str, bytes], None] | None = None  # blob URL, data
        # The nodes' Scheduled Events endpoint, where a preemption with notice is announced.
        self.scheduled_events: ScheduledEvents | None = None
        self.preemptions: list[tuple[str, datetime]] = []  # (node id, service time)
        self.clock_offset = timedelta(0)
        self._tick = 0
        self._count = 0
        self._ids = itertools.count()
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        return f"https://{self.host}"

    def now(self) -> datetime:
        return datetime.now(UTC) + self.clock_offset

    # -- dispatch -----------------------------------------------------------------------------
    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        with self._lock:
            response = self._answer(req)
            # The service's clock, as its responses' Date header tells it.
            response.headers.setdefault("Date", _http_date(self.now()))
            return response

    def _answer(self, req: Request) -> Response:
        auth = req.headers.get("Authorization", "")
        if not (auth.startswith(f"SharedKey {self.account}:") or auth.startswith("Bearer ")):
            return self._error(
                Refused(401, "AuthenticationFailed", "Server failed to authenticate the request.")
            )
        if req.query.get("api-version") != API_VERSION:
            return self._error(
                Refused(
                    400,
                    "InvalidQueryParameterValue",
                    "Value for one of the query parameters specified in the request URI is "
                    "invalid.",
                    {
                        "QueryParameterName": "api-version",
                        "QueryParameterValue": str(req.query.get("api-version")),
                    },
                )
            )
        self._count += 1
        if self.throttle_every and self._count % self.throttle_every == 0:
            code = "TooManyRequests" if self.throttle_status == 429 else "ServerBusy"
            self.throttled += 1
            response = self._error(Refused(self.throttle_status, code, "The server is busy."))
            response.headers["Retry-After"] = str(self.retry_after)
            return response
        self._advance()
        try:
            return self._route(req, [p for p in req.path.split("/") if p])
        except Refused as refused:
            return self._error(refused)

    def _error(self, refused: Refused) -> Response:
        body: dict[str, Any] = {
            "code": refused.code,
            "message": {
                "lang": "en-US",
                "value": f"{refused.message}\nRequestId:0\nTime:{_iso(self.now())}",
            },
        }
        if refused.values:
            body["values"] = [{"key": k, "value": v} for k, v in refused.values.items()]
        return Response(refused.status, self._checked(body, "BatchError"))

    def _checked(self, body: dict[str, Any], definition: str) -> dict[str, Any]:
        problems = SPEC.check(body, definition, request=False)
        if problems:  # the fake itself strayed from the spec: a bug in the test double
            raise AssertionError(f"fake Batch answered a non-conforming {definition}: {problems}")
        return body

    def _body(self, req: Request, definition: str) -> dict[str, Any]:
        if not req.headers.get("Content-Type", "").startswith("application/json"):
            raise Refused(
                400,
                "InvalidHeaderValue",
                "The value provided for one of the HTTP headers was not in the correct format.",
                {"HeaderName": "Content-Type"},
            )
        try:
            body = req.json()
        except ValueError as exc:
            raise Refused(
                400, "InvalidRequestBody", f"The request body is not valid JSON: {exc}"
            ) from None
        problems = SPEC.check(body if body is not None else {}, definition)
        if problems:
            first = problems[0]
            self.refused.append((req.method, req.path, first))
            values = {"PropertyName": first.name, "Reason": f"{first.path}: {first.reason}"}
            if first.value is not None:
                values["PropertyValue"] = str(first.value)
            raise Refused(400, first.code, _MESSAGES[first.code], values)
        return dict(body or {})

    def _route(self, req: Request, p: list[str]) -> Response:
        m = req.method
        if p == ["pools"] and m == "POST":
            return self._create_pool(self._body(req, "BatchPoolCreateOptions"))
        if p[:1] == ["pools"] and len(p) >= 2:
            pool = self._pool(p[1])
            if len(p) == 2 and m == "GET":
                return Response(200, self._checked(self._pool_json(pool), "BatchPool"))
            if len(p) == 2 and m == "DELETE":
                return self._delete_pool(pool)
            if p[2:] == ["resize"] and m == "POST":
                return self._resize(pool, self._body(req, "BatchPoolResizeOptions"))
            if p[2:] == ["stopresize"] and m == "POST":
                if pool["allocationState"] == "resizing":
                    pool["allocationState"] = "stopping"
                return Response(202)
            if p[2:] == ["disableautoscale"] and m == "POST":
                pool["enableAutoScale"] = False
                pool.pop("autoScaleFormula", None)
                return Response(200)
            if p[2:] == ["nodes"] and m == "GET":
                nodes = [self._node_json(n) for n in self.nodes.get(pool["id"], [])]
                return Response(200, self._checked({"value": nodes}, "BatchNodeListResult"))
        if p == ["jobs"] and m == "POST":
            return self._create_job(self._body(req, "BatchJobCreateOptions"))
        if p == ["jobs"] and m == "GET":
            wanted = _odata_filter(req.query.get("$filter", ""))
            jobs = [
                self._job_json(j)
                for j in self.jobs.values()
                if all(str(self._job_json(j).get(k)) == v for k, v in wanted.items())
            ]
            return Response(200, self._checked({"value": jobs}, "BatchJobListResult"))
        if p[:1] == ["jobs"] and len(p) >= 2:
            job = self.jobs.get(p[1])
            if job is None:
                raise Refused(404, "JobNotFound", "The specified job does not exist.")
            if len(p) == 2 and m == "GET":
                return Response(200, self._checked(self._job_json(job), "BatchJob"))
            if len(p) == 2 and m == "PATCH":
                return self._update_job(job, self._body(req, "BatchJobUpdateOptions"))
            if p[2:] == ["terminate"] and m == "POST":
                body = self._body(req, "BatchJobTerminateOptions") if req.body else {}
                return self._terminate(job, body.get("terminateReason", "UserTerminate"))
            if p[2:] == ["tasks"] and m == "POST":
                return self._create_task(job, self._body(req, "BatchTaskCreateOptions"))
            if len(p) >= 4 and p[2] == "tasks":
                task = self.tasks.get((job["id"], p[3]))
                if task is None:
                    raise Refused(404, "TaskNotFound", "The specified task does not exist.")
                if len(p) == 4 and m == "GET":
                    return Response(200, self._checked(self._task_json(task), "BatchTask"))
                if p[4:] == ["terminate"] and m == "POST":
                    if task.state == "completed":
                        raise Refused(409, "TaskCompleted", "The specified task is completed.")
                    # Ended, not retried: the service counts no attempt against the retries.
                    self._abandon(
                        task, "completed", ("TaskEnded", "Task Was Ended by User Request")
                    )
                    return Response(204)
                if p[4:] == ["subtasksinfo"] and m == "GET":
                    # Nodes that really ran the subtasks know their states; else the model's.
                    listing = getattr(self.executor, "subtasks", None)
                    found = listing(job["id"], p[3]) if listing is not None else task.subtasks
                    subs = {"value": [dict(s) for s in found]}
                    return Response(200, self._checked(subs, "BatchTaskListSubtasksResult"))
                if p[4:5] == ["files"] and m in ("GET", "HEAD"):
                    return self._file(task, "/".join(p[5:]), m, req.headers.get("ocp-range"))
        raise Refused(
            400,
            "InvalidUri",
            f"The requested URI does not represent any resource on the server: {m} {req.path}",
        )

    # -- the passage of time --------------------------------------------------------------------
    def _advance(self) -> None:
        """One step of the service's own work, taken as each request arrives."""
        self._tick += 1
        for pool in list(self.pools.values()):
            self._advance_pool(pool)
        for job in self.jobs.values():
            self._advance_job(job)
        for task in self.tasks.values():
            ended = task.state == "running" and task.finished.is_set()
            if ended and self._tick - task.running_since >= self.run_ticks:
                self._end_attempt(task)
        for task in sorted(self.tasks.values(), key=lambda t: t.created):
            if task.state == "active":
                self._schedule(task)

    def _advance_pool(self, pool: dict[str, Any]) -> None:
        nodes = self.nodes.setdefault(pool["id"], [])
        if pool["state"] == "deleting":
            if self._tick - pool["_since"] >= 2:
                del self.pools[pool["id"]]
                self.nodes.pop(pool["id"], None)
            return
        if pool["allocationState"] == "stopping":
            self._set_allocation(pool, "steady")
        elif (
            pool["allocationState"] == "resizing"
            and self._tick - pool["_since"] >= self.allocation_ticks
        ):
            self._allocate(pool)
        for node in list(nodes):
            age = self._tick - node["_since"]
            if node["state"] == "leavingpool" and age >= 1:
                nodes.remove(node)
            elif node["state"] == "creating" and age >= self.boot_ticks:
                self._set_node(node, "starting")
            elif node["state"] == "starting" and age >= self.boot_ticks:
                self._set_node(node, self.node_state)
                if self.node_state in ("unusable", "starttaskfailed") and self.node_errors:
                    node["errors"] = [dict(e) for e in self.node_errors]
            elif node["state"] == "preempted" and age >= node.get("_recover", float("inf")):
                node.pop("_recover")
                self._set_node(node, "starting")

    def _allocate(self, pool: dict[str, Any]) -> None:
        """The resize completes: as many nodes as quota and capacity give, errors for the rest."""
        nodes = self.nodes[pool["id"]]
        errors = []
        for kind, dedicated in (("dedicated", True), ("lowPriority", False)):
            target = pool[f"target{kind[0].upper()}{kind[1:]}Nodes"]
            have = [
                n
                for n in nodes
                if n["isDedicated"] == dedicated
                and n["state"] != "leavingpool"
                and not n.get("_leaving")
            ]
            got = target
            for limit, code, message in (
                (
                    self.quota[kind],
                    QUOTA_CODES[kind],
                    "The specified account has reached its "
                    f"{'dedicated' if dedicated else 'Spot/low-priority'} core quota.",
                ),
                (
                    self.capacity[kind],
                    "AllocationTimedOut",
                    "Desired number of nodes could not be allocated as the resize timeout was "
                    "reached.",
                ),
            ):
                if limit is not None and got > limit:
                    got = limit
                    errors.append(
                        {
                            "code": code,
                            "message": message,
                            "values": [
                                {"name": "Requested", "value": str(target)},
                                {"name": "Allocated", "value": str(limit)},
                            ],
                        }
                    )
            for node in have[got:]:
                node["_leaving"] = True
            for _ in range(got - len(have)):
                nodes.append(self._new_node(pool, dedicated))
        for node in nodes:
            if node.get("_leaving") and node["state"] != "running":
                self._leave(node)
        pool["resizeErrors"] = errors
        pool["currentDedicatedNodes"] = sum(
            1 for n in nodes if n["isDedicated"] and n["state"] != "leavingpool"
        )
        pool["currentLowPriorityNodes"] = sum(
            1 for n in nodes if not n["isDedicated"] and n["state"] != "leavingpool"
        )
        if not any(n.get("_leaving") for n in nodes):  # else taskcompletion: still resizing
            self._set_allocation(pool, "steady")

    def _leave(self, node: dict[str, Any]) -> None:
        node.pop("_leaving", None)
        self._set_node(node, "leavingpool")

    def _new_node(self, pool: dict[str, Any], dedicated: bool) -> dict[str, Any]:
        n = pool["_nodes_made"]
        pool["_nodes_made"] += 1
        node = {
            "id": f"tvmps_{n:04d}{'d' if dedicated else 'p'}",
            "state": "creating",
            "ipAddress": f"10.0.0.{4 + n % 250}",
            "isDedicated": dedicated,
            "vmSize": pool["vmSize"],
            "allocationTime": _iso(self.now()),
            "_pool": pool["id"],
            "_since": self._tick,
            "_runs": 0,
            "_succeeded": 0,
        }
        node["stateTransitionTime"] = node["allocationTime"]
        return node

    def _set_node(self, node: dict[str, Any], state: str) -> None:
        node["state"], node["_since"] = state, self._tick
        node["stateTransitionTime"] = _iso(self.now())

    def _set_allocation(self, pool: dict[str, Any], state: str) -> None:
        pool["allocationState"], pool["_since"] = state, self._tick
        pool["allocationStateTransitionTime"] = _iso(self.now())

    # -- pools --------------------------------------------------------------------------------
    def _pool(self, pool_id: str) -> dict[str, Any]:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise Refused(404, "PoolNotFound", "The specified pool does not exist.")
        return pool

    def add_pool(
        self,
        body: dict[str, Any],
        *,
        identity: str | None = None,
        steady: bool = True,
    ) -> dict[str, Any]:
        """Put a pool in place as if created earlier (by another run, by hand, or through Azure
        Resource Manager with a user-assigned identity, which the data plane cannot attach)."""
        pool = self._new_pool(body)
        if identity:
            pool["identity"] = {
                "type": "UserAssigned",
                "userAssignedIdentities": [{"resourceId": identity}],
            }
        if steady:
            self._allocate(pool)
            for node in self.nodes[pool["id"]]:
                self._set_node(node, self.node_state)
        return pool

    def _new_pool(self, body: dict[str, Any]) -> dict[str, Any]:
        now = _iso(self.now())
        pool = {
            **body,
            "url": f"{self.url}/pools/{body['id']}",
            "eTag": f"0x{next(self._ids):x}",
            "state": "active",
            "creationTime": now,
            "lastModified": now,
            "stateTransitionTime": now,
            "resizeErrors": [],
            "currentDedicatedNodes": 0,
            "currentLowPriorityNodes": 0,
            "_since": self._tick,
            "_nodes_made": 0,
        }
        if body.get("enableAutoScale"):
            pool["targetDedicatedNodes"], pool["targetLowPriorityNodes"] = self.autoscale_nodes, 0
        pool.setdefault("targetDedicatedNodes", 0)
        pool.setdefault("targetLowPriorityNodes", 0)
        self.pools[body["id"]] = pool
        self.nodes[body["id"]] = []
        self._set_allocation(pool, "resizing")
        return pool

    def _create_pool(self, body: dict[str, Any]) -> Response:
        existing = self.pools.get(body["id"])
        if existing is not None:
            if existing["state"] == "deleting":
                raise Refused(
                    409,
                    "PoolBeingDeleted",
                    "The specified pool has been marked for deletion and is being reclaimed.",
                )
            raise Refused(409, "PoolExists", "The specified pool already exists.")
        autoscale = bool(body.get("enableAutoScale"))
        if autoscale and "autoScaleFormula" not in body:
            raise _invalid("autoScaleFormula", None, "required when enableAutoScale is true")
        if autoscale and ({"targetDedicatedNodes", "targetLowPriorityNodes"} & set(body)):
            raise _invalid(
                "targetDedicatedNodes", None, "must not be specified when enableAutoScale is true"
            )
        if not autoscale and "autoScaleFormula" in body:
            raise _invalid(
                "autoScaleFormula",
                body["autoScaleFormula"],
                "must not be specified when enableAutoScale is false",
            )
        if not autoscale and not ({"targetDedicatedNodes", "targetLowPriorityNodes"} & set(body)):
            raise _invalid(
                "targetDedicatedNodes",
                None,
                "targetDedicatedNodes, targetLowPriorityNodes or both are required",
            )
        for i, mount in enumerate(body.get("mountConfiguration", [])):
            if len(mount) != 1:
                raise _invalid(
                    "mountConfiguration", i, "exactly one file system per mount configuration"
                )
        for path, ref in _identity_references(body):
            raise _invalid(
                "identityReference",
                ref,
                f"{path}: the identity is not assigned to the pool (a pool's user-assigned "
                "identities are set through Azure Resource Manager, not the Batch API)",
            )
        self._new_pool(body)
        return Response(201, None, {"Location": f"{self.url}/pools/{body['id']}"})

    def _resize(self, pool: dict[str, Any], body: dict[str, Any]) -> Response:
        if pool["state"] == "deleting":
            raise Refused(
                409,
                "PoolBeingDeleted",
                "The specified pool has been marked for deletion and is being reclaimed.",
            )
        if pool["allocationState"] != "steady":
            raise Refused(409, "PoolNotSteady", "The specified pool is not in steady state.")
        if pool.get("enableAutoScale"):
            raise Refused(
                409, "AutoScalingEnabled", "The specified pool has automatic scaling enabled."
            )
        pool["targetDedicatedNodes"] = body.get("targetDedicatedNodes", 0)
        pool["targetLowPriorityNodes"] = body.get("targetLowPriorityNodes", 0)
        option = body.get("nodeDeallocationOption", "requeue")
        self._shrink_running(pool, option)
        pool["resizeErrors"] = []
        self._set_allocation(pool, "resizing")
        return Response(202)

    def _shrink_running(self, pool: dict[str, Any], option: str) -> None:
        """The nodes a shrink removes, as ``nodeDeallocationOption`` says (Batch REST
        BatchNodeDeallocationOption): ``requeue`` ends their tasks' processes and queues the
        tasks again, ``terminate`` ends the tasks for good, and both remove the nodes at once;
        ``taskcompletion`` and ``retaineddata`` let the running tasks end first, schedule
        nothing new on those nodes, and the pool stays ``resizing`` until they leave."""
        keep = {
            "dedicated": pool["targetDedicatedNodes"],
            "lowPriority": pool["targetLowPriorityNodes"],
        }
        for node in self.nodes[pool["id"]]:
            if node["state"] == "leavingpool" or node.get("_leaving"):
                continue
            kind = "dedicated" if node["isDedicated"] else "lowPriority"
            if keep[kind] > 0:
                keep[kind] -= 1
                continue
            node["_leaving"] = True  # nothing new is scheduled on it
            if option in ("taskcompletion", "retaineddata"):
                continue  # leaves once its task ends (_release_nodes)
            for task in self.tasks.values():
                if node["id"] in task.nodes and task.state == "running":
                    ran_on = list(task.nodes)
                    if option == "requeue":
                        task.requeues += 1
                        task.execution["lastRequeueTime"] = _iso(self.now())
                        self._abandon(task, "active")
                    else:
                        self._abandon(
                            task,
                            "completed",
                            (
                                "TaskEnded",
                                "The task was terminated: its node left the pool.",
                            ),
                        )
                    hook = getattr(self.executor, "preempted", None)
                    if hook is not None:  # the VM leaves: its processes end with it
                        hook(str(node["id"]), ran_on)

    def _delete_pool(self, pool: dict[str, Any]) -> Response:
        if pool["state"] != "deleting":
            pool["state"], pool["_since"] = "deleting", self._tick
            pool["stateTransitionTime"] = _iso(self.now())
            for task in self.tasks.values():
                if (
                    set(task.nodes) & {n["id"] for n in self.nodes[pool["id"]]}
                    and task.state == "running"
                ):
                    self._abandon(task, "active")
            for node in self.nodes[pool["id"]]:
                self._set_node(node, "leavingpool")
        return Response(202)

    def preempt(
        self,
        pool_id: str,
        node_id: str | None = None,
        recover_after: int | None = 2,
        notice_seconds: float | None = None,
    ) -> str:
        """Spot capacity is reclaimed from one low-priority node: its task goes back to the
        queue (retryCount unchanged), and what the task ran on its nodes is gone (the node
        runner's ``preempted``: the VM is taken, the task's other instances end with it).
        ``recover_after`` requests later a new VM starts in its place, or never (None: the
        capacity is gone). With ``notice_seconds`` and a ``scheduled_events`` endpoint, a
        ``Preempt`` event for the node is posted there first and the node goes that many
        seconds later (Azure gives at least 30), the caller waiting meanwhile."""
        with self._lock:
            spot = [
                n for n in self.nodes[pool_id] if not n["isDedicated"] and n["state"] != "preempted"
            ]
            node = next(n for n in spot if node_id in (None, n["id"]))
        event = None
        if notice_seconds is not None and self.scheduled_events is not None:
            event = self.scheduled_events.preempt([str(node["id"])], notice_seconds)
            time.sleep(notice_seconds)
            self.scheduled_events.start(event)
        with self._lock:
            self._set_node(node, "preempted")
            node["_recover"] = float("inf") if recover_after is None else recover_after
            self.preemptions.append((str(node["id"]), self.now()))
            for task in self.tasks.values():
                if node["id"] in task.nodes and task.state == "running":
                    ran_on = list(task.nodes)
                    self._abandon(task, "active")
                    hook = getattr(self.executor, "preempted", None)
                    if hook is not None:  # held: nothing is scheduled until the VM is gone
                        hook(str(node["id"]), ran_on)
        if event is not None and self.scheduled_events is not None:
            self.scheduled_events.finish(event)  # the VM is gone, and its events with it
        return str(node["id"])

    # -- jobs ---------------------------------------------------------------------------------
    def _create_job(self, body: dict[str, Any]) -> Response:
        if body["id"].lower() in {j.lower() for j in self.jobs}:
            raise Refused(409, "JobExists", "The specified job already exists.")
        info = body["poolInfo"]
        if ("poolId" in info) == ("autoPoolSpecification" in info):
            raise _invalid("poolInfo", None, "specify either poolId or autoPoolSpecification")
        now = _iso(self.now())
        self.jobs[body["id"]] = {
            **body,
            "state": "active",
            "creationTime": now,
            "stateTransitionTime": now,
            "_since": self._tick,
            "_terminate_reason": None,
        }
        return Response(201, None, {"Location": f"{self.url}/jobs/{body['id']}"})

    def _update_job(self, job: dict[str, Any], body: dict[str, Any]) -> Response:
        if job["state"] in ("completed", "terminating"):
            raise Refused(409, "JobCompleted", "The specified job is already in a completed state.")
        if (
            job.get("onAllTasksComplete") == "terminatejob"
            and body.get("onAllTasksComplete") == "noaction"
        ):
            raise _invalid(
                "onAllTasksComplete",
                "noaction",
                "automatic job termination cannot be turned off again",
            )
        if "poolInfo" in body and job["state"] != "disabled":
            raise Refused(
                409,
                "JobNotDisabled",
                "The pool of a job can be changed only while the job is disabled.",
            )
        job.update(body)
        return Response(200)

    def _advance_job(self, job: dict[str, Any]) -> None:
        if job["state"] == "terminating":
            if self._tick - job["_since"] >= 1:
                self._set_job(job, "completed")
            return
        if job["state"] != "active" or job.get("onAllTasksComplete") != "terminatejob":
            return
        tasks = [t for t in self.tasks.values() if t.job_id == job["id"]]
        if all(t.state == "completed" for t in tasks):  # a job without tasks is complete too
            job["_terminate_reason"] = "AllTasksComplete"
            self._set_job(job, "terminating")

    def _set_job(self, job: dict[str, Any], state: str) -> None:
        job["state"], job["_since"] = state, self._tick
        job["stateTransitionTime"] = _iso(self.now())
        if state == "completed":
            job["_end"] = _iso(self.now())

    def _terminate(self, job: dict[str, Any], reason: str) -> Response:
        if job["state"] == "completed":
            raise Refused(409, "JobCompleted", "The specified job is already in a completed state.")
        job["_terminate_reason"] = reason
        self._set_job(job, "terminating")
        for task in self.tasks.values():
            if task.job_id == job["id"] and task.state != "completed":
                self._abandon(
                    task,
                    "completed",
                    ("TaskEnded", "The task was ended because its job was terminated."),
                )
        return Response(202)

    # -- tasks --------------------------------------------------------------------------------
    def _create_task(self, job: dict[str, Any], body: dict[str, Any]) -> Response:
        if job["state"] in ("completed", "terminating"):
            raise Refused(409, "JobCompleted", "The specified job is already in a completed state.")
        if job["state"] != "active":
            raise Refused(409, "JobNotActive", f"The specified job is in the {job['state']} state.")
        if any(key[0] == job["id"] and key[1].lower() == body["id"].lower() for key in self.tasks):
            raise Refused(409, "TaskExists", "The specified task already exists.")
        multi = body.get("multiInstanceSettings")
        if multi and body.get("requiredSlots", 1) != 1:
            raise _invalid(
                "requiredSlots", body["requiredSlots"], "must be 1 for multi-instance tasks"
            )
        for i, resource in enumerate(body.get("resourceFiles", [])):
            sources = {"autoStorageContainerName", "storageContainerUrl", "httpUrl"} & set(resource)
            if len(sources) != 1:
                raise _invalid(
                    "resourceFiles",
                    i,
                    "exactly one of autoStorageContainerName, storageContainerUrl, httpUrl",
                )
            if "httpUrl" in resource and "filePath" not in resource:
                raise _invalid("filePath", None, "required with httpUrl")
        identity = body.get("userIdentity")
        if identity is not None and len(identity) != 1:
            raise _invalid("userIdentity", None, "specify either username or autoUser")
        task = _Task(job["id"], body, self.now())
        task.state_changed = task.created
        self.tasks[(job["id"], body["id"])] = task
        return Response(201, None, {"Location": f"{self.url}/jobs/{job['id']}/tasks/{body['id']}"})

    def _schedule(self, task: _Task) -> None:
        job = self.jobs[task.job_id]
        pool = self.pools.get(job["poolInfo"].get("poolId", ""))
        if job["state"] != "active" or pool is None or pool["state"] != "active":
            return  # Batch keeps the task queued until its pool exists
        multi = task.body.get("multiInstanceSettings")
        wanted = multi.get("numberOfInstances", 1) if multi else 1
        if multi and (
            not pool.get("enableInterNodeCommunication") or pool.get("taskSlotsPerNode", 1) != 1
        ):
            return  # never schedulable on this pool: it waits, as on Batch
        free = [n for n in self.nodes[pool["id"]] if n["state"] == "idle" and not n.get("_leaving")]
        if len(free) < wanted:
            return
        chosen = free[:wanted]
        for node in chosen:
            self._set_node(node, "running")
        task.nodes = [n["id"] for n in chosen]
        task.generation += 1
        task.starts += 1
        task.state, task.started, task.running_since = "running", True, self._tick
        task.stdout, task.attempt, task.finished = b"", None, threading.Event()
        now = _iso(self.now())
        task.state_changed = self.now()
        task.execution = {
            "startTime": now,
            "retryCount": task.retry,
            "requeueCount": task.requeues,
            **({"lastRetryTime": now} if task.retry else {}),
            **(
                {"lastRequeueTime": task.execution["lastRequeueTime"]}
                if "lastRequeueTime" in task.execution
                else {}
            ),
        }
        task.subtasks = [
            {
                "id": i,
                "state": "running",
                "startTime": now,
                "stateTransitionTime": now,
                "nodeInfo": self._node_info(pool["id"], node["id"]),
            }
            for i, node in enumerate(chosen[1:], start=1)
        ]
        self._launch(task, chosen)

    def _launch(self, task: _Task, nodes: list[dict[str, Any]]) -> None:
        """Hand one attempt to the node runner: a scripted attempt, or the executor that runs
        the command lines for real. The result counts only for the attempt it was started for."""
        generation, done = task.generation, task.finished
        if self.executor is None:
            script = self._script_for(task.body["id"])  # one entry per start, the last repeats
            attempt = script[min(task.starts - 1, len(script) - 1)]
            task.attempt, task.stdout = attempt, attempt.stdout.encode()
            threading.Timer(attempt.seconds, done.set).start()
            return
        executor, env = self.executor, self._node_env(task, nodes)

        def run() -> None:
            attempt = executor(task.body, env)
            with self._lock:
                if task.generation == generation:
                    task.attempt, task.stdout = attempt, attempt.stdout.encode()
            done.set()

        threading.Thread(target=run, daemon=True).start()

    def _script_for(self, task_id: str) -> list[Attempt]:
        for prefix, attempts in self.scripts.items():
            if task_id.startswith(prefix):
                return attempts
        return [Attempt()]

    def _node_env(self, task: _Task, nodes: list[dict[str, Any]]) -> dict[str, str]:
        ips = [n["ipAddress"] for n in nodes]
        job = self.jobs[task.job_id]
        return {
            "AZ_BATCH_POOL_ID": job["poolInfo"]["poolId"],
            "AZ_BATCH_JOB_ID": task.job_id,
            "AZ_BATCH_TASK_ID": task.body["id"],
            "AZ_BATCH_NODE_ID": nodes[0]["id"],
            "AZ_BATCH_HOST_LIST": ",".join(ips),
            "AZ_BATCH_NODE_LIST": ";".join(ips),
            "AZ_BATCH_IS_CURRENT_NODE_MASTER": "true",
            **{e["name"]: e.get("value", "") for e in task.body.get("environmentSettings", [])},
        }

    def _release_nodes(self, task: _Task, succeeded: bool) -> None:
        for nodes in self.nodes.values():
            for node in nodes:
                if node["id"] in task.nodes and node["state"] == "running":
                    node["_runs"] += 1
                    node["_succeeded"] += int(succeeded)
                    self._set_node(node, "idle")
                    if node.get("_leaving"):  # a shrink waited for its task to end
                        self._leave(node)

    def _abandon(self, task: _Task, state: str, failure: tuple[str, str] | None = None) -> None:
        """The current attempt stops without a result: requeued (active) or ended (completed)."""
        task.generation += 1
        self._release_nodes(task, False)
        task.nodes, task.subtasks = [], []
        task.state, task.state_changed = state, self.now()
        if state == "completed":
            task.execution.update({"endTime": _iso(self.now()), "result": "failure"})
            if failure is not None:
                task.execution["failureInfo"] = {
                    "category": "usererror",
                    "code": failure[0],
                    "message": failure[1],
                }

    def _end_attempt(self, task: _Task) -> None:
        attempt = task.attempt or Attempt(exit_code=-1, stdout="the node runner returned nothing")
        self.clock_offset += timedelta(seconds=attempt.service_seconds)
        now = _iso(self.now())
        code = attempt.exit_code
        self._release_nodes(task, code == 0)
        for sub in task.subtasks:  # secondaries ran the coordination command only
            sub.update(
                {
                    "state": "completed",
                    "previousState": "running",
                    "endTime": now,
                    "exitCode": 0,
                    "result": "success",
                }
            )
        limit = task.body.get("constraints", {}).get("maxTaskRetryCount")
        if limit is None:
            limit = self.jobs[task.job_id].get("constraints", {}).get("maxTaskRetryCount", 0)
        if code != 0 and (limit == -1 or task.retry < limit):
            task.retry += 1
            task.state, task.state_changed, task.nodes = "active", self.now(), []
            return
        task.state, task.state_changed = "completed", self.now()
        task.execution.update({"endTime": now, "exitCode": code})
        failure = None
        if code != 0:
            failure = ("FailureExitCode", "The task process exited with an unexpected exit code")
        upload_error = self._upload_outputs(task, attempt)
        if upload_error and failure is None:
            failure = ("FileUploadError", upload_error)
        task.execution["result"] = "failure" if failure else "success"
        if failure:
            task.execution["failureInfo"] = {
                "category": "usererror",
                "code": failure[0],
                "message": failure[1],
            }

    def _upload_outputs(self, task: _Task, attempt: Attempt) -> str | None:
        """Upload what the OutputFile entries match, as the node would; the first error, if any."""
        files = {**attempt.files, "../stdout.txt": task.stdout, "../stderr.txt": b""}
        success = attempt.exit_code == 0
        pool = self.pools.get(self.jobs[task.job_id]["poolInfo"].get("poolId", ""), {})
        identities = {
            i["resourceId"].lower()
            for i in pool.get("identity", {}).get("userAssignedIdentities", [])
        }
        error = None
        for out in task.body.get("outputFiles", []):
            condition = out["uploadOptions"]["uploadCondition"]
            if (condition == "tasksuccess" and not success) or (
                condition == "taskfailure" and success
            ):
                continue
            dest = out["destination"]["container"]
            base, _, sas = dest["containerUrl"].partition("?")
            reference = dest.get("identityReference", {}).get("resourceId")
            for blob, data in matched_outputs(
                out["filePattern"], dest.get("path", ""), files
            ).items():
                try:
                    if reference is not None:
                        if reference.lower() not in identities or self.identity_upload is None:
                            raise RuntimeError(
                                f"identity {reference} is not assigned to pool {pool.get('id')}"
                            )
                        self.identity_upload(f"{base}/{blob}", data)
                    else:
                        self._sas_upload(base, blob, sas, data)
                    task.uploaded.append(blob)
                except (RuntimeError, requests.HTTPError) as exc:
                    error = error or f"File upload failed for {blob}: {exc}"
        return error

    def _sas_upload(self, base: str, blob: str, sas: str, data: bytes) -> None:
        expiry = parse_qs(sas).get("se", [None])[0]
        if expiry and datetime.fromisoformat(expiry.replace("Z", "+00:00")) < self.now():
            raise RuntimeError(
                f"AuthenticationFailed: the SAS expired at {expiry} "
                f"(service time {_iso(self.now())})"
            )
        reply = requests.put(
            f"{base}/{blob}?{sas}",
            data=data,
            headers={"x-ms-blob-type": "BlockBlob", "x-ms-version": "2025-01-05"},
            timeout=30,
        )
        reply.raise_for_status()  # a SAS without write permission fails here

    # -- task files ---------------------------------------------------------------------------
    def _file(self, task: _Task, name: str, method: str, ocp_range: str | None) -> Response:
        if name not in ("stdout.txt", "stderr.txt") or not task.started or task.state == "active":
            if method == "HEAD":
                return Response(404, None, {"x-ms-error-code": "FileNotFound"})
            raise Refused(404, "FileNotFound", f"The specified file {name} does not exist.")
        data = task.stdout if name == "stdout.txt" else b""
        headers = {
            "Content-Type": "application/octet-stream",
            "ocp-creation-time": _http_date(task.state_changed or task.created),
            "Last-Modified": _http_date(self.now()),
            "ocp-batch-file-isdirectory": "false",
            "ocp-batch-file-url": (
                f"{self.url}/jobs/{task.job_id}/tasks/{task.body['id']}/files/{name}"
            ),
            "ocp-batch-file-mode": "0100644",
        }
        if method == "HEAD":
            return Response(200, None, {**headers, "Content-Length": str(len(data))})
        if ocp_range is not None:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", ocp_range)
            if match is None:
                raise Refused(
                    400,
                    "InvalidHeaderValue",
                    "The value provided for one of the HTTP headers was not in the correct format.",
                    {"HeaderName": "ocp-range", "HeaderValue": ocp_range},
                )
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(data) - 1
            if start >= len(data) or end < start:
                raise Refused(
                    416,
                    "InvalidRange",
                    "The specified byte range is invalid for the current size of the resource.",
                )
            data = data[start : end + 1]
        return Response(200, data, headers)

    # -- views --------------------------------------------------------------------------------
    def _node_info(self, pool_id: str, node_id: str) -> dict[str, Any]:
        return {
            "affinityId": f"TVM:{node_id}",
            "nodeUrl": f"{self.url}/pools/{pool_id}/nodes/{node_id}",
            "poolId": pool_id,
            "nodeId": node_id,
        }

    def _pool_json(self, pool: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in pool.items() if not k.startswith("_")}
        out.setdefault("resizeTimeout", "PT15M")
        out.setdefault("taskSlotsPerNode", 1)
        out.setdefault("enableInterNodeCommunication", False)
        out.setdefault("enableAutoScale", False)
        out.setdefault("taskSchedulingPolicy", {"nodeFillType": "spread"})
        if not out["resizeErrors"] or out["allocationState"] != "steady":
            out.pop("resizeErrors")  # set only for the last resize, and only once steady
        return _without_secrets(out)

    def _node_json(self, node: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in node.items() if not k.startswith("_") and k != "errors"}
        running = sum(
            1 for t in self.tasks.values() if node["id"] in t.nodes and t.state == "running"
        )
        out.update(
            {
                "url": f"{self.url}/pools/{node['_pool']}/nodes/{node['id']}",
                "schedulingState": "enabled",
                "affinityId": f"TVM:{node['id']}",
                "totalTasksRun": node["_runs"],
                "totalTasksSucceeded": node["_succeeded"],
                "runningTasksCount": running,
                "runningTaskSlotsCount": running,
                "nodeAgentInfo": {"version": "1.12.0.0", "lastUpdateTime": node["allocationTime"]},
            }
        )
        if node.get("errors"):
            out["errors"] = node["errors"]
        return out

    def _job_json(self, job: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in job.items() if not k.startswith("_")}
        out.update(
            {
                "url": f"{self.url}/jobs/{job['id']}",
                "eTag": "0x1",
                "lastModified": job["stateTransitionTime"],
                "priority": job.get("priority", 0),
                "maxParallelTasks": job.get("maxParallelTasks", -1),
                "usesTaskDependencies": job.get("usesTaskDependencies", False),
                "allowTaskPreemption": job.get("allowTaskPreemption", False),
                "constraints": {
                    "maxWallClockTime": FOREVER,
                    "maxTaskRetryCount": 0,
                    **job.get("constraints", {}),
                },
                "onAllTasksComplete": job.get("onAllTasksComplete", "noaction"),
                "onTaskFailure": job.get("onTaskFailure", "noaction"),
                "executionInfo": {
                    "startTime": job["creationTime"],
                    "poolId": job["poolInfo"].get("poolId", ""),
                },
            }
        )
        if job["state"] == "completed":
            out["executionInfo"]["endTime"] = job["_end"]
        if job["_terminate_reason"] and job["state"] in ("terminating", "completed"):
            out["executionInfo"]["terminateReason"] = job["_terminate_reason"]
        return out

    def _task_json(self, task: _Task) -> dict[str, Any]:
        created = _iso(task.created)
        job = self.jobs[task.job_id]
        out = {
            **task.body,
            "url": f"{self.url}/jobs/{task.job_id}/tasks/{task.body['id']}",
            "eTag": "0x1",
            "creationTime": created,
            "lastModified": created,
            "state": task.state,
            "stateTransitionTime": _iso(task.state_changed or task.created),
            "requiredSlots": task.body.get("requiredSlots", 1),
            "constraints": {
                "maxWallClockTime": FOREVER,
                "retentionTime": "P7D",
                "maxTaskRetryCount": job.get("constraints", {}).get("maxTaskRetryCount", 0),
                **task.body.get("constraints", {}),
            },
            "executionInfo": dict(task.execution),
        }
        if task.nodes:
            out["nodeInfo"] = self._node_info(job["poolInfo"].get("poolId", ""), task.nodes[0])
        return out

    # -- for assertions -----------------------------------------------------------------------
    def bodies(self, method: str, path: str) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests.find(method, path)]


def _http_date(moment: datetime) -> str:
    return moment.strftime("%a, %d %b %Y %H:%M:%S GMT")


def _odata_filter(text: str) -> dict[str, str]:
    """``state eq 'active' and ...`` as a dict; the only form the pipeline sends."""
    wanted = {}
    for clause in filter(None, (c.strip() for c in text.split(" and "))):
        match = re.fullmatch(r"(\w+) eq '([^']*)'", clause)
        if match is None:
            raise Refused(
                400,
                "InvalidQueryParameterValue",
                "Value for one of the query parameters specified in the request URI is invalid.",
                {"QueryParameterName": "$filter", "QueryParameterValue": text},
            )
        wanted[match.group(1)] = match.group(2)
    return wanted


def _identity_references(body: Any, path: str = "") -> list[tuple[str, str]]:
    """Every identityReference.resourceId in a body, with where it is."""
    found: list[tuple[str, str]] = []
    if isinstance(body, dict):
        for key, value in body.items():
            here = f"{path}.{key}" if path else key
            if key == "identityReference" and isinstance(value, dict):
                found.append((here, str(value.get("resourceId"))))
            else:
                found += _identity_references(value, here)
    elif isinstance(body, list):
        for i, value in enumerate(body):
            found += _identity_references(value, f"{path}[{i}]")
    return found


def _without_secrets(body: Any) -> Any:
    """What a GET returns: the service never gives back a password or an account key."""
    if isinstance(body, dict):
        return {
            k: _without_secrets(v)
            for k, v in body.items()
            if k not in ("password", "accountKey", "sasKey")
        }
    if isinstance(body, list):
        return [_without_secrets(v) for v in body]
    return body


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """For tests that watch the fake from outside (no request is needed to observe it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the fake Batch account never reached the expected state")
        time.sleep(0.01)
