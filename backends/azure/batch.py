"""Azure Batch as the pipeline's cluster: ensure the pool, run task specs, release the pool.

Everything the orchestrator needs to see goes through the Batch API: pool and node states,
each subtask of a multi-instance task, the primary's stdout (streamed into the Prefect logs by
range reads), and the task's end state. Retries of a failed task are the service's own
(``maxTaskRetryCount``), so a retry runs on the nodes already allocated and the trainer resumes
from its checkpoint in NFS.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.azure import service_name
from backends.azure.access import NodeAccess, redact
from backends.azure.batch_requests import (
    job_body,
    pool_body,
    resize_body,
    task_body,
)
from backends.blob import folder
from backends.taskspec import TaskResult, TaskSpec
from flows.config import PipelineConfig

if TYPE_CHECKING:
    from azure.batch import BatchClient
    from azure.storage.blob import ContainerClient


class PoolError(RuntimeError):
    """The pool cannot be used as configured; the message says which setting or node."""


class TaskFailedError(RuntimeError):
    """A Batch task could not run at all (e.g. its job was terminated)."""


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


# Settings Batch cannot change on an existing pool: a mismatch needs a new pool.
def _immutable(pool: Any) -> dict[str, Any]:
    vm = pool.virtual_machine_configuration
    image = vm.image_reference if vm else None
    return {
        "vm_size": (pool.vm_size or "").lower(),
        "enable_inter_node_communication": bool(pool.enable_inter_node_communication),
        "task_slots_per_node": pool.task_slots_per_node,
        "image": (image.publisher, image.offer, image.sku) if image else None,
        "node_agent_sku_id": vm.node_agent_sku_id if vm else None,
        "mounts": sorted(
            (mc.nfs_mount_configuration.source if mc.nfs_mount_configuration else "")
            + (
                mc.azure_file_share_configuration.azure_file_url
                if mc.azure_file_share_configuration
                else ""
            )
            for mc in (pool.mount_configuration or [])
        ),
    }


class BatchCluster:
    retries_in_service = True

    def __init__(
        self,
        config: PipelineConfig,
        client: BatchClient,
        outputs: ContainerClient,
        access: NodeAccess,
        image: str,
        secrets: Callable[[], tuple[str, str | None]] = lambda: ("", None),
        polling: Polling | None = None,
    ) -> None:
        self.config, self.client, self.outputs = config, client, outputs
        self.access, self.image = access, image
        self._secrets = secrets  # (share key, registry password), fetched only to create a pool
        self.polling = polling or Polling()
        self.pool_id = config.pool.id

    # -- pool ---------------------------------------------------------------------------------
    def ensure_pool(self) -> dict[str, Any]:
        """Create when missing, grow when smaller, refuse when an immutable setting differs."""
        from azure.core.exceptions import ResourceNotFoundError

        pool_cfg = self.config.pool
        share_key, registry_password = self._secrets()
        wanted = pool_body(self.config, self.image, self.access, share_key, registry_password)
        action = "reused"
        try:
            existing = self.client.get_pool(self.pool_id)
        except ResourceNotFoundError:
            existing = None
        if existing is not None and existing.state == "deleting":
            self._wait_deleted()
            existing = None
        if existing is None:
            self.client.create_pool(wanted)
            action = "created"
        else:
            have, want = _immutable(existing), _immutable(wanted)
            diff = [
                f"{k}: pool has {have[k]!r}, config wants {want[k]!r}"
                for k in want
                if have[k] != want[k]
            ]
            if diff:
                raise PoolError(
                    f"pool {self.pool_id} exists with settings Batch cannot change ("
                    + "; ".join(diff)
                    + "): delete it, or set pool.id to a new pool"
                )
            if not pool_cfg.autoscale_formula and (
                (existing.target_dedicated_nodes or 0) < pool_cfg.dedicated_nodes
                or (existing.target_low_priority_nodes or 0) < pool_cfg.low_priority_nodes
            ):
                self._wait_steady_allocation()
                self.client.begin_resize_pool(
                    self.pool_id,
                    resize_body(pool_cfg.dedicated_nodes, pool_cfg.low_priority_nodes),
                    polling_interval=self.polling.lro_seconds,
                ).result()
                action = "resized"
        nodes = self._wait_nodes_ready()
        return {
            "pool": self.pool_id,
            "created": action != "reused",
            "action": action,
            "nodes": len(nodes),
            "vm_size": pool_cfg.vm_size,
        }

    def _wait_deleted(self) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        for delay in self.polling.delays():
            try:
                self.client.get_pool(self.pool_id)
            except ResourceNotFoundError:
                return
            time.sleep(delay)

    def _wait_steady_allocation(self) -> Any:
        deadline = time.monotonic() + 60 * self.config.pool.start_timeout_minutes
        for delay in self.polling.delays():
            pool = self.client.get_pool(self.pool_id)
            if pool.resize_errors:
                errors = "; ".join(f"{e.code}: {e.message}" for e in pool.resize_errors)
                raise PoolError(f"pool {self.pool_id} could not allocate nodes: {errors}")
            if pool.allocation_state == "steady":
                return pool
            if time.monotonic() > deadline:
                raise PoolError(f"pool {self.pool_id} still resizing after the start timeout")
            time.sleep(delay)

    def _wait_nodes_ready(self) -> list[Any]:
        """Until every node is idle or running; fail fast on unusable or start-task-failed."""
        needed = self.config.pool.nodes
        deadline = time.monotonic() + 60 * self.config.pool.start_timeout_minutes
        for delay in self.polling.delays():
            self._wait_steady_allocation()
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
        return f"{self.pool_id}-{spec.id}"[:64]

    def run_task(
        self, spec: TaskSpec, on_line: Callable[[str], None] = lambda _: None
    ) -> TaskResult:
        """Submit (or re-attach to) the task, follow it to the end, report its outputs."""
        from azure.core.exceptions import ResourceExistsError

        started = time.perf_counter()
        job_id = self.job_id(spec)
        # Exists already: a re-run of the same step after an orchestrator crash; follow it.
        with contextlib.suppress(ResourceExistsError):
            self.client.create_job(job_body(self.config, job_id))
        try:
            self.client.create_task(job_id, task_body(self.config, spec, self.image, self.access))
        except ResourceExistsError:
            on_line(f"task {spec.id} already submitted: following it")
        task = self._follow(job_id, spec, on_line)
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
        )

    def _follow(self, job_id: str, spec: TaskSpec, on_line: Callable[[str], None]) -> Any:
        from azure.core.exceptions import ResourceNotFoundError

        offset, attempt = 0, 0
        states: dict[Any, tuple[Any, Any]] = {}
        delays = self.polling.delays()
        while True:
            task = self.client.get_task(job_id, spec.id)
            info = task.execution_info
            retry = (info.retry_count or 0) if info else 0
            if retry != attempt:  # the service retried: a new stdout.txt starts at 0
                on_line(
                    f"task {spec.id}: attempt {retry + 1} of {spec.max_retries + 1} "
                    f"(previous exit code {info.exit_code if info else '?'})"
                )
                attempt, offset = retry, 0
            if spec.coordination_command:
                for sub in self.client.list_subtasks(job_id, spec.id):
                    node = sub.node_info.node_id if sub.node_info else "?"
                    state = (sub.state, sub.exit_code)
                    if states.get(sub.id) != state:
                        states[sub.id] = state
                        on_line(
                            f"subtask {sub.id} on {node}: {service_name(sub.state)}"
                            + (f" (exit {sub.exit_code})" if sub.exit_code is not None else "")
                        )
            if task.state in ("running", "completed"):
                with contextlib.suppress(ResourceNotFoundError):  # until the process starts
                    offset = self._stream(job_id, spec.id, offset, on_line)
            if task.state == "completed":
                return task
            time.sleep(next(delays))

    def _stream(
        self, job_id: str, task_id: str, offset: int, on_line: Callable[[str], None]
    ) -> int:
        chunks = self.client.download_task_file(
            job_id, task_id, "stdout.txt", ocp_range=f"bytes={offset}-"
        )
        data = b"".join(chunks)
        if not data:
            return offset
        end = data.rfind(b"\n") + 1  # only whole lines; the rest comes with the next read
        for line in data[:end].decode(errors="replace").splitlines():
            on_line(line)
        return offset + end

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
        # azure-batch 15.1 fails to build the request without a body (a None content type).
        from azure.batch.models._models import BatchJobTerminateOptions

        reason = BatchJobTerminateOptions(termination_reason="retrain flow released the pool")
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
