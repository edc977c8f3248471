"""make service (deployments/service.py): its relay secret, the runs an unclean stop left, and the
whole service from make service to Ctrl-C, driven through a browser: its runs tracked in its
MLflow server, and a promotion and a failed run each told by one webhook notification."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from backends.local.ports import free_port
from tests.conftest import ROOT, child_env
from tests.deployments.test_alerts import webhook_receiver
from tests.deployments.test_supervisor import lines_until, process_tree
from tests.reliability import report


def test_a_generated_relay_secret_is_the_owners_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deployments.service import relay_secret

    monkeypatch.delenv("RETRAIN_RELAY_SECRET", raising=False)
    first = relay_secret(tmp_path)
    assert len(first) == 48 and relay_secret(tmp_path) == first  # kept across restarts
    assert (tmp_path / "relay-secret").stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RETRAIN_RELAY_SECRET", "given")
    assert relay_secret(tmp_path) == "given"


def _api(base: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One call to the service's API with its auth string, which ``base`` names: the state
    folder's credentials (the service asks every client for it)."""
    from scripts.ui_screenshots import api

    return api(base, path, body, auth=_AUTH.get(base.rstrip("/")))


_AUTH: dict[str, str] = {}  # the API's address: its auth string, once the service made it


def _wait(what: str, check: Callable[[], Any], seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
    return value


@pytest.fixture
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        reason = "no chromium: `make setup` installs it as root (apt-get install chromium)"
        if os.environ.get("RETRAIN_REQUIRE_EMULATED_NODES"):
            pytest.fail(f"RETRAIN_REQUIRE_EMULATED_NODES is set but {reason}")
        pytest.skip(reason)
    return found


# A bound on a hang, not a time to beat: a first start builds the training image as root
# before the worker starts, and a test killed by the bound leaves the service running.
@pytest.mark.timeout(1800)
def test_make_service_a_run_from_the_form_its_links_and_its_model(
    chromium: str, horovodrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a fresh state: `make service`; a run started from the UI form in a browser that
    reaches nothing but this machine, after the UI's login; its pictures, links and Data Docs
    opened there through the gateway's sign-in; its model labelling a folder of new images;
    Ctrl-C during a second run: that run cancelled, its pool released, no process of the
    service left."""
    from azure.storage.blob import ContainerClient

    from backends.blob import upload_directory
    from backends.local.azurite import connection_string
    from imagedata.make_images import write_digits
    from scripts.ui_screenshots import DevTools

    # Below /tmp, not pytest's own folder (0700): PostgreSQL runs as the postgres user.
    base = Path(tempfile.mkdtemp(prefix="retrain-service-", dir="/tmp"))
    base.chmod(0o755)
    ports = [free_port() for _ in range(5)]
    azurite_port, prefect_port, relay_port, gateway_port, mlflow_port = ports
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["output"]["links_url"] = f"http://127.0.0.1:{gateway_port}"
    # Its MLflow server where the config tracks runs, and its alerts to a webhook here.
    mlflow_uri = f"http://127.0.0.1:{mlflow_port}"
    config["tracking"] = {"mlflow_uri": mlflow_uri}
    config["alerts"] = {"notify_block": "custom-webhook/service-alerts"}
    receiving = contextlib.ExitStack()
    hook = receiving.enter_context(webhook_receiver())
    # Tiny training: a tenth of the digits, in a container of its own on the service's Azurite.
    config["data"].update(container="e2e-digits", prefix="v1")
    config.update(work_dir=str(base / "work"))
    config["share"]["local_dir"] = str(base / "share")
    config["nfs"]["local_dir"] = str(base / "nfs")
    config["pool"].update(id=f"e2e-{uuid.uuid4().hex[:8]}", processes_per_node=1)
    config["training"].update(timeline=False)
    # One epoch is near chance: no floor, or whether the run promotes (and alerts) is chance.
    config["promotion"]["minimum"] = {"class_recall": None}
    config_path = base / "service.yaml"
    config_path.write_text(yaml.safe_dump(config))
    args = (
        f"--config {config_path} --state {base / 'state'} --azurite-port {azurite_port} "
        f"--prefect-port {prefect_port} --relay-port {relay_port}"
    )
    make = subprocess.Popen(
        ["make", "--no-print-directory", "service", f"SERVICE_ARGS={args}"],
        cwd=ROOT,
        env={**child_env(), "RETRAIN_ALERTS_WEBHOOK_URL": hook.url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a terminal of its own: Ctrl-C goes to its process group
    )
    ui = f"http://127.0.0.1:{prefect_port}"
    api = f"{ui}/api"
    began = time.monotonic()

    def mark(what: str) -> None:  # where the time goes, in the output of a failed run
        print(f"{time.monotonic() - began:6.1f}s  {what}", flush=True)

    service: list[psutil.Process] = []
    profile = base / "chromium"
    browser: DevTools | None = None
    root = os.geteuid() == 0  # then the worker runs as an account of its own
    try:
        # A first start builds the training image as root (the runs' account cannot).
        lines = lines_until(make, "the service is running", seconds=1200)
        status = {
            line.split()[0]: line for line in lines if line.split()[1:2] in (["ready"], ["done"])
        }
        assert list(status) == [
            *(["account"] if root else []),
            "azurite",
            "postgres",
            "prefect",
            "mlflow",
            "pool",
            "deploy",
            *(["image"] if root else []),
            "worker",
            "relay",
            "gateway",
        ], "\n".join(lines)
        assert "on PostgreSQL" in status["prefect"]
        assert "alerts on: crashed, failed, promoted runs told to custom-webhook" in status["pool"]
        # Every API asks for the credentials the service generated into its state folder.
        secrets = base / "state" / "credentials"
        _AUTH[api] = (secrets / "prefect").read_text().strip()
        gateway_auth = (secrets / "gateway").read_text().strip()
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", (secrets / "mlflow").read_text().strip())
        storage_key = (secrets / "storage-key").read_text().strip()
        assert f"{mlflow_uri}, runs in PostgreSQL, artifacts in" in status["mlflow"]
        assert f"127.0.0.1:{relay_port}" in status["relay"]
        service = process_tree(make.pid)
        mark("the service is running")
        small = base / "digits"
        write_digits(small, test_fraction=0.25, seed=0, per_class=12)
        data = ContainerClient.from_connection_string(
            connection_string(azurite_port, storage_key), "e2e-digits"
        )
        data.create_container()
        upload_directory(data, small, "v1")

        # The run form, in the browser: only epochs is filled in.
        deployment = _api(api, "deployments/name/retrain/manual")
        profile.mkdir()
        browser = DevTools(chromium, profile, offline=True)
        # The UI's login asks for the API's auth string; the gateway's sign-in (basic auth,
        # once per browser) is given with its address, as a person types it when asked.
        login = "!!document.querySelector('input[type=password]')"
        browser.navigate(ui)
        try:
            browser.wait_for(login, "the UI's login", seconds=90)
        except TimeoutError as exc:  # as a person would: a page that never rendered, reloaded
            mark(f"reloading the UI: {exc}")
            browser.navigate(ui)
            browser.wait_for(login, "the UI's login")
        browser.type_into("input[type=password]", _AUTH[api])
        browser.click("Login")
        browser.wait_for("!document.querySelector('input[type=password]')", "the UI after login")
        browser.navigate(f"http://{gateway_auth}@127.0.0.1:{gateway_port}/")
        browser.navigate(f"{ui}/deployments/deployment/{deployment['id']}/run", height=2400)
        browser.wait_for("!!document.querySelector('input[type=number]')", "the run form")
        form_text = browser.evaluate("document.body.innerText")
        assert 'Property is type "None"' in form_text  # the advanced config's toggle only
        assert form_text.count('Property is type "None"') == 1, form_text
        browser.type_into("input[type=number]", "1")
        browser.click("Submit")
        run = _wait(
            "the run the form started",
            lambda: _api(
                api,
                "flow_runs/filter",
                {"deployments": {"id": {"any_": [deployment["id"]]}}, "limit": 1},
            ),
            60,
        )[0]
        # An untouched field is left out (the flow's default applies), not sent as null.
        assert {k: v for k, v in run["parameters"].items() if v is not None} == {
            "config_path": str(config_path),
            "epochs": 1,
            "force": False,
        }, run["parameters"]
        assert set(run["parameters"]) <= {"config_path", "epochs", "force", "config"}
        mark("the form started a run")

        final = _wait(
            "the run to finish",
            lambda: (
                (r := _api(api, f"flow_runs/{run['id']}"))["state"]["type"]
                in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
                and r
            ),
            420,
        )
        assert final["state"]["type"] == "COMPLETED", final["state"]
        mark("the run completed")
        artifacts = {
            a["key"]: a
            for a in _api(
                api, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
            )
        }
        assert {"chart-curves", "chart-confusion", "retrain-summary", "outputs"} <= set(artifacts)

        # Tracked in the service's MLflow server, registered, and the champion alias on it
        # (the first run of the data root is its champion); one notification says so.
        from mlflow import MlflowClient

        tracking = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
        experiment = tracking.get_experiment_by_name("retrain")
        (tracked,) = tracking.search_runs([experiment.experiment_id])
        assert tracked.info.status == "FINISHED"
        assert tracked.data.tags["prefect.flow_run_id"] == run["id"]
        (model,) = tracking.search_registered_models()
        assert tracking.get_model_version_by_alias(model.name, "champion").run_id == (
            tracked.info.run_id
        )
        assert (
            f"]({mlflow_uri}/#/experiments/{experiment.experiment_id}/runs/"
            in (artifacts["retrain-summary"]["data"])
        )
        (promoted,) = hook.wait_for(1)
        assert promoted["subject"] == "retrain: a new champion for e2e-digits/v1"
        assert run["name"] in promoted["body"]
        mark("tracked in MLflow, the promotion notified")

        # The Artifacts tab lists the pictures; each opens as an image the gateway serves.
        browser.navigate(f"{ui}/runs/flow-run/{run['id']}")
        browser.wait_for("document.body.innerText.includes('Artifacts')", "the run page")
        browser.click("Artifacts")
        tab = browser.wait_for(
            "document.body.innerText.includes('chart-confusion') && document.body.innerText",
            "the artifacts tab",
        )
        assert "chart-curves" in tab and "IMAGE" in tab.upper()
        browser.navigate(f"{ui}/artifacts/artifact/{artifacts['chart-confusion']['id']}")
        browser.wait_for(
            "[...document.images].some(i => i.src.includes('/charts/confusion.png')"
            " && i.complete && i.naturalWidth > 0)",
            "the confusion matrix from the gateway",
        )
        # A link's description shows its download command as typed.
        browser.navigate(f"{ui}/artifacts/artifact/{artifacts['output-model-pt']['id']}")
        text = browser.wait_for(
            "document.body.innerText.includes('download --run') && document.body.innerText",
            "the model link's description",
        )
        assert "python -m cli.models --config <the config> download --run" in text

        # The run's outputs folder opens through the gateway, and so do its Data Docs, whole,
        # with their own styles and scripts (no CDN resolves in this browser).
        folder = artifacts["outputs"]["data"].rsplit("](", 1)[-1].rstrip(")")
        assert folder.startswith(f"http://127.0.0.1:{gateway_port}/")
        browser.navigate(folder)
        assert "model.pt" in browser.evaluate("document.body.innerText")
        browser.navigate(f"{folder}data_docs/index.html")
        browser.wait_for(
            "document.body.innerText.includes('Showing 1 to')", "the Data Docs' table", 30
        )
        assert (
            browser.evaluate(
                "getComputedStyle(document.querySelector('.navbar') || document.body).display"
            )
            != "inline"
        )
        model = base / "model.pt"
        signed = urllib.request.Request(
            f"{folder}model.pt",
            headers={"Authorization": f"Basic {base64.b64encode(gateway_auth.encode()).decode()}"},
        )
        with urllib.request.urlopen(signed, timeout=60) as response:
            assert response.headers["Content-Type"] == "application/octet-stream"
            model.write_bytes(response.read())
            mark("links, pictures and Data Docs opened")

        # The model labels a folder of new, unlabelled images; a damaged one is named.
        new = base / "new-images"
        new.mkdir()
        digits = sorted((base / "state" / "digits" / "test").glob("*/*.png"))[::40]  # unseen
        for i, image in enumerate(digits):
            shutil.copyfile(image, new / f"img{i:03d}.png")
        (new / "damaged.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
        proc = subprocess.run(
            [sys.executable, "-m", "training.predict", "--model", str(model), "--dir", str(new)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        rows = proc.stdout.strip().splitlines()
        assert len(rows) == 1 + len(digits) and rows[0].startswith('"image","label_1",')
        assert f"skipped {new / 'damaged.png'}: unreadable image" in proc.stderr
        mark("new images labelled")

        # A run that fails (a data version the root does not have): one notification,
        # naming the run and the step it failed in.
        failing = _api(
            api,
            f"deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"data_version": "v9"}},
        )
        notices = hook.wait_for(2, seconds=300)
        assert notices[1]["subject"] == f"retrain run {failing['name']} failed in validate-data"
        assert f"/runs/flow-run/{failing['id']}" in notices[1]["body"]
        mark("the failed run notified")

        # A long run in progress when Ctrl-C comes: cancelled, its pool released.
        _api(
            api,
            f"deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"epochs": 200, "force": True}},
        )
        running = base / "work" / "pools" / config["pool"]["id"] / "running"
        _wait("the second run's training", lambda: list(running.glob("train-*.pid")), 300)
        mark("a second run is training")
    finally:
        if browser is not None:
            browser.close()
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the terminal of `make service`
        rest, _ = make.communicate(timeout=300)
        mark("the service stopped")
        pool_state = base / "work" / "pools" / config["pool"]["id"] / "pool.json"
        if pool_state.exists():
            shutil.copyfile(pool_state, tmp_path / "pool.json")
        # Its account and the access it was given go with it (as root), then the folder.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deployments.service",
                "--state",
                str(base / "state"),
                "--clean",
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            timeout=300,
            check=False,
        )
        shutil.rmtree(base, ignore_errors=True)
        receiving.close()
    assert len(hook.received) == 2, hook.received  # the cancelled run tells no one
    pool_state = tmp_path / "pool.json"
    assert "the service is stopped" in rest, rest
    assert "worker      stopped (cancelled 1 run in progress)" in rest, rest
    assert json.loads(pool_state.read_text())["state"] == "released"
    for name in ("gateway", "relay", "worker", "mlflow", "prefect", "postgres", "azurite"):
        assert f"{name:<11} stopped" in rest, rest
    _AUTH.clear()
    alive = [p for p in service if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [p.cmdline() for p in alive]


@pytest.mark.usefixtures("prefect_api")
def test_runs_left_in_progress_are_marked_crashed_and_a_stop_cancels_them(tmp_path: Path) -> None:
    """Their processes are gone and each holds its deployment's only slot; unless another
    worker is online on the pool, when they may be its own. A worker of this service killed
    outright still looks online for 90 s: the next start knows it was its own."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelled, Pending, Running

    from deployments.service_runs import cancel_runs, crash_orphans, start_worker

    api = str(PREFECT_API_URL.value())
    pool = f"orphans-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow_from_name(f"orphaned-{pool}")
        deployment_id = client.create_deployment(flow_id, "d", work_pool_name=pool)
        runs = [client.create_flow_run_from_deployment(deployment_id) for _ in range(2)]
        for run in runs:
            client.set_flow_run_state(run.id, Running(), force=True)

        assert crash_orphans(api, pool) == "2 runs left by an earlier stop marked crashed"
        assert {client.read_flow_run(r.id).state.type.value for r in runs} == {"CRASHED"}

        # The service's worker (recorded in its state folder) runs a run of a deployment that
        # runs one at a time, and is killed: its heartbeat is recent, the run holds the slot.
        one = client.create_deployment(
            flow_id, "one-at-a-time", work_pool_name=pool, concurrency_limit=1
        )
        assert start_worker(api, tmp_path, "service-killed", pool) is None
        client.send_worker_heartbeat(pool, "service-killed")
        held = client.create_flow_run_from_deployment(one)
        assert client.set_flow_run_state(held.id, Pending()).status.value == "ACCEPT"
        client.set_flow_run_state(held.id, Running())
        waiting = client.create_flow_run_from_deployment(one)
        assert client.set_flow_run_state(waiting.id, Pending()).status.value != "ACCEPT"
        assert crash_orphans(api, pool) is None  # a worker of unknown origin is online
        # The service starts again: the killed worker's run is crashed, its slot given back.
        assert start_worker(api, tmp_path, "service-restarted", pool) == (
            "1 run left by an earlier stop marked crashed"
        )
        assert client.read_flow_run(held.id).state.type.value == "CRASHED"
        assert client.set_flow_run_state(waiting.id, Pending()).status.value == "ACCEPT"
        assert json.loads((tmp_path / "workers.json").read_text()) == [
            "service-killed",
            "service-restarted",
        ]
        client.set_flow_run_state(waiting.id, Cancelled(), force=True)
        report.record(
            "orchestrator",
            "the service's worker killed, its heartbeat recent, its run holding the only slot; "
            "the service started again",
            "the run marked crashed at the start; the waiting run got the slot",
            before_fix="nothing crashed (the dead worker counted as online for 90 s); the next "
            "run waited for the slot",
        )

        other = client.create_flow_run_from_deployment(deployment_id)
        client.set_flow_run_state(other.id, Running(), force=True)
        client.send_worker_heartbeat(pool, "a worker on another machine")
        assert crash_orphans(api, pool) is None
        assert client.read_flow_run(other.id).state.type.value == "RUNNING"

        # A stop (of the service, or of a worker's unit: --cancel-runs) asks for cancellation
        # and waits for the worker to act on it; here no worker runs it, so it is still going.
        assert cancel_runs(api, pool, seconds=2) == (
            "cancelled 1 run in progress, 1 still running after 2 s"
        )
        assert client.read_flow_run(other.id).state.type.value == "CANCELLING"


@pytest.mark.usefixtures("prefect_api")
def test_a_killed_worker_leaves_no_flow_run_and_the_restart_frees_its_slot(
    tmp_path: Path,
) -> None:
    """The service's worker, as make service starts it, killed outright (SIGKILL) while it runs
    a flow: the service's stop ends the flow run, which had left the worker's process tree;
    the next start finds the run crashed and its deployment's only slot free."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    from deployments.service import BIN
    from deployments.service_runs import start_worker
    from deployments.supervisor import Component, Supervisor

    api = str(PREFECT_API_URL.value())
    pool = f"killed-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow_from_name("long-flow")
        one = client.create_deployment(
            flow_id,
            "one-at-a-time",
            work_pool_name=pool,
            concurrency_limit=1,
            entrypoint="tests/deployments/long_flow.py:long_flow",
            pull_steps=[
                {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
            ],
        )
        supervisor = Supervisor(tmp_path / "logs", say=lambda line: None)

        def worker(name: str) -> Component:  # as deployments/service.py makes it
            env = {**child_env(), "PREFECT_API_URL": api, "PREFECT_WORKER_QUERY_SECONDS": "1"}
            return Component(
                "worker",
                [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--name", name],
                ready=lambda: any(
                    w.name == name and w.status.value == "ONLINE"
                    for w in client.read_workers_for_work_pool(pool)
                ),
                before=lambda: start_worker(api, tmp_path, name, pool),
                env=env,
                grace=10,
            )

        run = client.create_flow_run_from_deployment(one)
        flow_run: list[psutil.Process] = []
        try:
            supervisor.start(worker("service-first"))
            running = _wait(
                "the run to start",
                lambda: (
                    (r := client.read_flow_run(run.id)).state.type.value == "RUNNING"
                    and r.infrastructure_pid
                ),
                120,
            )
            main = psutil.Process(int(running))
            flow_run = [main, *main.children(recursive=True)]
            (started,) = supervisor.running
            started.proc.kill()  # the worker, killed outright (the OOM killer, kill -9)
            started.proc.wait()
            supervisor.stop()
            alive = [p for p in flow_run if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert alive == [], [p.cmdline() for p in alive]

            # The service starts again: the run is crashed, the slot goes to the next run.
            waiting = client.create_flow_run_from_deployment(one)
            supervisor.start(worker("service-second"))
            assert client.read_flow_run(run.id).state.type.value == "CRASHED"
            _wait(
                "the next run to get the slot",
                lambda: client.read_flow_run(waiting.id).state.type.value == "RUNNING",
                120,
            )
            report.record(
                "orchestrator",
                "the service's worker SIGKILLed while it runs a flow; the service stopped, then "
                "started again",
                "the stop ended the flow run (outside the worker's tree); the run crashed; the "
                "next run got the slot",
                before_fix="the flow run's engine process survived the stop",
            )
        finally:
            supervisor.stop()
            for p in flow_run:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
