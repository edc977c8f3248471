"""Helpers for flow tests: a config on fresh containers, seeded data, reads from the Prefect API."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

from backends.blob import container_client, upload_directory
from core.config import PipelineConfig, load_config
from deployments.setup import WORK_POOL
from tests.conftest import ROOT


def _image_builder() -> list[str]:
    """configs/local.yaml builds the training image with buildah. Where this machine cannot (no
    root, no buildah) the flow tests run with image.builder none, as `make demo` does there;
    the tests of the build itself skip saying why (and fail under CI)."""
    from backends.local.buildah import unavailable_reason

    return [] if unavailable_reason() is None else ["image.builder=none"]


def make_config(tmp_path: Path, *overrides: str) -> PipelineConfig:
    """configs/local.yaml on containers of its own and directories under tmp_path, training
    one rank: a flow test is about the steps around the training, and every rank is a process
    that starts torch (about 3 CPU-seconds before it trains). The tests of what two ranks change
    ask for them (``pool.processes_per_node=2``): the end-to-end flow here, the trainer's and
    the nodes' own tests under tests/training/ and tests/reliability/."""
    suffix = uuid.uuid4().hex[:10]
    return load_config(
        ROOT / "configs" / "local.yaml",
        [
            f"data.container=data-{suffix}",
            f"output.container=out-{suffix}",
            f"share.local_dir={tmp_path / 'share'}",
            f"nfs.local_dir={tmp_path / 'nfs'}",
            f"work_dir={tmp_path / 'work'}",
            f"pool.id=pool-{suffix}",
            "training.epochs=3",
            "training.batch_size=16",
            "pool.processes_per_node=1",
            # Not the MLflow server configs/local.yaml names (`make service`'s, which another
            # program may hold here): the tracking tests start their own.
            "tracking.mlflow_uri=null",
            # A model of an epoch or two is near chance, some class at recall 0: held to the
            # promotion's floor, whether a first run is promoted would be chance too. The
            # floor's decision is tested on its own (tests/registry/test_promotion.py).
            "promotion.minimum.class_recall=null",
            *_image_builder(),
            *overrides,
        ],
    )


def seed(config: PipelineConfig, source: Path) -> int:
    return upload_directory(container_client(config.data, create=True), source, config.data.prefix)


async def _read(flow_run_id: UUID) -> tuple[list[Any], list[Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    async with get_client() as client:
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return task_runs, artifacts


def task_runs_and_artifacts(flow_run_id: UUID) -> tuple[dict[str, Any], list[Any]]:
    """Task runs by step name (the last run of each) and every artifact of one flow run."""
    task_runs, artifacts = asyncio.run(_read(flow_run_id))
    by_step = {
        run.name.rsplit("-", 1)[0]: run for run in sorted(task_runs, key=lambda r: r.created)
    }
    return by_step, artifacts


def flow_run_logs(flow_run_id: Any) -> str:
    """Every log line of one flow run, from the Prefect API."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[Any]:
        logs: list[Any] = []
        async with get_client() as client:
            while True:  # the API pages at 200
                page = await client.read_logs(
                    LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                    limit=200,
                    offset=len(logs),
                )
                logs += page
                if len(page) < 200:
                    return logs

    return "\n".join(log.message for log in asyncio.run(read()))


def new_container(connection_string: str, stem: str) -> Any:
    """A container of its own on Azurite, for one test."""
    from azure.storage.blob import ContainerClient

    from backends.blob import API_VERSION

    client = ContainerClient.from_connection_string(
        connection_string, f"{stem}-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    return client


@contextlib.contextmanager
def deployment_defaults(deployed: dict[str, Any], parameters: dict[str, Any]) -> Iterator[None]:
    """Every deployment's default parameters set to ``parameters`` (what `prefect deploy`
    gives them from prefect.yaml's `config_path`: the deployment's config file, which its runs
    may not change but for their training settings and data), and set back afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        for deployment in deployed.values():
            client.update_deployment(deployment.id, DeploymentUpdate(parameters=parameters))
        try:
            yield
        finally:
            for deployment in deployed.values():
                client.update_deployment(
                    deployment.id, DeploymentUpdate(parameters=deployment.parameters)
                )


def execute_as_worker(run: Any, env: dict[str, str]) -> tuple[Any, str]:
    """Run one flow run as the process worker does (its Pending state proposed, which takes the
    deployment's concurrency slot, then `prefect flow-run execute`, the command the worker
    starts) in ``env``; its final state and the command's output."""
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    with get_client(sync_client=True) as client:
        proposed = client.set_flow_run_state(run.id, Pending())
        accepted = proposed.status.value == "ACCEPT"
        holders = [] if accepted else runs_left_unfinished([run.deployment_id])
        assert accepted, f"{proposed.details}; unfinished runs of the deployment: " + ", ".join(
            f"{r.name} ({r.state_name}, {r.parameters})" for r in holders
        )
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "flow-run", "execute", str(run.id)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    return state, proc.stdout[-3000:] + proc.stderr[-3000:]


@contextlib.contextmanager
def process_worker(env: dict[str, str]) -> Iterator[str]:
    """A `prefect worker start` on the retrain-workers pool, as the service runs it, polling a
    work queue of its own; yields the queue's name, which the test gives its runs
    (``run_deployment(..., work_queue_name=queue)``). A worker on the whole pool would also take
    the runs other tests left scheduled on the session's server (the relay's and the sensor's,
    which no one executes) and, ended mid-run, leave one of them holding its deployment's
    concurrency slot for the rest of the session.

    Ended with every process below it: the worker starts each flow run in a process group of
    its own, so the worker's group alone would leave a run that is still going (a test that
    failed mid-run) training against the next test's server. SIGTERM first (the worker's own
    shutdown); what is still there after a minute (a worker, on a loaded machine) is killed."""
    import subprocess
    import sys

    import psutil
    from prefect.client.orchestration import get_client

    queue = f"test-{uuid.uuid4().hex[:10]}"
    with get_client(sync_client=True) as client:
        created = client.create_work_queue(name=queue, work_pool_name=WORK_POOL)
    worker = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "prefect"),
            *("worker", "start", "--pool", WORK_POOL, "--work-queue", queue),
            *("--prefetch-seconds", "1"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield queue
    finally:
        try:
            main = psutil.Process(worker.pid)
            tree = [*main.children(recursive=True), main]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(tree, timeout=60)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        worker.wait()
        with get_client(sync_client=True) as client:
            client.delete_work_queue_by_id(created.id)


UNFINISHED = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "PAUSED")


def runs_left_unfinished(deployment_ids: list[UUID]) -> list[Any]:
    """The runs of these deployments a person or a trigger started (not the schedules' own)
    that have not reached a final state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=deployment_ids),
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType[t] for t in UNFINISHED])
                ),
            )
        )
    return [run for run in runs if not run.auto_scheduled]


def cancel_runs_left_unfinished(deployment_ids: list[UUID], why: str) -> list[Any]:
    """Cancel what :func:`runs_left_unfinished` finds, forced as the UI's cancel of a run with
    no infrastructure is: the transition releases the deployment concurrency slot a Pending or
    Running run holds, so a run the next test executes is not refused for a slot no one will
    give back. The runs cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    left = runs_left_unfinished(deployment_ids)
    with get_client(sync_client=True) as client:
        for run in left:
            client.set_flow_run_state(run.id, Cancelled(message=why), force=True)
    return left
