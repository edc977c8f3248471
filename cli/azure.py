"""``python -m cli.azure up|down``: the pipeline's Azure setup from an empty subscription.

``up`` checks the sign-in and the subscription, registers the resource providers, checks that
the region has the VM size and Container Apps and that the subscription's quota holds the pool
(saying exactly what to request when it does not), checks the global names, previews the
deployment of ``infra/main.json`` (what-if), asks, deploys it, builds the images, writes
``configs/azure.yaml`` from the deployment's outputs and registers the deployments. Run again with
nothing changed it says so and changes nothing; after a failure it continues where it stopped
(an ARM deployment is idempotent: what exists is kept). ``down`` names what it deletes and asks;
what holds data is kept unless ``--delete-data``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "infra" / "main.json"
DEPLOYMENT = "retrain-setup"
BATCH_APP_ID = "ddbf3205-c6bd-46ae-8127-60eb93363864"  # Microsoft Azure Batch, in every tenant
NAMESPACES = (
    "Microsoft.Batch",
    "Microsoft.Storage",
    "Microsoft.ContainerRegistry",
    "Microsoft.ManagedIdentity",
    "Microsoft.Network",
    "Microsoft.App",
    "Microsoft.EventGrid",
    "Microsoft.KeyVault",
    "Microsoft.DBforPostgreSQL",
    "Microsoft.OperationalInsights",
    "Microsoft.Compute",
    "Microsoft.Insights",
)
# Resource types that hold data: down keeps them, and a preview that would delete one stops.
DATA_TYPES = (
    "microsoft.storage/storageaccounts",
    "microsoft.dbforpostgresql/flexibleservers",
    "microsoft.keyvault/vaults",
)
# GPUs per node of the sizes docs/azure.md lists (processes per node = GPUs).
GPUS = {"standard_nc24ads_a100_v4": 1, "standard_nd96asr_v4": 8, "standard_nd96isr_h100_v5": 8}
# Template parameter -> Key Vault secret, for what `up` generates once and keeps: the database
# password (in the URLs), the relay's key, Prefect Cloud's key (a placeholder when self-hosted),
# and the credentials the public endpoints ask for (Prefect API and UI, MLflow, the gateway).
CREDENTIALS = (
    ("databasePassword", "database-url"),
    ("relayKey", "relay-key"),
    ("prefectApiKey", "prefect-api-key"),
    ("prefectAuth", "prefect-auth"),
    ("mlflowPassword", "mlflow-password"),
    ("mlflowFlaskKey", "mlflow-flask-key"),
    ("gatewayAuth", "gateway-auth"),
)
# What --rotate-credentials makes anew. MLflow's admin password is not among them: its
# basic-auth app stores it when it first creates the user, and reads the variable never again.
ROTATED = ("prefectAuth", "gatewayAuth")
USER_PASSWORD = ("prefectAuth", "gatewayAuth")  # user:password, as their servers compare them
CREDENTIAL_USER = "retrain"
MLFLOW_USER = "admin"
SERVICE_DOCKERFILE = "infra/service.Dockerfile"
SERVICE_REPOSITORY = "retrain/service"
POLL_SECONDS = 5.0  # between reads of an ACR Tasks run
HEADER = "# Written by `make azure-up` from the deployment's outputs (sha256 {digest}).\n"
_PREFIX = re.compile(r"^[a-z][a-z0-9]{2,10}$")


class SetupError(RuntimeError):
    """A named problem and what to do about it; nothing was deleted or overwritten."""


@dataclass(frozen=True)
class Names:
    """Every resource's name, from the name prefix (the template takes them as given)."""

    prefix: str

    def as_dict(self) -> dict[str, str]:
        p = self.prefix
        return {
            "prefix": p,
            "storage": f"{p}data",
            "nfsStorage": f"{p}nfs",
            "registry": f"{p}acr",
            "batch": f"{p}batch",
            "keyVault": f"{p}-kv",
            "logs": f"{p}-logs",
            "vnet": f"{p}-vnet",
            "nsg": f"{p}-nodes-nsg",
            "nodesIdentity": f"{p}-nodes",
            "orchestratorIdentity": f"{p}-orchestrator",
            "appsEnvironment": f"{p}-apps",
            "postgres": f"{p}-db",
        }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cli.azure", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="preview, deploy and configure the Azure setup")
    down = sub.add_parser("down", help="delete the setup (data kept unless --delete-data)")
    for cmd in (up, down):
        cmd.add_argument("--subscription", required=True, help="the subscription id")
        cmd.add_argument("--name-prefix", required=True, help="3-11 lowercase letters/digits")
        cmd.add_argument("--resource-group", help="default: <prefix>-rg")
        cmd.add_argument("--yes", action="store_true", help="do not ask before changing")
    up.add_argument("--location", required=True, help="the region, e.g. westeurope")
    up.add_argument("--vm-size", default="Standard_NC24ads_A100_v4", help="the GPU VM size")
    up.add_argument("--dedicated-nodes", type=int, default=2, help="dedicated nodes")
    up.add_argument("--spot-nodes", type=int, default=0, help="Spot nodes")
    up.add_argument(
        "--prefect",
        choices=("self-hosted", "cloud"),
        default="self-hosted",
        help="where the Prefect server lives: Container Apps + PostgreSQL, or Prefect Cloud",
    )
    up.add_argument("--prefect-cloud-api-url", default="", help="with --prefect cloud")
    up.add_argument(
        "--prefect-cloud-api-key-env",
        default="",
        help="with --prefect cloud: the environment variable holding the workspace's API key "
        "(stored in the Key Vault; never on a command line)",
    )
    up.add_argument("--nfs-gib", type=int, default=1024, help="the NFS share's provisioned GiB")
    up.add_argument("--config-out", default="configs/azure.yaml", help="the config to write")
    up.add_argument("--overwrite-config", action="store_true", help="replace a hand-edited config")
    up.add_argument("--no-images", action="store_true", help="skip building the images")
    up.add_argument("--no-register", action="store_true", help="skip registering deployments")
    up.add_argument(
        "--rotate-credentials",
        action="store_true",
        help="make new Prefect API and gateway credentials (kept across runs otherwise)",
    )
    up.add_argument(
        "--prune",
        action="store_true",
        help="also delete what the resource group holds and infra/main.json does not declare "
        "(stops, deleting nothing, if any of it holds data)",
    )
    down.add_argument(
        "--delete-data",
        action="store_true",
        help="also delete the storage accounts, the database and the Key Vault",
    )
    return p


