"""Azure Batch as the pipeline's cluster: ensure the pool, run task specs, release the pool.

Everything the orchestrator needs to see goes through the Batch API: pool and node states,
each subtask of a multi-instance task, the primary's stdout (streamed into the Prefect logs by
range reads), and the task's end state. Retries of a failed task are the service's own
(``maxTaskRetryCount``), so a retry runs on the nodes already allocated and the trainer resumes
from its checkpoint in NFS. Following a task has a deadline (every attempt at its maximum run
time, plus the pool's start timeout), measured on the service's clock: a task that never gets
nodes (Spot capacity gone, nodes unusable) fails the run with the reason instead of waiting
forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from backends.azure import service_name
from backends.azure.access import AccessIssuer, redact, task_lifetime
from backends.azure.batch_requests import (
    CREDENTIALS_KEY,
    job_body,
    job_completion_body,
    job_id,
    pool_body,
    resize_body,
    task_body,
)
from backends.blob import folder
from backends.cluster import TaskResult
from backends.lines import read_new_lines
from backends.spot_fallback import SpotRecord, SpotWatch
from backends.taskspec import TaskSpec
from core.config import PipelineConfig

if TYPE_CHECKING:
    from azure.batch import BatchClient
    from azure.storage.blob import ContainerClient

    from backends.cost import PoolUsage
    from backends.progress_deadline import ProgressDeadline

# Resize errors that no retry fixes: the account (Batch-service allocation mode) or the
# subscription (user-subscription mode) has no more cores of that kind.
QUOTA_CODES = {"AccountCoreQuotaReached", "AccountLowPriorityCoreQuotaReached"}
PIPELINE = "retrain-pipeline"  # the created-by metadata of pools this pipeline created


class PoolError(RuntimeError):
    """The pool cannot be used as configured; the message says which setting or node."""


class TaskFailedError(RuntimeError):
    """A Batch task could not run at all (its job was terminated, or it never got nodes)."""


@dataclass
class Polling:
    """Backoff between Batch API polls: frequent while things change, capped for long waits."""

    first: float = 2.0
    factor: float = 1.5
    cap: float = 30.0
    lro_seconds: int = 5  # the SDK's own pollers take whole seconds

    def delays(self) -> Any:
        delay = self.first
        while True:
            yield delay
            delay = min(self.cap, delay * self.factor)


def _batch_code(exc: Exception) -> str | None:
    """The Batch error code of a failed request (``TaskExists``, ``JobCompleted``, ...)."""
    response = getattr(exc, "response", None)
    with contextlib.suppress(Exception):
        return str(response.json().get("code"))  # type: ignore[union-attr]
    return getattr(getattr(exc, "error", None), "code", None)


def _registries(container: Any) -> list[tuple[str, str, str]]:
    return sorted(
        (
            (r.registry_server or "").lower(),
            r.username or "",
            (r.identity_reference.resource_id or "").lower() if r.identity_reference else "",
        )
        for r in (container.container_registries or [])
    )


# Settings Batch cannot change on a pool in use: a mismatch needs a new pool.
def _immutable(pool: Any) -> dict[str, Any]:
    vm = pool.virtual_machine_configuration
    image = vm.image_reference if vm else None
    container = vm.container_configuration if vm else None
    return {
        "vm_size": (pool.vm_size or "").lower(),
        "enable_inter_node_communication": bool(pool.enable_inter_node_communication),
        "task_slots_per_node": pool.task_slots_per_node or 1,
        "image": (image.publisher, image.offer, image.sku) if image else None,
        "node_agent_sku_id": vm.node_agent_sku_id if vm else None,
        "container_image_names": sorted(container.container_image_names or [])
        if container
        else None,
        "container_registries": _registries(container) if container else None,
        "os_disk_gb": vm.os_disk.disk_size_gb if vm and vm.os_disk else None,
        "mounts": sorted(_mount(mc) for mc in (pool.mount_configuration or [])),
    }


def _mount(mc: Any) -> str:
    """What a mount configuration mounts: the NFS export, the share's URL, or the account and
    container that blobfuse mounts."""
    if mc.nfs_mount_configuration:
        return str(mc.nfs_mount_configuration.source)
    if mc.azure_file_share_configuration:
        return str(mc.azure_file_share_configuration.azure_file_url)
    blob = mc.azure_blob_file_system_configuration
    return f"blob:{blob.account_name}/{blob.container_name}" if blob else ""


def _metadata(pool: Any) -> dict[str, str]:
    return {str(item.name): str(item.value) for item in (pool.metadata or [])}


class BatchCluster:
    retries_in_service = True
    shared = True  # any orchestrator with the account's credentials can use the pool

    def __init__(
        self,
        config: PipelineConfig,
        client: BatchClient,
        outputs: ContainerClient,
        access: AccessIssuer,
        image: str,
        secrets: Callable[[], tuple[str, str | None]] = lambda: ("", None),
        polling: Polling | None = None,
    ) -> None:
        self.config, self.client, self.outputs = config, client, outputs
        self.access, self.image = access, image
        self._secrets = secrets  # (share key, registry password), fetched only for the pool
        self.polling = polling or Polling()
        self.pool_id = config.pool.id
        # The run's Spot nodes followed while its tasks run (pools with Spot nodes only).
        self.spot: SpotWatch | None = None

    def spot_record(self) -> SpotRecord | None:
        """The node kinds this run used, its preemptions, its move to dedicated nodes."""
        return self.spot.record if self.spot is not None else None

    # -- usage (backends/azure/usage.py reads it, backends/cost.py prices it) -------------------
    def node_allocations(self) -> list[datetime] | None:
        """Read before the release: the nodes leave the pool with it."""
        from backends.azure.usage import node_allocations

        return node_allocations(self.client, self.pool_id)

    def clock(self) -> datetime:
        from backends.azure.usage import service_now

        return service_now(self.client, self.pool_id)

    def usage(self, run_id: str, since: datetime, allocations: list[datetime]) -> PoolUsage:
        from backends.azure.usage import pool_usage, released_at, run_tasks

        until = released_at(self.client, self.pool_id)
        tasks = run_tasks(self.client, self.pool_id, run_id, until)
        return pool_usage(allocations, tasks, since, until)

    # -- pool ---------------------------------------------------------------------------------
    def ensure_pool(self) -> dict[str, Any]:
        """Create when missing, grow when smaller; a pool whose fixed settings differ is created
        again while idle (``pool.recreate_on_change``) or refused."""
        from azure.core.exceptions import ResourceNotFoundError

        pool_cfg = self.config.pool
        try:
            existing = self.client.get_pool(self.pool_id)
        except ResourceNotFoundError:
            existing = None
        if existing is not None and existing.state == "deleting":
            self._wait_deleted()
            existing = None
        # The secrets are read only when they matter: to create the pool, or to compare with
        # the digest of those it was made with. A pool made through ARM (`make azure-up`)
        # carries none: its share key was read by ARM, and no Secret block exists for it.
        fetched = existing is None or CREDENTIALS_KEY in _metadata(existing)
        if fetched:
            share_key, registry_password = self._secrets()
        else:
            share_key = ""
            registry_password = "" if self.config.image.registry_password_secret else None
        wanted = pool_body(self.config, self.image, self.access, share_key, registry_password)
        action = "reused"
        if existing is not None:
            self._check_identity(existing)
            diff = self._differences(existing, wanted)
            if diff:
                self._recreate(existing, diff)
                existing, action = None, "recreated"
        if existing is None:
            if action != "recreated":
                self._check_identity(None)
                action = "created"
            if not fetched:
                wanted = pool_body(self.config, self.image, self.access, *self._secrets())
            self.client.create_pool(wanted)
        elif not pool_cfg.autoscale_formula and self._needs_resize(existing):
            self._wait_steady_allocation(fresh=False)
            self.client.begin_resize_pool(
                self.pool_id,
                resize_body(pool_cfg.dedicated_nodes, pool_cfg.low_priority_nodes),
                polling_interval=self.polling.lro_seconds,
            ).result()
            action = "resized"
        nodes = self._wait_nodes_ready(fresh=action != "reused")
        return {
            "pool": self.pool_id,
            "created": action != "reused",
            "action": action,
            "nodes": len(nodes),
            "vm_size": pool_cfg.vm_size,
        }

    def _check_identity(self, existing: Any) -> None:
        """A pool whose nodes act as a managed identity exists only if made through ARM."""
        identity = self.access.identity
        if not identity:
            return
        attached = []
        if existing is not None and existing.identity is not None:
            attached = [
                (i.resource_id or "").lower()
                for i in existing.identity.user_assigned_identities or []
            ]
        if identity.lower() in attached:
            return
        where = "does not exist" if existing is None else "exists without that identity"
        raise PoolError(
            f"pool {self.pool_id} {where}, and azure.identity_resource_id is set: a pool whose "
            "nodes use a user-assigned managed identity can only be created through Azure "
            "Resource Manager (the Batch API cannot attach an identity, and refuses identity "
            "references the pool does not have). Create it once with the identity (`make "
            "azure-up` does, from the pool settings `--plan` prints; see docs/azure.md), "
            "or unset azure.identity_resource_id to give the nodes SAS tokens instead"
        )

    def _differences(self, existing: Any, wanted: Any) -> list[str]:
        have, want = _immutable(existing), _immutable(wanted)
        diff = [
            f"{k}: pool has {have[k]!r}, config wants {want[k]!r}"
            for k in want
            if have[k] != want[k]
        ]
        digest = _metadata(existing).get(CREDENTIALS_KEY)
        if digest is not None and digest != _metadata(wanted)[CREDENTIALS_KEY]:
            diff.append("credentials: the share key or registry password changed since creation")
        return diff

    def _recreate(self, existing: Any, diff: list[str]) -> None:
        """Delete and create again (the caller creates), or explain why not."""
        changes = "; ".join(diff)
        ours = _metadata(existing).get("created-by") == PIPELINE
        if not (self.config.pool.recreate_on_change and ours) or self.access.identity:
            why = (
                "pool.recreate_on_change is false"
                if self.config.pool.recreate_on_change is False
                else "it was not created by this pipeline"
                if not ours
                else "a pool with a managed identity is created through Azure Resource Manager"
            )
            raise PoolError(
                f"pool {self.pool_id} exists with settings Batch cannot change ({changes}) and "
                f"is not recreated ({why}): delete it, or set pool.id to a new pool"
            )
        busy = self._busy(existing)
        if busy:
            raise PoolError(
                f"pool {self.pool_id} must be recreated ({changes}) but is in use ({busy}): "
                "retry when it is idle, or set pool.id to a new pool"
            )
        self.client.begin_delete_pool(
            self.pool_id, polling_interval=self.polling.lro_seconds
        ).result()
        self._wait_deleted()

    def _busy(self, existing: Any) -> str:
        running = [n.id for n in self.client.list_nodes(self.pool_id) if n.state in ("running",)]
        jobs = [
            str(j.id)
            for j in self.client.list_jobs(filter="state eq 'active'")
            if j.pool_info and j.pool_info.pool_id == self.pool_id
        ]
        parts = []
        if running:
            parts.append(f"nodes running tasks: {', '.join(running)}")
        if jobs:
            parts.append(f"active jobs: {', '.join(jobs)}")
        return "; ".join(parts)

    def _needs_resize(self, existing: Any) -> bool:
        """Smaller than wanted, or short of it after a failed resize whose errors are stale:
        resizing again clears them and tries again (capacity may be back)."""
        pool_cfg = self.config.pool
        if (existing.target_dedicated_nodes or 0) < pool_cfg.dedicated_nodes or (
            existing.target_low_priority_nodes or 0
        ) < pool_cfg.low_priority_nodes:
            return True
        current = (existing.current_dedicated_nodes or 0) + (
            existing.current_low_priority_nodes or 0
        )
        return bool(existing.resize_errors) and current < pool_cfg.nodes

    def _wait_deleted(self) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        for delay in self.polling.delays():
            try:
                self.client.get_pool(self.pool_id)
            except ResourceNotFoundError:
                return
            time.sleep(delay)

    def _wait_steady_allocation(self, fresh: bool) -> Any:
        """Until the pool is steady. ``fresh``: its resize errors are this run's own; quota
        errors fail at once, after giving back what the resize allocated."""
        deadline = time.monotonic() + 60 * self.config.pool.start_timeout_minutes
        for delay in self.polling.delays():
            pool = self.client.get_pool(self.pool_id)
            if pool.allocation_state == "steady":
                self._check_resize_errors(pool, fresh)
                return pool
            if time.monotonic() > deadline:
                raise PoolError(f"pool {self.pool_id} still resizing after the start timeout")
            time.sleep(delay)

    def _check_resize_errors(self, pool: Any, fresh: bool) -> None:
        errors = pool.resize_errors or []
        if not errors or not fresh:
            return
        current = (pool.current_dedicated_nodes or 0) + (pool.current_low_priority_nodes or 0)
        text = "; ".join(f"{e.code}: {e.message}" for e in errors)
        if any(e.code in QUOTA_CODES for e in errors):
            self._resize_to_zero()
            raise PoolError(
                f"pool {self.pool_id} could not allocate nodes: {text}. The nodes it did get "
                "were released. Raise the quota: in Batch-service allocation mode the Batch "
                "account's core quota (portal: Batch account -> Quotas), in user-subscription "
                "mode the subscription's regional vCPU quota for the VM family (dedicated and "
                "Spot are separate quotas)"
            )
        if current < self.config.pool.nodes and not self.config.pool.autoscale_formula:
            raise PoolError(
                f"pool {self.pool_id} has {current} of {self.config.pool.nodes} nodes: {text}"
            )

    def _wait_nodes_ready(self, fresh: bool) -> list[Any]:
        """Until every node is idle or running; fail fast on unusable or start-task-failed."""
        needed = self.config.pool.nodes
        deadline = time.monotonic() + 60 * self.config.pool.start_timeout_minutes
        for delay in self.polling.delays():
            self._wait_steady_allocation(fresh)
            nodes = list(self.client.list_nodes(self.pool_id))
            broken = [n for n in nodes if n.state in ("unusable", "starttaskfailed")]
            if broken:
                raise PoolError(
                    f"pool {self.pool_id}: {len(broken)} node(s) cannot run tasks: "
                    + "; ".join(self._describe_node(n) for n in broken)
                )
            ready = [n for n in nodes if n.state in ("idle", "running")]
            if len(ready) >= needed or (self.config.pool.autoscale_formula and ready):
                return ready
            if time.monotonic() > deadline:
                raise PoolError(
                    f"pool {self.pool_id}: {len(ready)} of {needed} nodes ready after "
                    f"{self.config.pool.start_timeout_minutes} minutes (states: "
                    + ", ".join(sorted(service_name(n.state) for n in nodes))
                    + ")"
                )
            time.sleep(delay)
        raise AssertionError("unreachable")

    @staticmethod
    def _describe_node(node: Any) -> str:
        parts = [f"{node.id} {service_name(node.state)}"]
        for error in node.errors or []:
            parts.append(f"{error.code}: {error.message}")
        info = node.start_task_info
        if info is not None and info.failure_info is not None:
            parts.append(f"start task {info.failure_info.code}: {info.failure_info.message}")
        return ", ".join(parts)

    # -- tasks --------------------------------------------------------------------------------
    def job_id(self, spec: TaskSpec) -> str:
        return job_id(self.pool_id, spec.id)

    def run_task(
        self,
        spec: TaskSpec,
        on_line: Callable[[str], None] = lambda _: None,
        deadline: ProgressDeadline | None = None,
    ) -> TaskResult:
        """Submit (or re-attach to) the task, follow it to the end, report its outputs.

        An attempt the ``deadline`` finds hung is terminated through the API; Batch does not
        retry a terminated task, so the attempts left go to a new task of the same command
        (``<id>-<attempt>``, in a job of its own), which resumes from the checkpoint. A re-run
        of the step (after the orchestrator crashed) follows the newest of those tasks."""
        started = time.perf_counter()
        if self.spot is None and self.config.pool.low_priority_nodes > 0:
            self.spot = SpotWatch(self.config.pool, self.clock())
        used, current = self._newest_attempt(spec, on_line)
        stalls: list[str] = []
        while True:
            result = self._run_one(current, on_line, deadline)
            used += result.attempts
            stalls += result.stalls
            next_id = f"{spec.id}-{used + 1}"
            if (
                not result.stalls
                or used > spec.max_retries
                or self.job_id(dataclasses.replace(spec, id=next_id)) == self.job_id(current)
            ):
                record = self.spot_record()
                return dataclasses.replace(
                    result,
                    attempts=used,
                    stalls=stalls,
                    seconds=time.perf_counter() - started,
                    preemptions=len(record.preemptions) if record else 0,
                    spot_fallback=record.fallback if record else None,
                )
            current = dataclasses.replace(spec, id=next_id, max_retries=spec.max_retries - used)
            on_line(
                f"task {spec.id}: attempt {used + 1} of {spec.max_retries + 1} as task "
                f"{current.id}, from the last checkpoint"
            )

    def _newest_attempt(
        self, spec: TaskSpec, on_line: Callable[[str], None]
    ) -> tuple[int, TaskSpec]:
        """The task of ``spec`` to follow, and the attempts used before it: ``spec``'s own, or,
        when an attempt of it was ended as hung and the attempts left went to a task of their
        own, the newest of those. Following the first task instead would report the ended
        attempt as the step's end and leave the newest task's job running, followed by nobody."""
        from azure.core.exceptions import ResourceNotFoundError

        used, current = 0, spec
        while True:
            try:
                task = self.client.get_task(self.job_id(current), current.id)
            except ResourceNotFoundError:
                return used, current  # not submitted yet: this run submits it
            info = task.execution_info
            retries = (info.retry_count or 0) if info is not None else 0
            total = used + retries + 1
            later = dataclasses.replace(
                spec, id=f"{spec.id}-{total + 1}", max_retries=spec.max_retries - total
            )
            if total > spec.max_retries or self.job_id(later) == self.job_id(current):
                return used, current
            try:
                self.client.get_task(self.job_id(later), later.id)
            except ResourceNotFoundError:
                return used, current
            on_line(
                f"task {current.id} was ended as hung; its attempts left run as task "
                f"{later.id}: following it"
            )
            used, current = total, later

    def _run_one(
        self, spec: TaskSpec, on_line: Callable[[str], None], deadline: ProgressDeadline | None
    ) -> TaskResult:
        from azure.core.exceptions import ResourceExistsError

        started = time.perf_counter()
        job_id = self.job_id(spec)
        body = task_body(self.config, spec, self.image, self.access.for_task(spec))
        # Exists already: a re-run of the same step after an orchestrator crash; follow it.
        with contextlib.suppress(ResourceExistsError):
            self.client.create_job(job_body(self.config, job_id))
        try:
            self.client.create_task(job_id, body)
        except ResourceExistsError as exc:
            error_code = _batch_code(exc)
            if error_code == "TaskExists":
                on_line(f"task {spec.id} already submitted: following it")
            elif error_code == "JobCompleted":
                on_line(f"job {job_id} has already completed: following its task {spec.id}")
            else:
                raise
        # Only now may the job end with its task (see job_body); a completed job says 409.
        with contextlib.suppress(ResourceExistsError):
            self.client.update_job(job_id, job_completion_body())
        stalls: list[str] = []
        task = self._follow(job_id, spec, on_line, deadline, stalls)
        info = task.execution_info
        if info is None:
            raise TaskFailedError(f"task {spec.id} ended without running (job {job_id})")
        if info.failure_info is not None:
            on_line(
                f"task {spec.id} failure: {info.failure_info.code}: "
                f"{redact(info.failure_info.message or '')}"
            )
        code = info.exit_code if info.exit_code is not None else -1
        uploaded = self._uploaded(spec)
        return TaskResult(
            code,
            None,
            uploaded,
            time.perf_counter() - started,
            attempts=(info.retry_count or 0) + 1,
            stalls=stalls,
        )

    def _get_task(self, job_id: str, spec: TaskSpec) -> tuple[Any, datetime]:
        """The task and the service's clock at that moment (its Date header)."""
        from azure.core.exceptions import ResourceNotFoundError

        def with_date(response: Any, task: Any, _headers: Any) -> tuple[Any, datetime]:
            header = response.http_response.headers.get("Date")
            return task, parsedate_to_datetime(header) if header else datetime.now(UTC)

        try:
            found: Any = self.client.get_task(job_id, spec.id, cls=with_date)
            task, now = found
        except ResourceNotFoundError:
            raise TaskFailedError(
                f"task {spec.id} does not exist in job {job_id}: the job completed before the "
                "task was added (by hand, or by a version of this pipeline that created jobs "
                "set to terminate when empty); run the step again to submit it anew"
            ) from None
        return task, now

    def _follow(
        self,
        job_id: str,
        spec: TaskSpec,
        on_line: Callable[[str], None],
        deadline: ProgressDeadline | None = None,
        stalls: list[str] | None = None,
    ) -> Any:
        offset, retry = 0, 0
        # (start time, node, retry count) of the attempt being read
        start: tuple[Any, Any, int] | None = None
        states: dict[Any, tuple[Any, Any]] = {}
        delays = self.polling.delays()
        lifetime = task_lifetime(self.config, spec)
        while True:
            task, now = self._get_task(job_id, spec)
            info = task.execution_info
            if info is not None and (info.retry_count or 0) != retry:
                retry, offset = info.retry_count or 0, 0  # a retry writes a new stdout.txt
                on_line(
                    f"task {spec.id}: attempt {retry + 1} of {spec.max_retries + 1} "
                    f"(previous exit code "
                    f"{info.exit_code if info.exit_code is not None else '?'})"
                )
            if info is not None and info.start_time is not None:
                node = task.node_info.node_id if task.node_info else None
                if start is not None and start[0] != info.start_time and start[2] == retry:
                    offset = 0  # started again without a retry: requeued, new stdout.txt
                    on_line(
                        f"task {spec.id} was requeued (a node was preempted or recovered): "
                        f"it starts again on {node}, from its last checkpoint"
                    )
                    if self.spot is not None:
                        self.spot.requeued(now)
                if deadline is not None and (start is None or start[0] != info.start_time):
                    deadline.restart()  # an attempt starts (first, retried or requeued)
                start = (info.start_time, node, retry)
            if self.spot is not None and self.spot.on_spot:
                nodes = list(self.client.list_nodes(self.pool_id))
                why = self.spot.observe(nodes, task.state == "running", now)
                if why is not None:
                    self._fall_back(why, on_line, now)
            if spec.coordination_command:
                self._log_subtasks(job_id, spec, states, on_line)
            if task.state in ("running", "completed"):
                offset = self._stream(job_id, spec.id, offset, on_line)
            if task.state == "completed":
                return task
            reason = deadline.overdue() if deadline is not None and start is not None else None
            if reason is not None and task.state == "running":
                self._end_hung(job_id, spec, reason, on_line)
                if stalls is not None:
                    stalls.append(reason)
                deadline = None  # ended: what follows is its end, not more progress
            if task.creation_time is not None and now > task.creation_time + lifetime:
                self._give_up(job_id, spec, task, lifetime)
            time.sleep(next(delays))

    def _fall_back(self, why: str, on_line: Callable[[str], None], now: datetime) -> None:
        """``pool.spot_fallback``: as many dedicated nodes as the pool had nodes, no Spot node.
        A task running on Spot nodes is requeued (``requeue``); queued, it starts on the
        dedicated nodes once they are ready, from its last checkpoint."""
        assert self.spot is not None
        dedicated = self.config.pool.nodes
        on_line(
            f"pool {self.pool_id}: {why}: moving to {dedicated} dedicated node(s) "
            "(pool.spot_fallback)"
        )
        self._wait_steady_allocation(fresh=False)
        self.client.begin_resize_pool(
            self.pool_id,
            resize_body(dedicated, 0, requeue=True),
            polling_interval=self.polling.lro_seconds,
        ).result()
        self.spot.moved(now, dedicated, why)

    def _end_hung(
        self, job_id: str, spec: TaskSpec, reason: str, on_line: Callable[[str], None]
    ) -> None:
        """Terminate a hung attempt (every subtask of it): it would hold its nodes until its
        maximum run time. A task that completed meanwhile (409) has nothing left to end."""
        from azure.core.exceptions import HttpResponseError

        on_line(f"task {spec.id}: {reason}: terminating it")
        try:
            self.client.terminate_task(job_id, spec.id)
        except HttpResponseError as exc:
            if exc.status_code != 409:
                raise

    def _log_subtasks(
        self,
        job_id: str,
        spec: TaskSpec,
        states: dict[Any, tuple[Any, Any]],
        on_line: Callable[[str], None],
    ) -> None:
        for sub in self.client.list_subtasks(job_id, spec.id):
            node = sub.node_info.node_id if sub.node_info else "?"
            state = (sub.state, sub.exit_code)
            if states.get(sub.id) != state:
                states[sub.id] = state
                on_line(
                    f"subtask {sub.id} on {node}: {service_name(sub.state)}"
                    + (f" (exit {sub.exit_code})" if sub.exit_code is not None else "")
                )

    def _give_up(self, job_id: str, spec: TaskSpec, task: Any, lifetime: Any) -> None:
        """Past the longest the task could take: stop it (nothing runs unobserved) and say why."""
        pool = self.client.get_pool(self.pool_id)
        nodes = sorted(service_name(n.state) for n in self.client.list_nodes(self.pool_id))
        errors = "; ".join(f"{e.code}: {e.message}" for e in pool.resize_errors or [])
        reason = f"task {spec.id} did not finish within {lifetime} of its submission"
        self.client.begin_terminate_job(
            job_id,
            _terminate_body(reason[:100]),
            polling_interval=self.polling.lro_seconds,
        ).result()
        raise TaskFailedError(
            f"{reason} (state {service_name(task.state)}; pool {self.pool_id} nodes: "
            + (", ".join(nodes) or "none")
            + (f"; resize errors: {errors}" if errors else "")
            + "): its job was terminated. Nodes that never become idle (Spot capacity gone, "
            "unusable nodes) keep a task from starting"
        )

    def _stream(
        self, job_id: str, task_id: str, offset: int, on_line: Callable[[str], None]
    ) -> int:
        """New whole lines of stdout.txt since ``offset``. The file's size comes first: Batch
        refuses a range that starts at or past the end (416), and a requeued task's new file
        may be shorter than what was already read."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            size = int(
                self.client.get_task_file_properties(job_id, task_id, "stdout.txt").content_length
                or 0
            )
        except ResourceNotFoundError:  # until the process starts
            return offset
        if size < offset:
            offset = 0

        def read(start: int, end: int) -> bytes:
            return b"".join(
                self.client.download_task_file(
                    job_id, task_id, "stdout.txt", ocp_range=f"bytes={start}-{end - 1}"
                )
            )

        try:
            return read_new_lines(size, offset, read, on_line)
        except ResourceNotFoundError:  # the node went since its size was read: a requeue
            return offset

    def _uploaded(self, spec: TaskSpec) -> list[str]:
        """What the node actually uploaded, listed from the output container."""
        names: set[str] = set()
        for out in spec.outputs:
            if "*" in out.pattern:
                names.update(
                    b.name
                    for b in self.outputs.list_blobs(name_starts_with=folder(out.destination))
                )
            elif self.outputs.get_blob_client(out.destination).exists():
                names.add(out.destination)
        return sorted(names)

    # -- release ------------------------------------------------------------------------------
    def terminate_jobs(self) -> list[str]:
        """Terminate every active job of this pipeline on the pool (cancellation)."""
        reason = _terminate_body("retrain flow released the pool")
        stopped = []
        for job in self.client.list_jobs(filter="state eq 'active'"):
            pool = job.pool_info.pool_id if job.pool_info else None
            if pool == self.pool_id and (job.id or "").startswith(f"{self.pool_id}-"):
                self.client.begin_terminate_job(
                    str(job.id), reason, polling_interval=self.polling.lro_seconds
                ).result()
                stopped.append(str(job.id))
        return stopped

    def release(self) -> dict[str, Any]:
        """Stop what runs, then resize to zero or delete, as configured. Safe to call twice."""
        from azure.core.exceptions import ResourceNotFoundError

        stopped = self.terminate_jobs()
        try:
            pool = self.client.get_pool(self.pool_id)
        except ResourceNotFoundError:
            return {"pool": self.pool_id, "was": "absent", "killed_tasks": stopped}
        was = (
            f"{(pool.current_dedicated_nodes or 0) + (pool.current_low_priority_nodes or 0)} nodes"
        )
        if self.config.pool.release == "delete":
            self.client.begin_delete_pool(
                self.pool_id, polling_interval=self.polling.lro_seconds
            ).result()
        elif pool.enable_auto_scale:
            self.client.disable_pool_auto_scale(self.pool_id)
            self._resize_to_zero()
        else:
            self._resize_to_zero()
        return {
            "pool": self.pool_id,
            "was": was,
            "killed_tasks": stopped,
            "action": self.config.pool.release,
        }

    def _resize_to_zero(self) -> None:
        pool = self._wait_steady_allocation_or_stop()
        if (pool.target_dedicated_nodes or 0) + (pool.target_low_priority_nodes or 0) == 0:
            return
        self.client.begin_resize_pool(
            self.pool_id, resize_body(0, 0), polling_interval=self.polling.lro_seconds
        ).result()

    def _wait_steady_allocation_or_stop(self) -> Any:
        pool = self.client.get_pool(self.pool_id)
        if pool.allocation_state == "resizing":  # a resize in progress blocks a new one
            self.client.begin_stop_pool_resize(
                self.pool_id, polling_interval=self.polling.lro_seconds
            ).result()
            pool = self.client.get_pool(self.pool_id)
        return pool


def _terminate_body(reason: str) -> Any:
    """A job's terminate body as the JSON the operation accepts: azure-batch 15.1 exports no
    model for it, and fails to build the request without a body (a None content type)."""
    return {"terminateReason": reason}
