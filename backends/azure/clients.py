"""Azure SDK clients for a config, with credentials resolved here and nowhere else.

Entra ID (DefaultAzureCredential: managed identity on a worker VM, ``az login`` on a laptop) is
the default for everything. Keys are used only where the user names a Prefect Secret block that
holds one. ``route_through`` sends every client this module builds to another endpoint: it is how
the contract tests drive the real SDKs against fake services.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from core.config import AzureConfig, ShareConfig

if TYPE_CHECKING:
    from azure.batch import BatchClient
    from azure.containerregistry import ContainerRegistryClient
    from azure.core.credentials import TokenCredential
    from azure.mgmt.containerregistrytasks import ContainerRegistryTasksMgmtClient
    from azure.storage.blob import ContainerClient
    from azure.storage.fileshare import ShareServiceClient

ARM_URL = "https://management.azure.com"


@dataclass
class Route:
    """Where clients go instead of Azure: a transport factory and the credential to present."""

    transport: Callable[[], Any]
    credential: TokenCredential
    arm_url: str


_route: Route | None = None
_route_lock = threading.Lock()


@contextlib.contextmanager
def route_through(route: Route) -> Iterator[None]:
    global _route
    with _route_lock:
        previous, _route = _route, route
    try:
        yield
    finally:
        with _route_lock:
            _route = previous


def _transport() -> dict[str, Any]:
    return {"transport": _route.transport()} if _route else {}


def credential() -> TokenCredential:
    if _route:
        return _route.credential
    from azure.identity import DefaultAzureCredential

    return DefaultAzureCredential(exclude_interactive_browser_credential=True)


def secret(block_name: str) -> str:
    """A secret's value from a Prefect Secret block: it never passes through parameters."""
    from prefect.blocks.system import Secret

    value = Secret.load(block_name).get()  # type: ignore[union-attr]
    if not isinstance(value, str) or not value:
        raise ValueError(f"Prefect Secret block {block_name!r} holds no string value")
    return value


def account_name(url: str) -> str:
    """The first label of a service URL: <account>.blob.core.windows.net -> <account>."""
    host = urlparse(url).hostname or ""
    return host.split(".", 1)[0]


def batch_client(azure: AzureConfig) -> BatchClient:
    from azure.batch import BatchClient
    from azure.core.credentials import AzureNamedKeyCredential

    url = str(azure.batch_account_url)
    cred: Any = credential()
    if azure.batch_key_secret:
        cred = AzureNamedKeyCredential(account_name(url), secret(azure.batch_key_secret))
    return BatchClient(url, cred, **_transport())


def share_service(share: ShareConfig) -> ShareServiceClient:
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.storage.fileshare import ShareServiceClient

    url = str(share.account_url)
    if share.account_key_secret:
        key = AzureNamedKeyCredential(account_name(url), secret(share.account_key_secret))
        return ShareServiceClient(url, credential=key, **_transport())
    # Entra ID on the Files REST API requires the backup intent (RBAC: Storage File Data
    # Privileged Contributor).
    return ShareServiceClient(url, credential=credential(), token_intent="backup", **_transport())


def scripts_container(share: ShareConfig) -> ContainerClient:
    """The scripts' Blob container, as the orchestrator's identity (Storage Blob Data
    Contributor on that container)."""
    from azure.storage.blob import ContainerClient

    return ContainerClient(
        str(share.account_url), share.name, credential=credential(), **_transport()
    )


def acr_tasks_client(azure: AzureConfig) -> ContainerRegistryTasksMgmtClient:
    from azure.mgmt.containerregistrytasks import ContainerRegistryTasksMgmtClient

    return ContainerRegistryTasksMgmtClient(
        credential(),
        str(azure.subscription_id),
        base_url=_route.arm_url if _route else ARM_URL,
        **_transport(),
    )


def registry_client(login_server: str) -> ContainerRegistryClient:
    """``login_server``: <registry>.azurecr.io."""
    from azure.containerregistry import ContainerRegistryClient

    return ContainerRegistryClient(
        f"https://{login_server}",
        credential(),
        audience="https://containerregistry.azure.net",
        **_transport(),
    )
