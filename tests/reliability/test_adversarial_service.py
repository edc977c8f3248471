"""`make service` as root, seen from another local user (uid 65534, as `nobody` or any account
on a shared VM is): before, that user read the alert webhook's secret through the Prefect API,
created a deployment whose pull step ran a shell command as root, moved MLflow's registry and
wrote blobs with Azurite's published key. One service start is shared by every probe here."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from backends.local.ports import free_port
from tests.conftest import ROOT, child_env
from tests.deployments.test_supervisor import lines_until
from tests.reliability import report

pytestmark = pytest.mark.processes
OTHER_UID = 65534  # nobody: holds no file of the service's and no credential
SYSTEM_PYTHON = "/usr/bin/python3"  # the attacker's own tools: the standard library only


@dataclass
class Service:
    proc: subprocess.Popen[str]
    base: Path
    state: Path
    config: Path
    ports: dict[str, int]
    lines: list[str]

    def secret(self, name: str) -> str:
        return (self.state / "credentials" / name).read_text().strip()

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['prefect']}/api"

    def processes(self) -> list[psutil.Process]:
        main = psutil.Process(self.proc.pid)
        return [main, *main.children(recursive=True)]


def _as_other_user(script: str, *args: str) -> Any:
    """``script`` run by the system Python as uid 65534 with no groups; what it prints, as
    JSON."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("these probes need root and setpriv (util-linux) to act as another user")
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={OTHER_UID}",
            f"--regid={OTHER_UID}",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-c",
            script,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    """The service as root would start it from a private folder (mode 0700: PostgreSQL's data
    goes below the postgres user's home), with MLflow and the gateway; no image (not what is
    probed here). Stopped, then removed with --clean, at the end."""
    if os.geteuid() != 0:
        pytest.fail("the service's account probes need root: the service changes account as root")
    base = Path(tempfile.mkdtemp(prefix="retrain-probe-", dir="/tmp"))  # 0700, root's
    ports = {k: free_port() for k in ("azurite", "prefect", "relay", "gateway", "mlflow")}
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["output"]["links_url"] = f"http://127.0.0.1:{ports['gateway']}"
    config["tracking"] = {"mlflow_uri": f"http://127.0.0.1:{ports['mlflow']}"}
    config["image"]["builder"] = "none"
    config.update(work_dir=str(base / "work"))
    config["share"]["local_dir"] = str(base / "share")
    config["nfs"]["local_dir"] = str(base / "nfs")
    config["pool"].update(id=f"probe-{uuid.uuid4().hex[:8]}")
    config_path = base / "service.yaml"
    config_path.write_text(yaml.safe_dump(config))
    state = base / "state"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deployments.service",
            "--config",
            str(config_path),
            "--state",
            str(state),
            "--azurite-port",
            str(ports["azurite"]),
            "--prefect-port",
            str(ports["prefect"]),
            "--relay-port",
            str(ports["relay"]),
        ],
        cwd=ROOT,
        env={k: v for k, v in child_env().items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = lines_until(proc, "the service is running", seconds=600)
        yield Service(proc, base, state, config_path, ports, lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=300)
        subprocess.run(
            [sys.executable, "-m", "deployments.service", "--state", str(state), "--clean"],
            cwd=ROOT,
            env=child_env(),
            timeout=120,
            check=False,
        )
        shutil.rmtree(base, ignore_errors=True)


_CALLS = r"""
import json, sys, urllib.error, urllib.request, uuid
prefect, mlflow, gateway = sys.argv[1:4]
def status(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
print(json.dumps({
    "prefect: read blocks with their secrets": status(
        "POST", prefect + "/block_documents/filter?include_secrets=true", {}),
    "prefect: create a deployment": status(
        "POST", prefect + "/deployments/", {"name": "x", "flow_id": str(uuid.uuid4())}),
    "prefect: list flow runs": status("POST", prefect + "/flow_runs/filter", {}),
    "prefect: send an event": status("POST", prefect + "/events", []),
    "mlflow: search registered models": status(
        "GET", mlflow + "/api/2.0/mlflow/registered-models/search"),
    "mlflow: create an experiment": status(
        "POST", mlflow + "/api/2.0/mlflow/experiments/create", {"name": "x"}),
    "gateway: list the outputs": status("GET", gateway + "/"),
}))
"""


def test_another_user_gets_401_from_every_api_of_the_service(service: Service) -> None:
    """Before: 200 for every call (the webhook's URL with its token came back in clear)."""
    got = _as_other_user(
        _CALLS,
        service.api,
        f"http://127.0.0.1:{service.ports['mlflow']}",
        f"http://127.0.0.1:{service.ports['gateway']}",
    )
    assert got == {call: 401 for call in got}, got
    assert len(got) == 7
    # The service's own clients, with its credentials, are answered.
    from scripts.ui_screenshots import api

    runs = api(service.api, "flow_runs/filter", {"limit": 1}, auth=service.secret("prefect"))
    assert isinstance(runs, list)  # the scheduled runs of its deployments, or none yet
    report.record(
        "secrets",
        "another local user (uid 65534) calls the service's Prefect API (blocks with their "
        "secrets, a new deployment, events), its MLflow and its outputs gateway",
        "401 for every call, the service's own clients answered",
        before_fix="200: the alert webhook's URL and token read, a deployment created",
    )


def test_the_published_azurite_key_opens_nothing(service: Service) -> None:
    """Before: anyone on the machine wrote every blob with the emulator's well-known key."""
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
    from azure.storage.blob import BlobServiceClient

    from backends.local.azurite import DEV_KEY, connection_string
    from staging.blob import API_VERSION

    port = service.ports["azurite"]
    published = BlobServiceClient.from_connection_string(
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={DEV_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;",
        api_version=API_VERSION,
    )
    with pytest.raises((ClientAuthenticationError, HttpResponseError)) as refused:
        published.get_container_client("training-data").upload_blob("planted.txt", b"x")
    assert refused.value.status_code == 403
    own = BlobServiceClient.from_connection_string(
        connection_string(port, service.secret("storage-key")),
        api_version=API_VERSION,
    )
    assert own.get_container_client("training-data").exists()
    report.record(
        "secrets",
        "a blob written to the service's Azurite with the emulator's published key",
        "403; the service's own key (generated, 0600) works",
        before_fix="written",
    )


_READS = r"""
import json, os, sys
state, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError as exc:
        return type(exc).__name__
files = {name: read(os.path.join(state, "credentials", name))
         for name in ("prefect", "mlflow", "gateway", "storage-key", "mlflow-auth.ini")}
files["client.env"] = read(os.path.join(state, "client.env"))
files["relay-secret"] = read(os.path.join(state, "relay-secret"))
try:
    files["azurite data"] = str(os.listdir(os.path.join(state, "azurite")))
except OSError as exc:
    files["azurite data"] = type(exc).__name__
print(json.dumps({
    "files": files,
    "cmdlines": {p: read(f"/proc/{p}/cmdline") for p in pids},
    "environs": {p: read(f"/proc/{p}/environ") for p in pids},
}))
"""


def test_no_credential_in_reach_of_another_user(service: Service) -> None:
    """Not in the state's files, not on any process's command line (world-readable in /proc),
    not in any process's environment (no process of the service runs as that user)."""
    processes = service.processes()
    got = _as_other_user(_READS, str(service.state), *(str(p.pid) for p in processes))
    secrets = [service.secret(n) for n in ("prefect", "mlflow", "gateway", "storage-key")]
    assert set(got["files"].values()) == {"PermissionError"}, got["files"]
    assert set(got["environs"].values()) == {"PermissionError"}, got["environs"]
    cmdlines = [c for c in got["cmdlines"].values() if c != "PermissionError"]
    assert len(cmdlines) >= 8, got["cmdlines"]  # the service's processes are all seen
    leaked = [c for c in cmdlines if any(s in c or s.split(":")[-1] in c for s in secrets)]
    assert leaked == []
    assert not any(any(s in line for s in secrets) for line in service.lines)  # status lines
    logs = "".join(p.read_text(errors="replace") for p in (service.state / "logs").iterdir())
    assert not any(s in logs for s in secrets)
    report.record(
        "secrets",
        f"another user reads the service's state and /proc of its {len(processes)} processes",
        "credentials, client settings, Azurite's data: permission denied; command lines "
        "without a credential; environments unreadable",
        processes=len(processes),
    )


def test_a_deployment_runs_as_the_service_account_never_root(service: Service) -> None:
    """With the API's credential (what the attacker lacked: they got 401 above), a deployment
    whose pull step runs a shell command: the command and the flow run run as the service's
    account. Before: `uid=0(root)`."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from deployments.setup import WORK_POOL

    record = json.loads((service.state / "account.json").read_text())
    account = pwd.getpwnam(record["name"])
    assert account.pw_uid != 0
    out = Path(tempfile.mkdtemp(prefix="retrain-whoami-", dir="/tmp"))
    out.chmod(0o777)  # a folder the account may write, as the attacker's would be
    pulled, ran = out / "pull-step-uid", out / "flow-run-uid"
    settings = {PREFECT_API_URL: service.api, PREFECT_API_AUTH_STRING: service.secret("prefect")}
    try:
        with temporary_settings(updates=settings), get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("whoami")
            deployment = client.create_deployment(
                flow_id,
                "probe",
                work_pool_name=WORK_POOL,
                entrypoint="tests/reliability/whoami_flow.py:whoami",
                pull_steps=[
                    {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}},
                    {
                        "prefect.deployments.steps.run_shell_script": {
                            "script": f"sh -c 'id -u > {pulled}'"
                        }
                    },
                ],
            )
            run = client.create_flow_run_from_deployment(deployment, parameters={"out": str(ran)})
            deadline = time.monotonic() + 300
            while (state := client.read_flow_run(run.id).state) is None or not state.is_final():
                assert time.monotonic() < deadline, state
                time.sleep(2)
        assert state.is_completed(), state
        assert pulled.read_text().strip() == str(account.pw_uid)
        assert ran.read_text().strip() == str(account.pw_uid)
        assert ran.stat().st_uid == account.pw_uid
    finally:
        shutil.rmtree(out, ignore_errors=True)
    report.record(
        "secrets",
        "a deployment on retrain-workers whose pull step runs `id -u` (made with the API's "
        "credential)",
        f"the pull step and the flow run ran as {record['name']} (uid {account.pw_uid})",
        before_fix="uid 0: root",
    )


def test_a_second_service_on_a_taken_port_is_refused_by_name(service: Service) -> None:
    """Another checkout's service on the same ports (the defaults, for both): refused,
    naming the running service, never started beside it or reusing its servers."""
    other = service.base / "other-state"
    args = [
        sys.executable,
        "-m",
        "deployments.service",
        "--config",
        str(service.config),
        "--state",
        str(other),
        "--azurite-port",
        str(service.ports["azurite"]),
        "--prefect-port",
        str(service.ports["prefect"]),
        "--relay-port",
        str(service.ports["relay"]),
    ]
    try:
        done = subprocess.run(
            args, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
        )
    finally:
        subprocess.run([*args[:3], "--state", str(other), "--clean"], cwd=ROOT, timeout=120)
    assert done.returncode == 1, done.stdout
    port = service.ports["azurite"]
    assert f"azurite: 127.0.0.1:{port} is already in use by the service of {service.state}" in (
        done.stdout
    ), done.stdout
    assert "it is not reused" in done.stdout
    report.record(
        "orchestrator",
        "a second service started on the ports of a running one",
        "refused before anything starts, naming the running service's state folder",
        before_fix="refused as 'another azurite?', naming nothing",
    )


def test_another_checkouts_demo_leaves_the_services_mlflow_alone(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo of another checkout finds an MLflow answering on its config's address (this
    service's): before, it tracked its run there; now it is refused by name and not used."""
    from scripts.demo import _not_tracked

    url = f"http://127.0.0.1:{service.ports['mlflow']}"
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    said = _not_tracked(url)
    assert said is not None and f"the MLflow server at {url} refuses this checkout (401" in said
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", service.secret("mlflow"))
    assert _not_tracked(url) is None  # this checkout's own service: tracked
    report.record(
        "orchestrator",
        "another checkout's demo, its MLflow address taken by this service",
        "not tracked there, the server named; with the service's credential it tracks",
        before_fix="tracked into this service's MLflow",
    )


def test_clean_removes_the_service_and_what_lies_outside_its_state(service: Service) -> None:
    """Last: the service stopped, then `--clean`: its PostgreSQL data below the postgres
    user's home (the state folder is private) with its owner record, its account and every
    ACL entry given to it go; a new state folder at the same path starts from nothing."""
    from deployments.postgres import Cluster

    cluster = Cluster.at(service.state / "postgres")
    assert cluster.in_home and (cluster.data_dir / "PG_VERSION").exists()
    owner = json.loads(cluster.owner_file.read_text())
    assert owner["state"] == str(service.state)
    name = json.loads((service.state / "account.json").read_text())["name"]
    os.killpg(service.proc.pid, signal.SIGINT)
    rest, _ = service.proc.communicate(timeout=300)
    assert "the service is stopped" in rest
    done = subprocess.run(
        [sys.executable, "-m", "deployments.service", "--state", str(service.state), "--clean"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"PostgreSQL data folder {cluster.data_dir} removed" in done.stdout
    assert f"account {name} removed" in done.stdout
    assert not cluster.data_dir.exists() and not cluster.owner_file.exists()
    assert not service.state.exists()
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
    acl = subprocess.run(
        ["getfacl", "-p", str(service.base)], capture_output=True, text=True, check=True
    ).stdout
    assert name not in acl
    report.record(
        "orchestrator",
        "the service's clean-up (--clean) of a service started as root from a private folder",
        "its PostgreSQL data below ~postgres and its owner record, its account and the ACL "
        "entries given to it removed with the state folder",
    )
