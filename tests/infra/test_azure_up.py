"""`make azure-up` / `make azure-down` end to end against the fake ARM endpoint: the real
azure-mgmt-resource and azure-core clients, their HTTP transport routed to tests/fakes/arm.py,
which evaluates infra/main.json as ARM does and checks the bodies against the vendored specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from azure.core.exceptions import HttpResponseError

from cli import azure as cli
from tests.fakes.arm import ARM_HOST, GRAPH_HOST, FakeArm
from tests.fakes.transport import FakeCredential, transport_factory

SUB = "00000000-0000-0000-0000-00000000abcd"
VAULT_HOST = "rt42-kv.vault.azure.net"


@pytest.fixture
def arm() -> FakeArm:
    fake = FakeArm(SUB)
    fake.providers_regions["Microsoft.App/managedEnvironments"] = ["West Europe", "North Europe"]
    return fake


def _run(arm: FakeArm, tmp_path: Path, *args: str, answer: str = "y") -> tuple[int, list[str]]:
    transport = transport_factory({ARM_HOST: arm, GRAPH_HOST: arm.graph, VAULT_HOST: arm.vault})()
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
    assert len(roles) == 16  # 13 for the identities, 3 for the deployer's reads of credentials
    container_scoped = [r for r in roles if "/blobServices/default/containers/" in r["id"]]
    assert len(container_scoped) == 6  # data, outputs, scripts: on containers, not the account

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
    # One definition: the pool ARM created is the pool --plan prints, in ARM's shape. It holds
    # no key: the scripts container is mounted with the nodes' identity, which may read it.
    settings = plan["requests"][0]["pool_settings"]
    created = pool["properties"]
    from backends.target import image_reference

    expected = arm_pool(config, image_reference(config), nodes_id)["properties"]
    assert created == expected
    scripts = created["mountConfiguration"][1]["azureBlobFileSystemConfiguration"]
    assert scripts["identityReference"] == {"resourceId": nodes_id}
    assert settings["mountConfiguration"][1] == created["mountConfiguration"][1]
    assert "accountKey" not in json.dumps(arm.resources) and "listKeys" not in json.dumps(
        json.loads(cli.TEMPLATE.read_text())["resources"][-1]["properties"]["template"]["variables"]
    )
    assert config.share.account_key_secret is None
    data_account = next(r for k, r in resources.items() if k.endswith("/storageaccounts/rt42data"))
    assert data_account["properties"]["allowSharedKeyAccess"] is False
    reader = "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1"  # Storage Blob Data Reader
    assert any(
        r["id"]
        .lower()
        .startswith(
            f"{group}/providers/microsoft.storage/storageaccounts/rt42data/blobservices/default/containers/retrain-scripts/".lower()
        )
        and r["properties"]["roleDefinitionId"].endswith(reader)
        and r["properties"]["principalId"] == resources[nodes_id.lower()]["_runtime"]["principalId"]
        for r in roles
    )
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
    """As on ARM, a failure stops only what depends on it: the rest of the deployment is
    created, the deployment fails at the end, and a re-run creates just what is missing."""
    arm.fail_type = "Microsoft.KeyVault/vaults"
    code, _ = _run(arm, tmp_path, "up")
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "vaults/rt42-kv" in err
        and "could not be created" in err
        and "run `make azure-up` again" in err
    )
    made = set(arm.resources)
    # Declared after the vault, independent of it: created all the same.
    for name in ("/flexibleservers/rt42-db", "/registries/rt42acr", "/storageaccounts/rt42nfs"):
        assert any(k.endswith(name) for k in made), name
    # What depends on the vault (Batch's user-subscription mode, the pool) or reads it (the
    # apps' secret references) was not started.
    for name in ("/batchaccounts/rt42batch", "/pools/retrain-gpu", "/containerapps/rt42-worker"):
        assert not any(k.endswith(name) for k in made), name
    assert not (tmp_path / "azure.yaml").exists()
    arm.fail_type = None
    code, _ = _run(arm, tmp_path, "up")
    out = capsys.readouterr().out
    assert code == 0
    pending = [line.split()[1].lower() for line in out.splitlines() if line.startswith("  Create")]
    assert not [line for line in out.splitlines() if line.startswith("  Modify")]
    assert any(p.endswith("/pools/retrain-gpu") for p in pending)
    assert any(p.endswith("/vaults/rt42-kv") for p in pending)
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


def _in_group(arm: FakeArm) -> dict[str, str]:
    prefix = f"/subscriptions/{SUB}/resourcegroups/rt42-rg/".lower()
    return {
        k: r["type"]
        for k, r in arm.resources.items()
        if k.startswith(prefix) and "roleAssignments" not in r["type"]
    }


def test_down_keeps_what_holds_data(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(arm, tmp_path, "up")[0] == 0
    before = _in_group(arm)
    code, asked = _run(arm, tmp_path, "down")
    out = capsys.readouterr().out
    assert code == 0 and "delete these" in asked[0]
    assert "keep   Microsoft.Storage/storageAccounts rt42data" in out
    kinds = set(_in_group(arm).values())
    assert {"Microsoft.Storage/storageAccounts", "Microsoft.KeyVault/vaults"} <= kinds
    assert (
        "Microsoft.Batch/batchAccounts" not in kinds and "Microsoft.App/containerApps" not in kinds
    )
    # What the kept resources hold is kept whole: the containers, the shares, the secrets, the
    # databases (ARM lists only the accounts; deleting a child would lose its data).
    held = (
        "Microsoft.Storage/storageAccounts/blobServices/containers",
        "Microsoft.Storage/storageAccounts/fileServices/shares",
        "Microsoft.KeyVault/vaults/secrets",
        "Microsoft.DBforPostgreSQL/flexibleServers/databases",
    )
    for kind in held:
        wanted = {k for k, t in before.items() if t == kind}
        assert wanted and wanted <= set(_in_group(arm)), kind


def test_down_with_delete_data_deletes_the_group(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(arm, tmp_path, "up")[0] == 0
    code, _ = _run(arm, tmp_path, "down", "--delete-data", answer="n")
    assert code == 1 and _in_group(arm)  # asked, answered no: nothing deleted
    out = capsys.readouterr().out
    assert "delete Microsoft.Storage/storageAccounts rt42data" in out and "keep " not in out
    code, _ = _run(arm, tmp_path, "down", "--delete-data")
    assert code == 0 and _in_group(arm) == {}
    assert "another --name-prefix" in capsys.readouterr().out


def test_prune_stops_before_deleting_what_holds_data(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prune`` deploys the group in Complete mode: the what-if names what the template does
    not declare, and a resource holding data among it stops the run before any change."""
    assert _run(arm, tmp_path, "up")[0] == 0
    group = f"/subscriptions/{SUB}/resourceGroups/rt42-rg/providers"
    by_hand = [  # made in the portal, say: not in infra/main.json
        f"{group}/Microsoft.Storage/storageAccounts/rt42scratch",
        f"{group}/Microsoft.Network/networkSecurityGroups/old-nsg",
    ]
    for rid in by_hand:
        kind = "/".join(rid.split("/providers/")[1].split("/")[:2])
        arm.resources[rid.lower()] = {
            "id": rid,
            "name": rid.rsplit("/", 1)[1],
            "type": kind,
            "location": "westeurope",
        }
    capsys.readouterr()
    puts = len([r for r in arm.requests.all() if r.method == "PUT"])
    code, _ = _run(arm, tmp_path, "up")  # without --prune: left alone, nothing to do
    assert code == 0 and "nothing to change" in capsys.readouterr().out
    code, _ = _run(arm, tmp_path, "up", "--prune")
    err = capsys.readouterr().err
    assert code == 2 and "would delete resources holding data" in err and "rt42scratch" in err
    assert "old-nsg" not in err
    assert len([r for r in arm.requests.all() if r.method == "PUT"]) == puts
    assert {rid.lower() for rid in by_hand} <= set(arm.resources)
    del arm.resources[by_hand[0].lower()]  # its data moved, the account deleted
    code, _ = _run(arm, tmp_path, "up", "--prune")
    out = capsys.readouterr().out
    assert code == 0 and "Delete   " in out and "old-nsg" in out
    assert not {rid.lower() for rid in by_hand} & set(arm.resources)
    assert any(k.endswith("/storageaccounts/rt42data") for k in arm.resources)


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