class Azure:
    """The SDK clients, on one credential and (in tests) one HTTP transport."""

    def __init__(self, subscription: str, credential: Any = None, transport: Any = None) -> None:
        from azure.identity import DefaultAzureCredential
        from azure.mgmt.resource import ResourceManagementClient, SubscriptionClient

        self.subscription = subscription
        self.credential = credential or DefaultAzureCredential()
        extra = {"transport": transport} if transport is not None else {}
        self.resources = ResourceManagementClient(
            self.credential, subscription, polling_interval=0 if transport else 5, **extra
        )
        self.subscriptions = SubscriptionClient(self.credential, **extra)
        self._transport = transport

    def _pipeline(self, base: str, scope: str) -> Any:
        from azure.core import PipelineClient
        from azure.core.pipeline.policies import BearerTokenCredentialPolicy, RetryPolicy

        policies = [RetryPolicy(), BearerTokenCredentialPolicy(self.credential, scope)]
        extra = {"transport": self._transport} if self._transport is not None else {}
        return PipelineClient(base, policies=policies, **extra)

    def arm(self, method: str, path: str, api: str, body: Any = None) -> Any:
        """A management-plane call the resource SDK has no operation for (Compute SKUs and
        usages, name checks, a resource by id), through azure-core's pipeline."""
        from azure.core.rest import HttpRequest

        client = self._pipeline(
            "https://management.azure.com", "https://management.azure.com/.default"
        )
        sep = "&" if "?" in path else "?"
        request = HttpRequest(
            method, f"https://management.azure.com{path}{sep}api-version={api}", json=body
        )
        response = client.send_request(request)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json() if response.content else {}

    def vault_secret(self, vault: str, name: str) -> str:
        """A secret's value from the Key Vault's data plane (Entra ID; the caller's role on it)."""
        from azure.core.rest import HttpRequest

        base = f"https://{vault}.vault.azure.net"
        client = self._pipeline(base, "https://vault.azure.net/.default")
        response = client.send_request(HttpRequest("GET", f"{base}/secrets/{name}?api-version=7.5"))
        response.raise_for_status()
        return str(response.json()["value"])

    def batch_principal(self) -> str:
        from azure.core.rest import HttpRequest

        client = self._pipeline(
            "https://graph.microsoft.com", "https://graph.microsoft.com/.default"
        )
        url = (
            f"https://graph.microsoft.com/v1.0/servicePrincipals(appId='{BATCH_APP_ID}')?$select=id"
        )
        response = client.send_request(HttpRequest("GET", url))
        if response.status_code == 404:
            raise SetupError(
                "the Microsoft Azure Batch service principal is not in this tenant yet: it comes "
                "with the Microsoft.Batch provider's registration, which this command just asked "
                "for; run again in a few minutes"
            )
        response.raise_for_status()
        return str(response.json()["id"])


