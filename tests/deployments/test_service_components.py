"""What `make service` starts, read from its component list (nothing is started): each
component's port option reaches its command and its status line, and the Azurite line says
exactly what it uploads."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from deployments.postgres import Cluster
from deployments.service import DEMO_VERSION, Options, components, main
from deployments.supervisor import Component
from tests.conftest import ROOT, child_env
from tests.reliability import report


def _options(tmp_path: Path, config: str, **ports: int) -> Options:
    return Options(
        config,
        tmp_path / "state",
        ports.get("azurite", 10000),
        ports.get("prefect", 4200),
        "127.0.0.1",
        ports.get("relay", 8080),
        ports.get("gateway"),
    )


def _by_name(options: Options) -> dict[str, Component]:
    return {c.name: c for c in components(options)}


def test_each_port_option_reaches_its_component(tmp_path: Path) -> None:
    options = _options(
        tmp_path, "configs/local.yaml", azurite=10031, prefect=4231, relay=8031, gateway=4931
    )
    found = _by_name(options)
    for name, port in (("azurite", 10031), ("prefect", 4231), ("relay", 8031), ("gateway", 4931)):
        component = found[name]
        assert str(port) in component.command, (name, component.command)
        assert str(port) in component.where, (name, component.where)
    # Without the option the gateway listens where output.links_url says (loopback).
    default = _by_name(_options(tmp_path, "configs/local.yaml"))["gateway"]
    assert "4280" in default.where


def test_the_azurite_line_says_what_it_uploads_and_what_it_leaves(tmp_path: Path) -> None:
    shipped = _by_name(_options(tmp_path, "configs/local.yaml"))["azurite"]
    assert "the demo's digits uploaded to" in shipped.where
    assert "left as it is" not in shipped.where
    # A config of another data root: the demo's digits still go to the demo's root (the
    # command names no config), and the line says the config's root is left as it is.
    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["data"]["prefix"] = "textures"
    other = tmp_path / "textures.yaml"
    other.write_text(yaml.safe_dump(spec))
    azurite = _by_name(_options(tmp_path, str(other)))["azurite"]
    assert "--config" not in azurite.command
    assert "training-data/textures is left as it is" in azurite.where
    assert "the demo's digits uploaded to" in azurite.where


def test_the_azurite_line_names_the_version_demo_seeds(tmp_path: Path) -> None:
    from scripts.demo import SEED_VERSION

    assert SEED_VERSION == DEMO_VERSION
    shipped = _by_name(_options(tmp_path, "configs/local.yaml"))["azurite"]
    assert f"training-data/digits/{DEMO_VERSION} (data version {DEMO_VERSION} of" in shipped.where


def test_the_azurite_line_leaves_a_root_in_another_account_alone(tmp_path: Path) -> None:
    """Same container and prefix as the demo's, but read from an account of its own (no
    connection string: the service does not point it at Azurite): nothing lands there."""
    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["data"].update(
        connection_string_env=None, account_url="https://example.blob.core.windows.net"
    )
    other = tmp_path / "account.yaml"
    other.write_text(yaml.safe_dump(spec))
    azurite = _by_name(_options(tmp_path, str(other)))["azurite"]
    assert "training-data/digits in its own storage account is left as it is" in azurite.where


def test_the_gateway_line_says_where_the_runs_links_point(tmp_path: Path) -> None:
    """--gateway-port moves the gateway, not the links (output.links_url's): a line that
    called the new port the runs' links would send people where no link goes."""
    moved = _by_name(_options(tmp_path, "configs/local.yaml", gateway=4931))["gateway"]
    assert moved.where.startswith("http://127.0.0.1:4931/")
    assert "the runs' links point at output.links_url, http://127.0.0.1:4280" in moved.where
    same = _by_name(_options(tmp_path, "configs/local.yaml", gateway=4280))["gateway"]
    assert same.where.startswith("the runs' links: http://127.0.0.1:4280/; user retrain, its ")


def test_the_postgres_line_says_where_its_data_is(tmp_path: Path) -> None:
    """A private state folder (as a checkout under /root is): as root the data goes where
    the server's user can reach it, and the line names that folder, so removing the state
    folder is not taken for removing the database."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    options = _options(private, "configs/local.yaml")
    cluster = Cluster.at(options.state / "postgres")
    line = _by_name(options)["postgres"].where
    assert f"data and socket in {cluster.data_dir}, no port" in line
    if os.geteuid() == 0:
        assert not cluster.data_dir.is_relative_to(private)
        assert "the postgres user's own, mode 0700" in line


@pytest.mark.processes
def test_the_azurite_component_seeds_the_demos_root_alone(tmp_path: Path) -> None:
    """The service's Azurite command, as `make service --config` of another data root starts
    it: every blob it writes lies in the folder its status line names, and the config's own
    root stays empty."""
    from azure.storage.blob import BlobServiceClient

    from backends.local.azurite import connection_string
    from backends.local.ports import free_port
    from staging.blob import API_VERSION

    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["data"]["prefix"] = "textures"
    other = tmp_path / "textures.yaml"
    other.write_text(yaml.safe_dump(spec))
    port = free_port()
    azurite = _by_name(_options(tmp_path, str(other), azurite=port))["azurite"]
    proc = subprocess.Popen(
        azurite.command,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until it says it is serving (or exits)
            lines.append(line)
            if "Azurite is serving" in line:
                break
        assert any("Azurite is serving" in x for x in lines), "".join(lines)
        service = BlobServiceClient.from_connection_string(
            connection_string(port), api_version=API_VERSION
        )
        blobs = [
            f"{c.name}/{b.name}"
            for c in service.list_containers()
            for b in service.get_container_client(c.name).list_blobs()
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    seeded = f"training-data/digits/{DEMO_VERSION}/"
    assert f"uploaded to {seeded.rstrip('/')} " in azurite.where
    assert len(blobs) == 1797 + 1, len(blobs)  # the digits and the version's marker
    assert all(b.startswith(seeded) for b in blobs), [b for b in blobs if not b.startswith(seeded)]
    assert "training-data/textures is left as it is" in azurite.where


def test_mlflow_listens_where_the_config_tracks_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow has no port option: its address is tracking.mlflow_uri, the one the runs log to,
    so the config moves both (docs/service.md)."""
    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["tracking"]["mlflow_uri"] = "http://127.0.0.1:5931"
    moved = tmp_path / "mlflow.yaml"
    moved.write_text(yaml.safe_dump(spec))
    mlflow = _by_name(_options(tmp_path, str(moved)))["mlflow"]
    assert "5931" in mlflow.command and mlflow.where.startswith("http://127.0.0.1:5931,")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "tracking.mlflow_uri" in help_text and "--gateway-port" in help_text


def test_credentials_are_generated_once_into_files_of_the_owner_alone(tmp_path: Path) -> None:
    from deployments.credentials import Credentials

    state = tmp_path / "state"
    first = Credentials.of(state)
    assert Credentials.of(state) == first  # the same at every start
    values = [first.prefect, first.mlflow_password, first.mlflow_flask_key, first.gateway]
    assert len(set(values)) == 4 and all(len(v) >= 32 for v in values)
    assert first.gateway.startswith("retrain:")
    folder = state / "credentials"
    assert folder.stat().st_mode & 0o777 == 0o700
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_no_credential_on_a_command_line_and_each_only_where_it_is_checked(
    tmp_path: Path,
) -> None:
    """Command lines are world-readable (/proc/<pid>/cmdline): the credentials go through the
    environment; the server's auth string to the server alone; the worker, relay and gateway
    run as the given account, with its own home, and the gateway alone gets its password."""
    from deployments.account import Account
    from deployments.credentials import Credentials

    home = tmp_path / "home"
    account = Account("retrain-test", 54321, 54321, home)
    options = _options(tmp_path, "configs/local.yaml")
    found = {c.name: c for c in components(options, account)}
    creds = Credentials.of(options.state)
    secrets = [creds.prefect, creds.mlflow_password, creds.gateway, creds.storage_key]
    for component in found.values():
        assert not any(s in " ".join(component.command) for s in secrets), component.name
    assert found["prefect"].env is not None
    assert found["prefect"].env["PREFECT_SERVER_API_AUTH_STRING"] == creds.prefect
    assert found["azurite"].env is not None
    assert found["azurite"].env["AZURITE_ACCOUNTS"] == f"devstoreaccount1:{creds.storage_key}"
    for name in ("worker", "relay", "gateway"):
        component = found[name]
        assert component.popen["user"] == 54321 and component.popen["extra_groups"] == []
        assert component.env is not None and component.env["HOME"] == str(home)
        assert component.env["PREFECT_API_AUTH_STRING"] == creds.prefect
        assert "PREFECT_SERVER_API_AUTH_STRING" not in component.env
        assert ("RETRAIN_GATEWAY_AUTH_STRING" in component.env) == (name == "gateway")
    for name in ("azurite", "prefect", "mlflow", "pool", "deploy"):
        assert "user" not in found[name].popen, name  # as the service was started
    assert "retrain-test (uid 54321), not root" in found["worker"].where
    assert found["mlflow"].env is not None
    assert "basic-auth" in found["mlflow"].command
    assert Path(found["mlflow"].env["MLFLOW_AUTH_CONFIG_PATH"]).stat().st_mode & 0o777 == 0o600
    # Without an account (not root): every component as this user, as before.
    plain = {c.name: c for c in components(options)}
    assert all("user" not in c.popen for c in plain.values() if c.name != "postgres")


def test_the_pool_line_says_whether_alerts_are_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off by default, with the one line that turns them on; that line makes the webhook block
    of its own when the config names none."""
    from core.config import load_config
    from deployments.alerts import DEFAULT_BLOCK, WEBHOOK_URL_ENV, _wanted

    monkeypatch.delenv(WEBHOOK_URL_ENV, raising=False)
    off = _by_name(_options(tmp_path, "configs/local.yaml"))["pool"].where
    assert "alerts off (alerts.notify_block is unset in configs/local.yaml)" in off
    assert f"{WEBHOOK_URL_ENV}=<webhook URL> make service turns them on" in off
    monkeypatch.setenv(WEBHOOK_URL_ENV, "https://hooks.example.com/T0/B0/secret")
    on = _by_name(_options(tmp_path, "configs/local.yaml"))["pool"].where
    assert f"alerts on: crashed, failed, promoted runs told to {DEFAULT_BLOCK}" in on
    assert "secret" not in on
    config = load_config(ROOT / "configs" / "local.yaml")
    assert set(_wanted([config], "https://hooks.example.com/x")) == {DEFAULT_BLOCK}
    named = load_config(ROOT / "configs" / "local.yaml", ["alerts.notify_block=slack-webhook/ml"])
    assert set(_wanted([named], "https://hooks.example.com/x")) == {"slack-webhook/ml"}
    report.record(
        "orchestrator",
        "make service with the shipped config (no alerts.notify_block)",
        "its pool line says alerts are off and names the one line that turns them on",
        before_fix="nothing said; alerts silently off",
    )
