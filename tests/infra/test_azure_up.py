"""`make azure-up` / `make azure-down` end to end against the fake ARM endpoint: the real
azure-mgmt-resource and azure-core clients, their HTTP transport routed to tests/fakes/arm.py,
which evaluates infra/main.json as ARM does and checks the bodies against the vendored specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cli import azure as cli
from tests.fakes.arm import ARM_HOST, GRAPH_HOST, FakeArm
from tests.fakes.transport import FakeCredential, transport_factory

SUB = "00000000-0000-0000-0000-00000000abcd"


@pytest.fixture
def arm() -> FakeArm:
    fake = FakeArm(SUB)
    fake.providers_regions["Microsoft.App/managedEnvironments"] = ["West Europe", "North Europe"]
    return fake


def _run(arm: FakeArm, tmp_path: Path, *args: str, answer: str = "y") -> tuple[int, list[str]]:
    transport = transport_factory({ARM_HOST: arm, GRAPH_HOST: arm.graph})()
    asked: list[str] = []
    config = tmp_path / "azure.yaml"
    argv = list(args)
    if argv[0] == "up":
        argv += [
            "--location",
            "westeurope",
            "--config-out",
            str(config),
            "--no-images",
            "--no-register",
        ]
    code = cli.main(
        [*argv, "--subscription", SUB, "--name-prefix", "rt42"],
        credential=FakeCredential(),
        transport=transport,
        ask=lambda q: asked.append(q) or answer,
    )
    return code, asked


def test_up_brings_up_the_setup_then_a_second_run_changes_nothing(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from backends.azure.batch_requests import arm_pool
    from backends.azure.plan import build_plan
    from core.config import load_config

    code, asked = _run(arm, tmp_path, "up")
    out = capsys.readouterr()
    assert code == 0, out.err
    assert asked and "apply these" in asked[0]
    assert (
        "Create" in out.out
        and "Microsoft.Batch/batchAccounts/rt42batch/pools/retrain-gpu" in out.out
    )
    assert not arm.refused
    assert {"Microsoft.Batch", "Microsoft.App"} <= arm.registered
    # What the template created, as ARM holds it: the pool with the nodes' identity, roles.
    resources = arm.resources
    pool = next(r for k, r in resources.items() if k.endswith("/pools/retrain-gpu"))
    group = f"/subscriptions/{SUB}/resourceGroups/rt42-rg"
    nodes_id = f"{group}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/rt42-nodes"
    assert list(pool["identity"]["userAssignedIdentities"]) == [nodes_id]
    roles = [
        r for r in resources.values() if r["type"] == "Microsoft.Authorization/roleAssignments"
    ]
    assert len(roles) == 12
    container_scoped = [r for r in roles if "/blobServices/default/containers/" in r["id"]]
    assert len(container_scoped) == 4  # data and outputs roles are on containers, not the account

    # The config written from the outputs loads, and its --plan validates.
    config_file = tmp_path / "azure.yaml"
    config = load_config(config_file)
    assert config.azure.identity_client_id and config.azure.identity_resource_id == nodes_id
    # The run links open through the gateway app, and runs are tracked by the MLflow app.
    out_lines = dict(line.split(": ", 1) for line in out.out.splitlines() if ": https://" in line)
    assert config.output.links_url == out_lines["outputs gateway"]
    assert config.tracking.mlflow_uri == out_lines["MLflow"]
    plan = build_plan(config, cli.ROOT)
    assert plan["resources"]["node_access"] == "managed identity"
    # One definition: the pool ARM created is the pool --plan prints, in ARM's shape, plus the
    # share key ARM read from the account (never the orchestrator's).
    settings = plan["requests"][0]["pool_settings"]
    created = pool["properties"]
    from backends.target import image_reference

    expected = arm_pool(config, image_reference(config), nodes_id)["properties"]
    share = created["mountConfiguration"][1]["azureFileShareConfiguration"]
    assert share.pop("accountKey") == "fake-account-key"
    assert created == expected
    vm = created["deploymentConfiguration"]["virtualMachineConfiguration"]
    assert (
        vm["containerConfiguration"]["containerImageNames"]
        == settings["virtualMachineConfiguration"]["containerConfiguration"]["containerImageNames"]
    )
    assert created["vmSize"] == settings["vmSize"]
    assert created["mountConfiguration"][0] == settings["mountConfiguration"][0]
    assert created["networkConfiguration"] == settings["networkConfiguration"]
    assert (
        created["scaleSettings"]["fixedScale"]["targetDedicatedNodes"]
        == settings["targetDedicatedNodes"]
    )

    puts = [r for r in arm.requests.all() if r.method == "PUT"]
    code, asked = _run(arm, tmp_path, "up")
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "nothing to change" in out.out and not asked
    assert [r for r in arm.requests.all() if r.method == "PUT"] == puts  # no deployment sent
    assert "unchanged" in out.out


def test_a_deployment_that_fails_half_way_is_named_and_a_rerun_continues(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arm.fail_type = "Microsoft.Batch/batchAccounts/pools"
    code, _ = _run(arm, tmp_path, "up")
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "pools/retrain-gpu" in err
        and "could not be created" in err
        and "run `make azure-up` again" in err
    )
    made = set(arm.resources)
    assert any(k.endswith("/batchaccounts/rt42batch") for k in made)
    assert not (tmp_path / "azure.yaml").exists()
    arm.fail_type = None
    code, _ = _run(arm, tmp_path, "up")
    out = capsys.readouterr().out
    assert code == 0
    pending = [line.split()[1].lower() for line in out.splitlines() if line.startswith("  Create")]
    assert not [line for line in out.splitlines() if line.startswith("  Modify")]
    assert any(p.endswith("/pools/retrain-gpu") for p in pending)
    assert not set(pending) & made  # what the first run created is kept, not made again
    assert made < set(arm.resources)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: a.usages.update(StandardNCADSA100v4Family=(24, 48)),
            "request a limit of at least 72",
        ),
        (
            lambda a: a.providers_regions.update(
                {"Microsoft.App/managedEnvironments": ["East US"]}
            ),
            "has no Azure Container Apps",
        ),
        (lambda a: a.skus.clear(), "does not offer Standard_NC24ads_A100_v4"),
        (lambda a: a.taken_names.add("rt42data"), "the name rt42data"),
    ],
)
def test_bad_setups_are_named_before_anything_is_created(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, message: str
) -> None:
    change(arm)
    code, _ = _run(arm, tmp_path, "up")
    assert code == 2
    assert message in capsys.readouterr().err
    assert not arm.resources and not arm.deployments


def test_a_hand_edited_config_is_kept(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(arm, tmp_path, "up")[0] == 0
    config = tmp_path / "azure.yaml"
    edited = config.read_text().replace("epochs: 30", "epochs: 12")
    config.write_text(edited)
    code, _ = _run(arm, tmp_path, "up")
    err = capsys.readouterr().err
    assert code == 2 and "has hand edits" in err
    assert config.read_text() == edited
    assert yaml.safe_load((tmp_path / "azure.new.yaml").read_text())["training"]["epochs"] == 30


def test_down_keeps_what_holds_data(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(arm, tmp_path, "up")[0] == 0
    code, asked = _run(arm, tmp_path, "down")
    out = capsys.readouterr().out
    assert code == 0 and "delete these" in asked[0]
    assert "keep   Microsoft.Storage/storageAccounts rt42data" in out
    kinds = {
        r["type"]
        for r in arm.resources.values()
        if "/resourcegroups/rt42-rg/" in r["id"].lower() and "roleAssignments" not in r["type"]
    }
    assert {"Microsoft.Storage/storageAccounts", "Microsoft.KeyVault/vaults"} <= kinds
    assert (
        "Microsoft.Batch/batchAccounts" not in kinds and "Microsoft.App/containerApps" not in kinds
    )


def test_up_help_lists_every_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    text = capsys.readouterr().out
    for action in cli.parser()._subparsers._group_actions[0].choices["up"]._actions:  # type: ignore[union-attr]
        for flag in action.option_strings:
            assert flag in text


def test_up_builds_both_images_then_runs_the_apps_on_the_service_image(
    arm: FakeArm,
    tmp_path: Path,
    azurite: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The images by ACR Tasks (the fake keeps build contexts in Azurite), then a second
    deployment that moves the apps from the placeholder to the service image and subscribes
    the relay to the data container's events; a second run builds and deploys nothing."""
    from backends.azure.clients import Route, route_through
    from tests.azure_helpers import fake_azure

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    monkeypatch.setattr(cli, "POLL_SECONDS", 0.0)
    with fake_azure() as fakes:
        fakes.acr.registry_host = "rt42acr.azurecr.io"
        arm.acr = fakes.acr
        services = {ARM_HOST: arm, GRAPH_HOST: arm.graph, "rt42acr.azurecr.io": fakes.acr.registry}
        route = Route(transport_factory(services), FakeCredential(), f"https://{ARM_HOST}")
        with route_through(route):
            argv = [
                "up",
                "--location",
                "westeurope",
                "--config-out",
                str(tmp_path / "azure.yaml"),
                "--no-register",
                "--yes",
            ]
            argv += ["--subscription", SUB, "--name-prefix", "rt42"]
            transport = transport_factory(services)()
            assert cli.main(argv, credential=FakeCredential(), transport=transport) == 0, (
                capsys.readouterr().err
            )
            out = capsys.readouterr().out
            repos = {repo for repo, _ in fakes.acr.tags}
            assert repos == {"retrain/horovod", "retrain/service"}
            assert (
                "deploying the apps with the service image rt42acr.azurecr.io/retrain/service:"
                in out
            )
            apps = [r for r in arm.resources.values() if r["type"] == "Microsoft.App/containerApps"]
            images = {r["properties"]["template"]["containers"][0]["image"] for r in apps}
            service = next(i for i in images if "/retrain/service:" in i)
            assert images == {service, "prefecthq/prefect:3.8.8-python3.11"}
            (subscription,) = [
                r for r in arm.resources.values() if r["type"].endswith("/eventSubscriptions")
            ]
            assert subscription["properties"]["filter"]["subjectEndsWith"] == "/_SUCCESS"
            builds = len(fakes.acr.runs)
            assert cli.main(argv, credential=FakeCredential(), transport=transport) == 0
            out = capsys.readouterr().out
            assert "nothing to change" in out and len(fakes.acr.runs) == builds
            assert "tag already in the registry" in out