def _group_path(azure: Azure, group: str) -> str:
    return f"/subscriptions/{azure.subscription}/resourceGroups/{group}"


def _region(name: str) -> str:
    return name.replace(" ", "").lower()


def check_account(azure: Azure) -> dict[str, Any]:
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

    try:
        found = azure.subscriptions.subscriptions.get(azure.subscription)
    except ClientAuthenticationError as exc:
        raise SetupError(
            "no Azure sign-in: run `az login` (or give a managed identity or service principal "
            f"through the AZURE_* variables DefaultAzureCredential reads): {exc.message}"
        ) from exc
    except HttpResponseError as exc:
        raise SetupError(
            f"subscription {azure.subscription} is not one this sign-in can use ({exc.message}): "
            "`az account list` shows yours; pass it as --subscription"
        ) from exc
    if found.state != "Enabled":
        raise SetupError(f"subscription {azure.subscription} is {found.state}, not Enabled")
    return {"tenant": found.tenant_id, "name": found.display_name}


def register_providers(azure: Azure, say: Callable[[str], None]) -> None:
    for namespace in NAMESPACES:
        provider = azure.resources.providers.get(namespace)
        if provider.registration_state != "Registered":
            say(f"registering the resource provider {namespace}")
            azure.resources.providers.register(namespace)


def check_region(azure: Azure, location: str, vm_size: str) -> dict[str, Any]:
    """The VM size and Container Apps in the region; the size's family and vCPUs."""
    apps = azure.resources.providers.get("Microsoft.App")
    regions = [
        _region(loc)
        for t in apps.resource_types or []
        if t.resource_type == "managedEnvironments"
        for loc in t.locations or []
    ]
    if _region(location) not in regions:
        raise SetupError(
            f"region {location} has no Azure Container Apps (the worker, relay, gateway and "
            f"MLflow run there): pick one of {', '.join(sorted(regions)) or 'none listed'}"
        )
    path = f"/subscriptions/{azure.subscription}/providers/Microsoft.Compute/skus"
    skus = azure.arm("GET", f"{path}?$filter=location eq '{_region(location)}'", "2021-07-01")
    for sku in (skus or {}).get("value", []):
        if sku.get("resourceType") == "virtualMachines" and sku["name"].lower() == vm_size.lower():
            blocked = [r.get("reasonCode", r.get("type")) for r in sku.get("restrictions", [])]
            if blocked:
                raise SetupError(
                    f"{vm_size} is restricted in {location} for this subscription "
                    f"({', '.join(blocked)}): pick another region or size"
                )
            caps = {c["name"]: c["value"] for c in sku.get("capabilities", [])}
            return {"family": sku["family"], "vcpus": int(caps["vCPUs"])}
    raise SetupError(f"region {location} does not offer {vm_size}: pick another region or size")


