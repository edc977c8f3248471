"""Parameters, triggers and config loading under hostile or careless input.

A value reaches a typed field as it was given (no YAML guessing); the run form is not silently
replaced by the deployment's default file; bad files and overrides are named, exit 2, and never
have their content repeated in the error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.config import ConfigError, load_config
from core.run_config import RunRequest, build_run_config
from flows.retrain import main
from tests.conftest import ROOT, child_env, prefect_api_env
from tests.reliability import report

LOCAL = ROOT / "configs" / "local.yaml"
# What YAML made of each: a comment cut off, bytes decoded, an int, a date, a bool, None.
HOSTILE_PREFIXES = ["images/v1 #rollback", "!!binary aGk=", "2024", "2024-06-01", "true", "null"]
# The same as data version names: one folder name each.
HOSTILE_VERSIONS = ["v1 #rollback", "!!binary aGk=", "2024", "2024-06-01", "true", "null"]


@pytest.mark.parametrize("prefix", HOSTILE_PREFIXES)
def test_trigger_values_reach_their_fields_as_given(prefix: str) -> None:
    request = RunRequest(config_path=str(LOCAL), data_container="123456", data_prefix=prefix)
    config = build_run_config(request).config
    assert (config.data.container, config.data.prefix) == ("123456", prefix)
    report.record(
        "adversarial",
        f"new-data trigger: container 123456, prefix {prefix!r}",
        "trains on exactly that container and prefix",
    )


@pytest.mark.parametrize("version", HOSTILE_VERSIONS)
def test_trigger_versions_reach_their_field_as_given(version: str) -> None:
    request = RunRequest(
        config_path=str(LOCAL), data_container="123456", data_prefix="images", data_version=version
    )
    config = build_run_config(request).config
    assert (config.data.prefix, config.data.version) == ("images", version)
    assert config.data.dataset.prefix == f"images/{version}"
    report.record(
        "adversarial",
        f"new-data trigger: root images, data version {version!r}",
        "trains on exactly that version",
    )


def test_set_reads_string_fields_as_typed_and_others_as_yaml() -> None:
    cfg = load_config(
        LOCAL,
        [
            "data.prefix=2024-06-01",
            "data.container=123456",
            "share.name=true",
            "pool.id=0123",
            "work_dir=/tmp/a folder #1",
            "data.account_url=null",  # an optional field is cleared
            "training.extra_args=[--fp16-allreduce, 1, '#x', $(touch /tmp/x)]",
            "training.epochs=7",
            "training.timeline=false",
            "training.image_size=null",
            "training.lr=1e-2",
        ],
    )
    assert cfg.data.prefix == "2024-06-01" and cfg.data.container == "123456"
    assert cfg.share.name == "true" and cfg.pool.id == "0123"
    assert str(cfg.work_dir) == "/tmp/a folder #1" and cfg.data.account_url is None
    assert cfg.training.extra_args == ["--fp16-allreduce", "1", "#x", "$(touch /tmp/x)"]
    assert cfg.training.epochs == 7 and cfg.training.timeline is False
    assert cfg.training.image_size is None and cfg.training.lr == 0.01
    report.record(
        "adversarial",
        "--set on string fields: 2024-06-01, 123456, true, 0123, 'a folder #1'",
        "kept as typed; numbers, booleans, lists and null still parsed",
    )


def test_run_form_wins_over_the_default_path_and_a_chosen_path_conflicts() -> None:
    form = load_config(LOCAL, ["training.epochs=1"]).model_dump(mode="json")
    default = "configs/local.yaml"
    chosen = build_run_config(RunRequest(config=form, config_path=default), deployment_path=default)
    assert chosen.config.training.epochs == 1
    assert "default config_path configs/local.yaml is not used" in chosen.source
    from_file = build_run_config(RunRequest(config_path=default), deployment_path=default)
    assert from_file.config.training.epochs is None  # left to be fitted to the data
    with pytest.raises(ConfigError, match="both a config and config_path"):
        build_run_config(
            RunRequest(config=form, config_path="configs/azure.example.yaml"),
            deployment_path=default,
        )
    with pytest.raises(ConfigError, match="both a config and config_path"):
        # outside a deployment
        build_run_config(RunRequest(config=form, config_path=default))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.epochs=[unclosed", "--set training.epochs=[unclosed: the value is not valid"),
        ("training.extra_args=[a, 'b", "--set training.extra_args=[a, 'b: the value is not"),
        ("training.batch_size={x: [1}", "--set training.batch_size={x: [1}: the value is not"),
        ("training..epochs=1", "expected section.field=value"),
        ("training.batch_size.x=1", "batch_size is not a section"),
    ],
)
def test_set_errors_name_the_override(
    override: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(LOCAL), "--set", override]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and str(LOCAL) not in err
    report.record("adversarial", f"--set {override!r}", "exit 2, names the --set")


def _hostile_files(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (file, secret inside it, what the error must say)."""
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    env = tmp / ".env"
    env.write_text(f"API_TOKEN={secret}\nDB_URL=postgres://u:{secret}@db/x\n")
    shadow = tmp / "shadow"
    shadow.write_text(f"root:$6${secret}$x:19000:0:99999:7:::\nbin:*:19000:0:99999:7:::\n")
    mapping = tmp / "credentials.yaml"
    mapping.write_text(f"password: {secret}\n{secret}: 1\n")
    broken = tmp / "broken.yaml"
    broken.write_text(f"data: [unclosed\npassword: {secret}\n")
    binary = tmp / "model.bin"
    binary.write_bytes(b"\x80\x81\xfe\xff" + secret.encode() + bytes(range(256)))
    folder = tmp / "configs-folder"
    folder.mkdir()
    big = tmp / "huge.yaml"
    big.write_text("# " + secret + "x" * (1 << 21))
    return {
        ".env file": (env, secret, "must hold a mapping of sections"),
        "shadow-like file": (shadow, secret, "a key that is not a field name"),
        "YAML credentials": (mapping, secret, "password: Extra inputs are not permitted"),
        "broken YAML with a secret": (broken, secret, "is not valid YAML (line 2, column 9)"),
        "binary file": (binary, secret, "is not a UTF-8 text file"),
        "folder": (folder, secret, "is a folder, not a YAML file"),
        "2 MiB file": (big, secret, "is larger than"),
        "character device": (Path("/dev/zero"), secret, "is not a regular file"),
    }