def test_prefect_cloud_keeps_its_key_in_the_vault_and_off_the_command_line(
    arm: FakeArm,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cloud = "https://api.prefect.cloud/api/accounts/a/workspaces/w"
    args = ("up", "--prefect", "cloud", "--prefect-cloud-api-url", cloud)
    assert _run(arm, tmp_path, *args)[0] == 2
    assert "--prefect-cloud-api-key-env" in capsys.readouterr().err
    assert not arm.resources
    monkeypatch.setenv("TEAM_PREFECT_KEY", "pnu_test_key_value")
    assert _run(arm, tmp_path, *args, "--prefect-cloud-api-key-env", "TEAM_PREFECT_KEY")[0] == 0
    out = capsys.readouterr().out
    assert f"Prefect UI: {cloud}" in out and "pnu_test_key_value" not in out
    key = next(r for k, r in arm.resources.items() if k.endswith("/secrets/prefect-api-key"))
    assert key["properties"]["value"] == "pnu_test_key_value"
    kinds = [
        r["name"] for r in arm.resources.values() if r["type"] == "Microsoft.App/containerApps"
    ]
    assert "rt42-prefect" not in kinds and "rt42-worker" in kinds
    worker = next(r for r in arm.resources.values() if r["name"] == "rt42-worker")
    env = {e["name"]: e for e in worker["properties"]["template"]["containers"][0]["env"]}
    assert env["PREFECT_API_URL"]["value"] == cloud
    assert env["PREFECT_API_KEY"] == {"name": "PREFECT_API_KEY", "secretRef": "prefect-api-key"}