def check_quota(
    azure: Azure, location: str, vm_size: str, family: str, vcpus: int, dedicated: int, spot: int
) -> list[str]:
    """Empty when the regional quota holds the pool; else what to request, one line each. In
    user-subscription mode Batch's nodes are the subscription's VMs: dedicated ones count
    against the family's and the region's vCPUs, Spot ones against low-priority vCPUs."""
    compute = f"/subscriptions/{azure.subscription}/providers/Microsoft.Compute"
    path = f"{compute}/locations/{_region(location)}/usages"
    usages = {
        u["name"]["value"]: u for u in (azure.arm("GET", path, "2024-07-01") or {}).get("value", [])
    }
    needs = [
        (family, vcpus * dedicated),
        ("cores", vcpus * dedicated),
        ("lowPriorityCores", vcpus * spot),
    ]
    short = []
    for name, need in needs:
        if need == 0:
            continue
        usage = usages.get(name, {"currentValue": 0, "limit": 0})
        free = usage["limit"] - usage["currentValue"]
        if free < need:
            wanted = usage["currentValue"] + need
            short.append(
                f"{name} in {location}: limit {usage['limit']}, in use {usage['currentValue']}, "
                f"the pool needs {need} ({dedicated + spot} x {vm_size}); request a limit of at "
                f"least {wanted}: portal, Subscriptions > Usage + quotas, or `az quota update "
                f"--resource-name {name} --scope /subscriptions/{azure.subscription}/providers/"
                f"Microsoft.Compute/locations/{_region(location)} --limit-object value={wanted}`"
            )
    return short


def check_names(azure: Azure, names: dict[str, str], group: str) -> None:
    """Globally unique names (storage, registry) not taken by someone else."""
    checks = (
        ("Microsoft.Storage", "storageAccounts", names["storage"], "2025-01-01"),
        ("Microsoft.Storage", "storageAccounts", names["nfsStorage"], "2025-01-01"),
        ("Microsoft.ContainerRegistry", "registries", names["registry"], "2025-04-01"),
    )
    for namespace, kind, name, api in checks:
        ours = f"{_group_path(azure, group)}/providers/{namespace}/{kind}/{name}"
        if azure.arm("GET", ours, api) is not None:
            continue  # ours from an earlier run
        path = f"/subscriptions/{azure.subscription}/providers/{namespace}/checkNameAvailability"
        answer = azure.arm("POST", path, api, {"name": name, "type": f"{namespace}/{kind}"})
        if not answer.get("nameAvailable"):
            raise SetupError(
                f"the name {name} ({namespace}/{kind}) is taken ({answer.get('message')}): "
                "names are global; choose another --name-prefix"
            )


def pipeline_config(
    options: argparse.Namespace, names: dict[str, str], group: str
) -> dict[str, Any]:
    """The config the pipeline runs with on this setup; the deployment adds what only Azure
    knows (the nodes' identity's client id) and ``up`` writes the result."""
    example = yaml.safe_load((ROOT / "configs" / "azure.example.yaml").read_text())
    sub = options.subscription
    base = f"/subscriptions/{sub}/resourceGroups/{group}/providers"
    storage = names["storage"]
    gpus = GPUS.get(options.vm_size.lower(), 1)
    config = {
        "target": "azure",
        "data": {
            "account_url": f"https://{storage}.blob.core.windows.net",
            "container": "training-data",
            "prefix": "images",
        },
        "output": {
            "account_url": f"https://{storage}.blob.core.windows.net",
            "container": "retrain-outputs",
        },
        "share": {
            # A Blob container the nodes mount as their identity: no account key anywhere.
            "name": "retrain-scripts",
            "account_url": f"https://{storage}.blob.core.windows.net",
        },
        "nfs": {
            "source": f"{names['nfsStorage']}.file.core.windows.net:/{names['nfsStorage']}/retrain",
            "mount_options": "-o vers=4,minorversion=1,sec=sys,nconnect=4",
        },
        "image": {
            "builder": "acr",
            "registry": f"{names['registry']}.azurecr.io",
            "repository": "retrain/horovod",
        },
        "azure": {
            "batch_account_url": f"https://{names['batch']}.{_region(options.location)}.batch.azure.com",
            "subscription_id": sub,
            "resource_group": group,
            "identity_resource_id": (
                f"{base}/Microsoft.ManagedIdentity/userAssignedIdentities/{names['nodesIdentity']}"
            ),
        },
        "pool": {
            "id": "retrain-gpu",
            "vm_size": options.vm_size,
            "dedicated_nodes": options.dedicated_nodes,
            "low_priority_nodes": options.spot_nodes,
            "processes_per_node": gpus,
            "os_disk_gb": 128,
            "subnet_id": f"{base}/Microsoft.Network/virtualNetworks/{names['vnet']}/subnets/nodes",
            "release": "resize_to_zero",
        },
        "training": example["training"],
        "retries": example["retries"],
        "promotion": example["promotion"],
    }
    from core.config import PipelineConfig

    PipelineConfig.model_validate(config)  # a bad option fails here, naming the field
    return config