def _secret_values(arm: FakeArm) -> dict[str, str]:
    """Every secret the setup holds, by vault secret name, and the passwords inside them."""
    found = {}
    for r in arm.resources.values():
        if r["type"] == "Microsoft.KeyVault/vaults/secrets":
            value = r["properties"]["value"]
            found[r["name"]] = value
            if "://retrain:" in value:  # a database URL: its password
                found[r["name"] + " password"] = value.split("://retrain:", 1)[1].split("@", 1)[0]
            elif value.startswith("retrain:"):  # user:password
                found[r["name"] + " password"] = value.split(":", 1)[1]
    return found


def _without_secure_parameters(body: dict[str, Any]) -> dict[str, Any]:
    """A deployment or what-if body less the values of its securestring parameters: ARM takes
    them there (and never shows them again); everything else must be free of secrets."""
    template = body["properties"]["template"]
    secure = {k for k, v in template["parameters"].items() if v["type"].lower() == "securestring"}
    parameters = body["properties"].get("parameters", {})
    kept = {k: v for k, v in parameters.items() if k not in secure}
    return {**body, "properties": {**body["properties"], "parameters": kept}}


def test_public_endpoints_ask_for_credentials_that_live_in_the_vault_only(
    arm: FakeArm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _run(arm, tmp_path, "up")
    out = capsys.readouterr()
    assert code == 0, out.err
    values = _secret_values(arm)
    assert {"prefect-auth", "mlflow-password", "mlflow-flask-key", "gateway-auth"} <= set(values)
    apps = {
        r["name"].removeprefix("rt42-"): r
        for r in arm.resources.values()
        if r["type"] == "Microsoft.App/containerApps"
    }

    def env(app: str) -> dict[str, dict[str, str]]:
        return {e["name"]: e for e in apps[app]["properties"]["template"]["containers"][0]["env"]}

    # Each app with external ingress asks for a credential, each a Key Vault secret.
    public = {n for n, a in apps.items() if a["properties"]["configuration"].get("ingress")}
    assert public == {"prefect", "mlflow", "gateway", "relay"}
    assert env("prefect")["PREFECT_SERVER_API_AUTH_STRING"]["secretRef"] == "prefect-auth"
    assert (
        "--app-name basic-auth"
        in apps["mlflow"]["properties"]["template"]["containers"][0]["command"][2]
    )
    assert env("mlflow")["MLFLOW_AUTH_ADMIN_PASSWORD"]["secretRef"] == "mlflow-password"
    assert env("gateway")["RETRAIN_GATEWAY_AUTH_STRING"]["secretRef"] == "gateway-auth"
    assert env("relay")["RETRAIN_RELAY_SECRET"]["secretRef"] == "relay-key"
    # Their clients present them, from the same secrets.
    for app in ("worker", "relay"):
        assert env(app)["PREFECT_API_AUTH_STRING"] == {
            "name": "PREFECT_API_AUTH_STRING",
            "secretRef": "prefect-auth",
        }
    assert env("worker")["MLFLOW_TRACKING_PASSWORD"]["secretRef"] == "mlflow-password"
    vault = "https://rt42-kv.vault.azure.net/secrets/"
    orchestrator = next(
        k for k in arm.resources if k.endswith("/userassignedidentities/rt42-orchestrator")
    )
    for app in apps.values():
        for secret in app["properties"]["configuration"].get("secrets", []):
            assert set(secret) == {"name", "keyVaultUrl", "identity"}, secret
            assert secret["keyVaultUrl"] == vault + secret["name"]
            assert secret["identity"].lower() == orchestrator

    # No value anywhere but the vault (and the write-only properties that take one).
    write_only = {"administratorLoginPassword", "value", "endpointUrl"}

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items() if k not in write_only}
        return [scrub(v) for v in value] if isinstance(value, list) else value

    public_state = json.dumps(scrub(list(arm.resources.values())))
    deployment = json.dumps(arm.deployments[cli.DEPLOYMENT]["properties"])
    log = []
    for request in arm.requests.all():
        body = request.json() if request.body else None
        if isinstance(body, dict) and "template" in body.get("properties", {}):
            body = _without_secure_parameters(body)
        log.append(
            json.dumps([request.method, request.path, request.query, dict(request.headers), body])
        )
    config = (tmp_path / "azure.yaml").read_text()
    for name, value in values.items():
        for where, text in (
            ("the deployment's outputs", deployment),
            ("the request log", "\n".join(log)),
            ("what up printed", out.out + out.err),
            ("configs/azure.yaml", config),
            ("a resource other than the vault's secret", public_state),
        ):
            assert value not in text, f"{name} appears in {where}"
    # up says where to read each, not what it is.
    for secret in ("prefect-auth", "mlflow-password", "gateway-auth"):
        assert f"az keyvault secret show --vault-name rt42-kv --name {secret}" in out.out

    # A re-run keeps them; registering reads the Prefect credential from the vault, as the
    # deployer, whom the setup lets read that secret and no other.
    assert _run(arm, tmp_path, "up")[0] == 0
    assert _secret_values(arm) == values
    transport = transport_factory({ARM_HOST: arm, GRAPH_HOST: arm.graph, VAULT_HOST: arm.vault})()
    azure = cli.Azure(SUB, FakeCredential(), transport)
    names = cli.Names("rt42").as_dict()
    assert cli.prefect_auth(azure, names, {}) == values["prefect-auth"]
    with pytest.raises(HttpResponseError):  # the database URL is not the deployer's to read
        azure.vault_secret("rt42-kv", "database-url")
    for key in [k for k, r in arm.resources.items() if "/secrets/prefect-auth/providers/" in k]:
        del arm.resources[key]
    with pytest.raises(cli.SetupError, match="Key Vault Secrets User on the secret prefect-auth"):
        cli.prefect_auth(azure, names, {})

    # Asked to, up makes new Prefect and gateway credentials; MLflow's admin keeps its own.
    capsys.readouterr()
    assert _run(arm, tmp_path, "up", "--rotate-credentials")[0] == 0
    rotated = _secret_values(arm)
    assert rotated["prefect-auth"] != values["prefect-auth"]
    assert rotated["gateway-auth"] != values["gateway-auth"]
    assert rotated["mlflow-password"] == values["mlflow-password"]
    assert rotated["gateway-auth"] not in capsys.readouterr().out
