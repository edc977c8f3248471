"""Shared fixtures: real datasets on disk and a runner for the real trainer command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import tempfile

from backends.local.ports import free_port

# Before anything imports Prefect: a private home (cached state must not leak between
# sessions) and no analytics.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="prefect-home-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_BATCH_INTERVAL"] = "0.3"
os.environ["GX_ANALYTICS_ENABLED"] = "false"
# Prefect's waits, shortened for the test servers and workers (what is checked stays the same):
# a run refused a deployment's concurrency slot is scheduled again after 2 s instead of 30 (the
# tests' deployments allow one run at a time and several tests queue three runs), and a worker
# asks for runs every 2 s instead of 10. A test's runs otherwise wait on those clocks while
# the machine idles.
os.environ["PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS"] = "2"
os.environ["PREFECT_WORKER_QUERY_SECONDS"] = "2"
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from imagedata.make_images import write_digits, write_synthetic

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class Result:
    returncode: int
    output: str
    output_dir: Path

    @property
    def metrics(self) -> dict[str, Any]:
        return json.loads((self.output_dir / "metrics.json").read_text())


ENGINES = ("horovod", "ddp")
# Both engines, the second one's run a repeat marked slow (`make reliability`): for a test of
# what does not depend on the engine beyond the primitives (broadcast, allreduce, checkpoint
# format) every DDP run of `make test` exercises (tests/training/test_train.py's two-rank runs).
ENGINES_REPEATED = ("horovod", pytest.param("ddp", marks=pytest.mark.slow))


def trainer_command(
    np: int,
    data_dir: str | Path,
    output_dir: Path,
    *extra: str,
    engine: str = "horovod",
    onnx: bool = False,
) -> list[str]:
    """The trainer's documented command line for ``engine``: under horovodrun (horovod) or
    torchrun (ddp) when np > 1, a plain process otherwise. Without model.onnx unless ``onnx``:
    its export and check are about 5 of a tiny run's 9 CPU-seconds, and only the tests of the
    ONNX file read it (tests/training/test_train.py's two-rank runs, test_predict.py's model,
    tests/training/test_onnx_export.py; every flow run writes one)."""
    args = ["--data-dir", str(data_dir), "--output-dir", str(output_dir), *extra]
    if not onnx:
        args.append("--no-onnx")
    if engine != "horovod":
        args += ["--engine", engine]
    train = [sys.executable, "-m", "training.train", *args]
    if np == 1:
        return train
    if engine == "ddp":
        return [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            str(np),
            "-m",
            "training.train",
            *args,
        ]
    return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *train]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


# Rank 0's running mean loss after each of the first batches, logged with --log-every 1.
LOSS_LOG_ARGS = ("--log-every", "1")


def first_step_losses(output: str, steps: int = 4) -> list[float]:
    """Epoch 1's running mean loss after each of its first ``steps`` batches, as rank 0 logged
    it (``LOSS_LOG_ARGS``). Two runs of one data, seed, model and world size take these steps
    on the same broadcast weights, sampler order and averaged gradients, whatever the engine
    or the node layout: they agree within float rounding, where the accuracy after a short run
    may drift apart chaotically on some processors."""
    found = re.findall(r"epoch 1 batch (\d+): mean loss so far ([0-9.]+)", output)
    losses = {int(batch): float(loss) for batch, loss in found}
    assert sorted(losses)[:steps] == list(range(1, steps + 1)), found[:steps]
    return [losses[b] for b in range(1, steps + 1)]


def run_trainer(
    np: int,
    data_dir: str | Path,
    output_dir: Path,
    *extra: str,
    timeout: float = 600,
    engine: str = "horovod",
    onnx: bool = False,
) -> Result:
    proc = subprocess.run(
        trainer_command(np, data_dir, output_dir, *extra, engine=engine, onnx=onnx),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return Result(proc.returncode, proc.stdout, output_dir)


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's real handwritten digits as an image-folder dataset (grayscale 8x8 PNGs)."""
    root = tmp_path_factory.mktemp("digits")
    write_digits(root, test_fraction=0.25, seed=0, per_class=None)
    return root


@pytest.fixture
def small_folders(tmp_path: Path) -> Path:
    """A tiny learnable image-folder dataset the test may damage as it likes."""
    root = tmp_path / "data"
    write_synthetic(root, classes=3, per_class=16, size=32, test_fraction=0.3, seed=1)
    return root