def deployment_parameters(
    options: argparse.Namespace,
    names: dict[str, str],
    group: str,
    config: dict[str, Any],
    principal: str,
    service_image: str,
    fresh_secrets: dict[str, str],
) -> dict[str, Any]:
    from backends.azure.batch_requests import arm_pool
    from backends.target import image_reference
    from core.config import PipelineConfig

    parsed = PipelineConfig.model_validate(config)
    pool = arm_pool(parsed, image_reference(parsed), str(parsed.azure.identity_resource_id))
    values = {
        "groupMode": "Complete" if options.prune else "Incremental",
        "location": _region(options.location),
        "resourceGroupName": group,
        "names": names,
        "nfsShareGiB": options.nfs_gib,
        "pool": pool,
        "pipelineConfig": config,
        "batchServicePrincipalObjectId": principal,
        "serviceImage": service_image,
        "prefectServer": options.prefect,
        "prefectCloudApiUrl": options.prefect_cloud_api_url,
        **fresh_secrets,
    }
    return {k: {"value": v} for k, v in values.items()}


def _secrets_to_create(
    azure: Azure, names: dict[str, str], group: str, options: argparse.Namespace
) -> dict[str, str]:
    """Secrets the Key Vault does not hold yet, made here once; existing ones are left alone
    (their values are never read back). Prefect Cloud's key is stored whenever it is given."""
    vault = f"{_group_path(azure, group)}/providers/Microsoft.KeyVault/vaults/{names['keyVault']}"
    fresh = {}
    for parameter, secret in CREDENTIALS:
        if parameter == "prefectAuth" and options.prefect != "self-hosted":
            continue  # Prefect Cloud takes its API key; a basic-auth string would replace it
        rotate = options.rotate_credentials and parameter in ROTATED
        if rotate or azure.arm("GET", f"{vault}/secrets/{secret}", "2024-11-01") is None:
            # A self-hosted server takes no key: the apps' variable holds a placeholder.
            value = secrets.token_urlsafe(32)
            fresh[parameter] = f"{CREDENTIAL_USER}:{value}" if parameter in USER_PASSWORD else value
    if options.prefect_cloud_api_key_env:
        key = os.environ.get(options.prefect_cloud_api_key_env)
        if not key:
            raise SetupError(
                f"--prefect-cloud-api-key-env {options.prefect_cloud_api_key_env}: that "
                "environment variable is not set"
            )
        fresh["prefectApiKey"] = key
    elif options.prefect == "cloud" and "prefectApiKey" in fresh:
        raise SetupError(
            "--prefect cloud needs the workspace's API key once: put it in an environment "
            "variable and name it with --prefect-cloud-api-key-env"
        )
    return fresh


def _changes(result: Any) -> list[tuple[str, str]]:
    return [(c.change_type, c.resource_id) for c in result.changes or []]