def test_config_files_that_are_not_configs_are_named_without_their_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for case, (path, secret, expected) in _hostile_files(tmp_path).items():
        assert main(["--config", str(path)]) == 2, case
        err = capsys.readouterr().err
        assert expected in err, (case, err)
        assert secret not in err and "Traceback" not in err, case
        report.record("adversarial", f"--config pointing at a {case}", f"exit 2: {expected}")


@pytest.mark.processes
def test_cli_exits_2_before_anything_is_written(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.retrain",
            "--config",
            str(tmp_path),
            "--set",
            f"work_dir={work}",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "is a folder" in proc.stderr
    assert "Traceback" not in proc.stderr and not work.exists()


def test_trigger_values_through_the_relay_and_the_deployment_trigger(
    deployed: dict[str, Any],
) -> None:
    """The new-data trigger's real path: marker blob -> relay -> event -> the server's
    automation -> flow run parameters -> the config the flow builds from them."""
    from starlette.testclient import TestClient

    from core.data_versions import DataRoot
    from servers.relay import RelaySettings, create_app
    from tests.deployments.test_deployments import _runs_for, _wait_for_runs

    container, tag = "123456", uuid.uuid4().hex[:8]
    settings = RelaySettings(watches=[DataRoot(container, "images")], shared_secret="k")
    client = TestClient(create_app(settings))
    events = [
        {
            "id": str(uuid.uuid4()),
            "eventType": "Microsoft.Storage.BlobCreated",
            "subject": f"/blobServices/default/containers/{container}/blobs/images/{v}/_SUCCESS",
            "data": {"eTag": f"0x{tag}{i}"},
        }
        for i, v in enumerate(HOSTILE_VERSIONS)
    ]
    before = {r.id for r in _runs_for(deployed["retrain/on-new-data"].id, container)}
    reply = client.post("/events", params={"key": "k"}, json=events)
    assert reply.json()["outcomes"] == ["started"] * len(HOSTILE_VERSIONS)
    runs = _wait_for_runs(
        deployed["retrain/on-new-data"].id, container, len(before) + len(HOSTILE_VERSIONS)
    )
    mine = [r for r in runs if r.id not in before]
    built = {
        build_run_config(RunRequest.from_parameters(r.parameters)).config.data.dataset.prefix
        for r in mine
    }
    assert built == {f"images/{v}" for v in HOSTILE_VERSIONS}


def _wait(what: str, check: Any, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


@pytest.mark.usefixtures("horovodrun")
def test_deployment_run_from_the_form_trains_with_the_form_values(
    deployed: dict[str, Any], azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A UI run of retrain/manual: the form's config (1 epoch) and the deployment's default
    config_path (its config file: 4 epochs). The form wins, the summary says so; a path
    chosen for the run together with a form fails at once, naming both; a form that changes
    more than training and data (here the output container) fails at once, naming it."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from imagedata.make_images import write_digits
    from tests.pipeline_helpers import (
        deployment_defaults,
        make_config,
        process_worker,
        seed,
        task_runs_and_artifacts,
    )

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)  # the worker has it too
    config = make_config(tmp_path, "training.epochs=4")
    config_file = tmp_path / "deployment.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=20)
    seed(config, source)
    form = load_config(config_file, ["training.epochs=1"]).model_dump(mode="json")
    elsewhere = {**form, "output": {**form["output"], "container": "another-pipelines"}}

    env = {**child_env(), **prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}

    async def final_state(run_id: Any) -> Any:
        async with get_client() as client:
            state = (await client.read_flow_run(run_id)).state
        return state if state and state.is_final() else None

    # A run another test left scheduled (as the relay's are): the worker polls its own queue.
    stray = run_deployment("retrain/on-new-data", timeout=0)
    with (
        process_worker(env) as queue,
        deployment_defaults(deployed, {"config_path": str(config_file)}),
    ):
        run = run_deployment(
            "retrain/manual", parameters={"config": form}, timeout=0, work_queue_name=queue
        )
        conflict = run_deployment(
            "retrain/manual",
            parameters={"config": form, "config_path": "configs/azure.example.yaml"},
            timeout=0,
            work_queue_name=queue,
        )
        moved = run_deployment(
            "retrain/manual", parameters={"config": elsewhere}, timeout=0, work_queue_name=queue
        )
        state = _wait("the form run", lambda: asyncio.run(final_state(run.id)), 600)
        refused = _wait("the conflicting run", lambda: asyncio.run(final_state(conflict.id)), 300)
        outside = _wait("the moving run", lambda: asyncio.run(final_state(moved.id)), 300)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(stray.id).state_type.value == "SCHEDULED"

    assert run.parameters["config_path"] == str(config_file)  # the default, merged in
    assert state.is_completed(), state.message
    _, artifacts = task_runs_and_artifacts(run.id)
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    shown = yaml.safe_load(summary.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert shown["training"]["epochs"] == 1 and shown["data"] == form["data"]
    assert f"the deployment's default config_path {config_file} is not used" in summary
    epochs = summary.split("## Epochs", 1)[1].split("\n\n", 2)[1]
    assert len([line for line in epochs.splitlines() if line.startswith("| 1 |")]) == 1
    assert "| 2 |" not in epochs

    assert refused.is_failed() and "both a config and config_path" in str(refused.message)
    assert outside.is_failed() and "it changed output.container" in str(outside.message)
    report.record(
        "adversarial",
        "deployment run: form config (1 epoch) + default config_path (4 epochs)",
        "trains 1 epoch; the summary shows the form's config and that the default was unused",
    )
    report.record(
        "adversarial",
        "deployment run: form config + a chosen config_path",
        "fails at once, naming both",
    )
    report.record(
        "secrets",
        "deployment run: form config with another output.container",
        "fails at once, naming the field (the deployment's config file decides it)",
    )