@pytest.fixture(scope="session")
def horovodrun() -> Path:
    path = BIN / "horovodrun"
    if not path.exists() and shutil.which("horovodrun") is None:
        pytest.fail("horovodrun is missing: run `make setup` (scripts/install_horovod.sh)")
    return path


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Azurite Blob service for the whole session; yields its connection string."""
    from backends.local.azurite import running_azurite

    with running_azurite(tmp_path_factory.mktemp("azurite")) as conn:
        yield conn


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real Prefect server (SQLite) for the session: flows, task runs and artifacts go there."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def image_registry() -> Iterator[Any]:
    """The local registry (docker-registry) on a free port for the session, over the storage
    every build on this machine shares: an image pushed by an earlier session, or by a flow's
    build step, is found by its tag."""
    from backends.local.oci_server import local_registry
    from tests.nodes_helpers import require_image_tools

    require_image_tools()
    with local_registry(None) as registry:
        yield registry


@pytest.fixture(scope="session")
def training_image(image_registry: Any) -> str:
    """The training image's cpu variant (docker/Dockerfile), built once per content (the tag)
    and pushed, as the local target's build step does; its reference."""
    from backends.local.buildah import LocalImageBuilder

    lines: list[str] = []
    result = LocalImageBuilder(image_registry).build(ROOT, "retrain/horovod", lines.append)
    print(f"training image {result.reference}: {result.reason}")
    return result.reference


@pytest.fixture(scope="session")
def image_puller() -> Any:
    """What the emulated nodes pull images with (their layer cache is this machine's)."""
    from backends.oci import cache_dir
    from tests.fakes.container import ImagePuller

    return ImagePuller(cache_dir() / "node-images")