def write_config(path: Path, config: dict[str, Any], overwrite: bool) -> str:
    """The config file, unless it has hand edits (then the new one goes beside it)."""
    body = yaml.safe_dump(config, sort_keys=False)
    digest = hashlib.sha256(body.encode()).hexdigest()
    text = HEADER.format(digest=digest) + body
    if path.exists() and not overwrite:
        old = path.read_text()
        first, _, rest = old.partition("\n")
        match = re.search(r"sha256 ([0-9a-f]{64})", first)
        edited = match is None or hashlib.sha256(rest.encode()).hexdigest() != match.group(1)
        if old == text:
            return f"{path}: unchanged"
        if edited:
            beside = path.with_suffix(".new.yaml")
            beside.write_text(text)
            raise SetupError(
                f"{path} has hand edits: left as it is; the setup's config is in {beside}. "
                "Merge them, or run again with --overwrite-config"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"{path}: written"


def prefect_auth(azure: Azure, names: dict[str, str], fresh: dict[str, str]) -> str:
    """The self-hosted Prefect API's auth string, for registering the deployments: made by this
    run, or read from the Key Vault (the setup gives whoever runs ``up`` Key Vault Secrets User
    on that one secret). It goes to ``prefect`` through its environment, never an argument."""
    if "prefectAuth" in fresh:
        return fresh["prefectAuth"]
    from azure.core.exceptions import HttpResponseError

    try:
        return azure.vault_secret(names["keyVault"], "prefect-auth")
    except HttpResponseError as exc:
        raise SetupError(
            f"reading the Prefect API's credential from the Key Vault {names['keyVault']} was "
            f"refused ({exc.status_code}): the setup gives Key Vault Secrets User on the secret "
            "prefect-auth to whoever ran `make azure-up`; ask them to run it once, or run again "
            "with --no-register"
        ) from exc


def read_hint(vault: str, secret: str) -> str:
    return f"az keyvault secret show --vault-name {vault} --name {secret} --query value -o tsv"


def register(
    config_path: Path,
    api_url: str,
    api_key_env: str,
    say: Callable[[str], None],
    auth: str | None = None,
) -> None:
    """The work pool and the deployments, on the setup's Prefect server, registered with this
    config (deployments/registration.py)."""
    env = {**os.environ, "PREFECT_API_URL": api_url, "RETRAIN_FORM_CONFIG": str(config_path)}
    if api_key_env:
        env["PREFECT_API_KEY"] = os.environ[api_key_env]
    if auth:
        env["PREFECT_API_AUTH_STRING"] = auth
    env["PWD"] = "/app"  # where the worker's image holds the project (infra/service.Dockerfile)
    prefect = str(Path(sys.executable).parent / "prefect")
    for args in (
        [sys.executable, "-m", "deployments.setup", "--config", str(config_path)],
        [prefect, "--no-prompt", "deploy", "--all"],
    ):
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SetupError(
                f"registering the deployments failed ({' '.join(args[1:3])}): {proc.stderr[-2000:]}"
            )
    say(f"deployments registered on {api_url} with {config_path}")


def service_archive(root: Path) -> bytes:
    """The service image's build context: the project's tracked files, as a reproducible
    tar.gz (sorted names, no owners or times), so its hash names its content."""
    import gzip
    import io
    import tarfile

    names = (
        subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in sorted(n for n in names if n and (root / n).is_file()):
            info = tar.gettarinfo(str(root / name), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(root / name, "rb") as fh:
                tar.addfile(info, fh)
    return gzip.compress(buffer.getvalue(), compresslevel=6, mtime=0)


def _registry_clients(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    from backends.azure.clients import acr_tasks_client, registry_client
    from core.config import PipelineConfig

    parsed = PipelineConfig.model_validate(config)
    login = str(parsed.image.registry)
    return parsed, acr_tasks_client(parsed.azure), registry_client(login)


def service_image(
    azure: Azure, config: dict[str, Any], names: dict[str, str], group: str, archive: bytes
) -> tuple[str, bool]:
    """The service image's reference and whether the registry holds it already."""
    from backends.azure.acr import tag_exists

    tag = hashlib.sha256(archive).hexdigest()[:16]
    reference = f"{names['registry']}.azurecr.io/{SERVICE_REPOSITORY}:{tag}"
    registry = (
        f"{_group_path(azure, group)}/providers/Microsoft.ContainerRegistry/registries/"
        f"{names['registry']}"
    )
    if azure.arm("GET", registry, "2025-04-01") is None:
        return reference, False
    _, _, client = _registry_clients(config)
    return reference, tag_exists(client, SERVICE_REPOSITORY, tag)


def build_images(config: dict[str, Any], archive: bytes, say: Callable[[str], None]) -> None:
    """The training image and the service image, by ACR Tasks (each skipped when its tag,
    which names its content, is in the registry already)."""
    from backends.azure.acr import AcrBuilder
    from backends.image import content_tag

    parsed, tasks, registry = _registry_clients(config)
    group, login = str(parsed.azure.resource_group), str(parsed.image.registry)
    training = AcrBuilder(tasks, registry, group, login, poll_seconds=POLL_SECONDS)
    result = training.build(ROOT, parsed.image.repository, content_tag(ROOT), say)
    say(f"training image {result.reference}: {result.reason}")
    service = AcrBuilder(
        tasks,
        registry,
        group,
        login,
        poll_seconds=POLL_SECONDS,
        dockerfile=SERVICE_DOCKERFILE,
        context=lambda root: archive,
    )
    tag = hashlib.sha256(archive).hexdigest()[:16]
    result = service.build(ROOT, SERVICE_REPOSITORY, tag, say)
    say(f"service image {result.reference}: {result.reason}")


def deploy(
    azure: Azure,
    options: argparse.Namespace,
    group: str,
    template: dict[str, Any],
    parameters: dict[str, Any],
    say: Callable[[str], None],
) -> None:
    from azure.core.exceptions import HttpResponseError
    from azure.mgmt.resource.resources.models import Deployment, DeploymentProperties

    say(f"deploying infra/main.json to {group} (a few minutes; a re-run continues from here)")
    try:
        result = azure.resources.deployments.begin_create_or_update_at_subscription_scope(
            DEPLOYMENT,
            Deployment(
                location=_region(options.location),
                properties=DeploymentProperties(
                    mode="Incremental", template=template, parameters=parameters
                ),
            ),
        ).result()
    except HttpResponseError as exc:
        failed = [
            f"{op.properties.target_resource.id}: {op.properties.status_message.error.message}"
            for op in azure.resources.deployment_operations.list_at_subscription_scope(DEPLOYMENT)
            if op.properties
            and op.properties.provisioning_state == "Failed"
            and op.properties.target_resource
        ]
        detail = "; ".join(failed) or exc.message
        raise SetupError(
            f"the deployment failed: {detail}. What was created stays; fix the cause and run "
            "`make azure-up` again: it continues from where it stopped"
        ) from exc
    if result.properties.provisioning_state != "Succeeded":
        raise SetupError(f"the deployment ended {result.properties.provisioning_state}")


def up(
    options: argparse.Namespace, azure: Azure, say: Callable[[str], None], ask: Callable[[str], str]
) -> int:
    from azure.mgmt.resource.resources.models import DeploymentWhatIf, DeploymentWhatIfProperties

    if not _PREFIX.match(options.name_prefix):
        raise SetupError(
            f"--name-prefix {options.name_prefix!r}: 3-11 lowercase letters and digits, "
            "a letter first"
        )
    if options.prefect == "cloud" and not options.prefect_cloud_api_url:
        raise SetupError("--prefect cloud needs --prefect-cloud-api-url (the workspace's API URL)")
    group = options.resource_group or f"{options.name_prefix}-rg"
    names = Names(options.name_prefix).as_dict()
    account = check_account(azure)
    say(f"subscription {azure.subscription} ({account['name']}), tenant {account['tenant']}")
    register_providers(azure, say)
    size = check_region(azure, options.location, options.vm_size)
    short = check_quota(
        azure,
        options.location,
        options.vm_size,
        size["family"],
        size["vcpus"],
        options.dedicated_nodes,
        options.spot_nodes,
    )
    if short:
        raise SetupError(
            "the quota does not hold the pool; nothing was created. Request:\n  "
            + "\n  ".join(short)
        )
    check_names(azure, names, group)
    config = pipeline_config(options, names, group)
    principal = azure.batch_principal()
    template = json.loads(TEMPLATE.read_text())
    fresh = _secrets_to_create(azure, names, group, options)

    def parameters(image: str) -> dict[str, Any]:
        return deployment_parameters(options, names, group, config, principal, image, fresh)

    archive = b"" if options.no_images else service_archive(ROOT)
    wanted, present = (
        ("", False) if options.no_images else service_image(azure, config, names, group, archive)
    )
    image = wanted if present else ""  # the apps start on a placeholder until it is built
    preview = azure.resources.deployments.begin_what_if_at_subscription_scope(
        DEPLOYMENT,
        DeploymentWhatIf(
            location=_region(options.location),
            properties=DeploymentWhatIfProperties(
                mode="Incremental", template=template, parameters=parameters(image)
            ),
        ),
    ).result()
    changes = _changes(preview)
    pending = [(kind, rid) for kind, rid in changes if kind not in ("NoChange", "Ignore")]
    for kind, rid in pending:
        say(f"  {kind:8} {rid}")
    lost = [
        rid
        for kind, rid in pending
        if kind == "Delete" and any(t in rid.lower() for t in DATA_TYPES)
    ]
    if lost:
        raise SetupError(
            f"the deployment would delete resources holding data ({', '.join(lost)}): stopped, "
            "nothing changed. Move what they hold and delete them yourself, or run without "
            "--prune (which leaves what the template does not declare alone)"
        )
    if not pending:
        say(f"nothing to change: the setup in {group} matches infra/main.json")
    else:
        if not options.yes and ask(
            f"apply these {len(pending)} changes? [y/N] "
        ).strip().lower() not in ("y", "yes"):
            say("nothing changed")
            return 1
        deploy(azure, options, group, template, parameters(image), say)
    if not options.no_images:
        build_images(config, archive, say)
        if not present:
            say(f"deploying the apps with the service image {wanted}")
            deploy(azure, options, group, template, parameters(wanted), say)

    outputs = (
        azure.resources.deployments.get_at_subscription_scope(DEPLOYMENT).properties.outputs or {}
    )
    value = {k: v["value"] for k, v in outputs.items()}
    say(write_config(ROOT / options.config_out, value["pipelineConfig"], options.overwrite_config))
    self_hosted = options.prefect == "self-hosted"
    if not options.no_register:
        register(
            ROOT / options.config_out,
            value["prefectApiUrl"],
            options.prefect_cloud_api_key_env,
            say,
            prefect_auth(azure, names, fresh) if self_hosted else None,
        )
    vault = names["keyVault"]
    for label, key, secret, who in (
        ("Prefect UI", "prefectUiUrl", "prefect-auth" if self_hosted else "", "its password"),
        ("MLflow", "mlflowUrl", "mlflow-password", f"user {MLFLOW_USER}, password"),
        ("outputs gateway", "gatewayUrl", "gateway-auth", "user:password"),
        ("Event Grid relay", "relayUrl", "", ""),
    ):
        say(f"{label}: {value.get(key)}")
        if secret:  # where to read it: the value itself is never printed
            say(f"  {who}: `{read_hint(vault, secret)}`")
    if options.rotate_credentials:
        apps = ", ".join(
            f"{names['prefix']}-{a}" for a in ("prefect", "worker", "relay", "gateway")
        )
        say(
            f"credentials rotated: the apps read them as they start; restart {apps} "
            "(docs/azure.md, 'Credentials', has the command)"
        )
    say(
        "idle cost: docs/azure.md, 'What make azure-up creates' (per resource; the GPU pool "
        "costs nothing at zero nodes between runs)"
    )
    return 0


def down(
    options: argparse.Namespace, azure: Azure, say: Callable[[str], None], ask: Callable[[str], str]
) -> int:
    group = options.resource_group or f"{options.name_prefix}-rg"
    found = list(azure.resources.resources.list_by_resource_group(group))
    if not found:
        say(f"resource group {group} holds nothing")
        return 0
    keep = [r for r in found if not options.delete_data and r.type.lower() in DATA_TYPES]
    delete = [r for r in found if r not in keep]
    for r in delete:
        say(f"  delete {r.type} {r.name}")
    for r in keep:
        say(f"  keep   {r.type} {r.name} (holds data: --delete-data deletes it)")
    if not options.yes and ask(
        f"delete these {len(delete)} resources? [y/N] "
    ).strip().lower() not in ("y", "yes"):
        say("nothing deleted")
        return 1
    if options.delete_data:
        azure.resources.resource_groups.begin_delete(group).result()
        say(
            f"resource group {group} deleted. Its Key Vault stays soft-deleted for 90 days "
            "(purge protection keeps its secrets recoverable): a new setup in that time needs "
            "another --name-prefix"
        )
        return 0
    # Children first: a pool before its account, apps before their environment.
    for r in sorted(delete, key=lambda r: -r.id.count("/")):
        api = _api_version(azure, r.type)
        azure.resources.resources.begin_delete_by_id(r.id, api).result()
    say(f"deleted {len(delete)} resources; kept {len(keep)} holding data")
    return 0


def _api_version(azure: Azure, kind: str) -> str:
    template = json.loads(TEMPLATE.read_text())
    inner = template["resources"][-1]["properties"]["template"]["resources"]
    for r in inner:
        if r["type"].lower() == kind.lower():
            return str(r["apiVersion"])
    return "2025-04-01"


def main(
    argv: list[str] | None = None,
    *,
    credential: Any = None,
    transport: Any = None,
    ask: Callable[[str], str] = input,
) -> int:
    options = parser().parse_args(argv)
    azure = Azure(options.subscription, credential, transport)
    try:
        run = up if options.command == "up" else down
        return run(options, azure, print, ask)
    except SetupError as exc:
        print(f"azure {options.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