@pytest.fixture
def fake_azure_account(azurite: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Fake Batch, Files and ACR behind the real SDK clients; Blob is Azurite."""
    from tests.azure_helpers import fake_azure

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    with fake_azure() as fakes:
        yield fakes


def prefect_api_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PWD": str(ROOT)}


# The session's server, then the same scenario on PostgreSQL: a repeat under a second database,
# run by `make reliability` (the PostgreSQL server of `make service` itself is in `make test`:
# tests/deployments/test_service.py).
PREFECT_DATABASES = ("sqlite", pytest.param("postgresql", marks=pytest.mark.slow))


@pytest.fixture(scope="session")
def postgres_prefect_api() -> Iterator[str]:
    """A Prefect server on a real PostgreSQL, started as `make service` starts them, once per
    session and only when a test asks for it; yields its API URL.

    The service tests (concurrent runs under the pool lock, the trigger burst, cancellation)
    run against it as well as against the session's SQLite server (``prefect_database``):
    SQLite serializes writers, and the team service runs on PostgreSQL."""
    from deployments.postgres import Cluster, PostgresError
    from deployments.service import postgres_component, prefect_component
    from deployments.supervisor import Supervisor

    # A private state folder (mode 0700, as a checkout under /root is): as root, PostgreSQL
    # runs as the postgres user, and its data folder goes where that user can reach it.
    state = Path(tempfile.mkdtemp(prefix="retrain-postgres-", dir="/tmp"))
    cluster = None
    try:
        cluster = Cluster.at(state / "pg")
    except PostgresError as exc:
        shutil.rmtree(state, ignore_errors=True)
        if os.environ.get("RETRAIN_REQUIRE_EMULATED_NODES"):
            pytest.fail(f"RETRAIN_REQUIRE_EMULATED_NODES is set but {exc}")
        pytest.skip(f"no PostgreSQL here: {exc}")
    port = free_port()
    supervisor = Supervisor(state / "logs", say=lambda line: None)
    try:
        supervisor.start(postgres_component(cluster))
        supervisor.start(prefect_component(port, cluster, dict(os.environ)))
        yield f"http://127.0.0.1:{port}/api"
    finally:
        supervisor.stop()
        shutil.rmtree(state, ignore_errors=True)
        if cluster is not None:
            shutil.rmtree(cluster.data_dir, ignore_errors=True)


@pytest.fixture(params=PREFECT_DATABASES)
def prefect_database(request: pytest.FixtureRequest, prefect_api: None) -> Iterator[str]:
    """The test runs twice: on the session's server (SQLite), then on one on PostgreSQL, with
    every client, thread and subprocess of the test pointed at it (that one is marked slow)."""
    if request.param == "sqlite":
        yield request.param
        return
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = request.getfixturevalue("postgres_prefect_api")
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: api}))
        # As prefect_test_harness does: threads the test starts (the relay's) see it too.
        stack.enter_context(_temporary_global_settings_context(get_settings_context()))
        yield request.param


_deployed: dict[str, dict[str, Any]] = {}


@pytest.fixture
def deployed(request: pytest.FixtureRequest, prefect_api: None) -> Iterator[dict[str, Any]]:
    """`python -m deployments.setup` then `prefect deploy --all`, as the README says, once per
    server (the test's ``prefect_database`` chooses which, when it asks for one).

    Afterwards, the runs the test started and left unfinished (those its relay or sensor
    started, which no one executes, or one it was executing when it failed) are cancelled: a
    Pending or Running one holds its deployment's concurrency slot (limit 1), and the next test
    on this server that executes a run of that deployment would be refused."""
    if "prefect_database" in request.fixturenames:
        request.getfixturevalue("prefect_database")
    env = prefect_api_env()
    if env["PREFECT_API_URL"] not in _deployed:
        for args in (
            [sys.executable, "-m", "deployments.setup", "--config", "configs/local.yaml"],
            [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all"],
        ):
            proc = subprocess.run(
                args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
        _deployed[env["PREFECT_API_URL"]] = asyncio.run(_read_deployments())
    deployments = _deployed[env["PREFECT_API_URL"]]
    yield deployments
    from tests.pipeline_helpers import cancel_runs_left_unfinished

    cancel_runs_left_unfinished(
        [d.id for d in deployments.values()], f"left unfinished by {request.node.nodeid}"
    )


async def _read_deployments() -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return {
            name: await client.read_deployment_by_name(name)
            for name in (
                "retrain/manual",
                "retrain/nightly",
                "retrain/on-new-data",
                "watch-new-data/poll",
                "label-images/manual",
            )
        }


# Set-ups that make a test a whole-system one: a server, an emulator, real launchers, nodes.
# A test that needs none of them, and no marker saying it starts processes of its own
# (``processes``), is a unit test: ``make test-quick`` runs those (``pytest -m quick``). What
# a unit test does is checked while it runs (``_a_unit_test_starts_nothing``), so a test that
# starts a process or a server through any other fixture or helper fails, naming the marker.
SYSTEM_FIXTURES = frozenset(
    {
        "azurite",
        "prefect_api",
        "deployed",
        "fake_azure_account",
        "horovodrun",
    }
)


class StartedSomethingError(AssertionError):
    """A test marked quick started a process or a server."""


_STARTS = {
    "subprocess.Popen": "starts a process",
    "os.fork": "forks",
    "os.forkpty": "forks",
    "os.posix_spawn": "starts a process",
    "os.spawn": "starts a process",
    "os.exec": "replaces its process",
    "os.system": "starts a shell",
}
_unit_test: list[str] = []  # the node id of the quick test running now, if any


def _refuse_starts(event: str, args: tuple[Any, ...]) -> None:
    if _unit_test and event in _STARTS:
        _started(_STARTS[event])


def _started(what: str) -> None:
    raise StartedSomethingError(
        f"{_unit_test[0]} {what}: mark it @pytest.mark.processes (a unit test starts no "
        "process, server or launcher)"
    )


sys.addaudithook(_refuse_starts)  # Python's own audit events: every way a process starts
# Libraries run a program once per process, or once per machine: Great Expectations asks
# `uname -p`, matplotlib builds its font cache with `fc-list`. Done here, before any test, so
# whichever test asks first is not the one that runs a program.
platform.processor()
import matplotlib.font_manager  # noqa: E402, F401


@contextlib.contextmanager
def _starting_nothing(item: pytest.Item) -> Iterator[None]:
    """For a test marked ``quick``: starting a process or listening on a socket, in the test or
    in any fixture it sets up (a session's included), fails it, so the quick suite never
    builds, serves or launches anything."""
    if item.get_closest_marker("quick") is None:
        yield
        return
    import socket

    listen = socket.socket.listen

    def refused(*args: Any, **kwargs: Any) -> None:
        _started("listens on a socket (a server)")

    socket.socket.listen = refused  # type: ignore[method-assign]
    _unit_test.append(item.nodeid)
    try:
        yield
    finally:
        _unit_test.clear()
        socket.socket.listen = listen  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _starting_nothing(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _starting_nothing(item):
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reliability = ROOT / "tests" / "reliability"
    for item in items:
        if item.path.is_relative_to(reliability):
            item.add_marker(pytest.mark.reliability)
        fixtures = set(getattr(item, "fixturenames", ()))
        # A GPU test needs a device, not a unit test's nothing: never quick.
        system = item.get_closest_marker("processes") or item.get_closest_marker("gpu")
        if not fixtures & SYSTEM_FIXTURES and system is None:
            item.add_marker(pytest.mark.quick)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the longest files first
        from tests import durations

        order = durations.longest_first([i.nodeid.split("::")[0] for i in items], durations.load())
        items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Under pytest-xdist (``make test``): where each worker leaves its reliability rows."""
    rows_dir = getattr(node.config, "_reliability_rows_dir", None)
    if rows_dir is None:
        rows_dir = tempfile.mkdtemp(prefix="reliability-rows-")
        node.config._reliability_rows_dir = rows_dir
    node.workerinput["reliability_rows_dir"] = rows_dir


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the reliability suite's figures (docs/reliability.md under `make reliability`).

    Under pytest-xdist each worker saves its rows and the controlling process, which finishes
    last, writes the report from all of them."""
    from tests.reliability import report

    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        rows = Path(worker["reliability_rows_dir"]) / f"{worker['workerid']}.json"
        report.dump(rows)
        return
    rows_dir = getattr(session.config, "_reliability_rows_dir", None)
    if rows_dir is not None:
        for saved in sorted(Path(rows_dir).glob("*.json")):
            report.load(saved)
        shutil.rmtree(rows_dir, ignore_errors=True)
    if report.has_rows():
        target = os.environ.get("RETRAIN_RELIABILITY_REPORT") or str(
            ROOT / ".work" / "reliability.md"
        )
        report.write(Path(target), tests_passed=exitstatus == 0)
