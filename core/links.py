"""The links a run writes to its outputs, and where the outputs gateway that answers them
listens: decided here from ``output.links_url`` for the steps that write links, the gateway and
``make service`` alike, so the links and the server agree. Plain URL arithmetic: a step builds a
link without importing the web server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from core.config import OutputLocation

DEFAULT_PORT = 4280


def listen_address(
    links_url: str | None, host: str | None = None, port: int | None = None
) -> tuple[str, int]:
    """Where the gateway listens: as asked, else where ``links_url`` says when that is this
    machine's loopback (anything else is a proxy in front of it), else loopback:4280."""
    parts = urlsplit(links_url or "")
    local = parts.hostname in ("127.0.0.1", "localhost", "::1")
    default_port = (parts.port or (443 if parts.scheme == "https" else 80)) if local else None
    return host or (parts.hostname if local and parts.hostname else "127.0.0.1"), (
        port or default_port or DEFAULT_PORT
    )


class Addressed(Protocol):
    """What a link is built from: a storage client's address (a Blob ``ContainerClient``)."""

    @property
    def url(self) -> str: ...


def blob_link(container: Addressed, name: str = "") -> str:
    """The address of a blob (of the container itself for ``name=""``), with no credential in it.

    A client made from a SAS connection string carries the token in its ``url``; links end up in
    logs, artifacts and the Prefect database, so they are built from the account URL, the
    container and the blob path alone (and a path appended to a URL with a query is broken).
    """
    parts = urlsplit(container.url)
    path = parts.path.rstrip("/") + (f"/{quote(name.strip('/'))}" if name.strip("/") else "")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def output_link(location: OutputLocation, container: Addressed, name: str) -> str:
    """The address people open for the blob ``name`` (a folder when it ends with ``/``): the
    gateway's when ``links_url`` is set and the blob is below ``prefix`` (all the gateway
    serves), else the blob's own (which needs a sign-in)."""
    relative = name.strip("/")
    base = location.prefix.strip("/")
    below = not base or relative == base or relative.startswith(f"{base}/")
    if not location.links_url or not below:
        # A gateway link to a blob outside the prefix would open prefix/<name>: another file.
        return blob_link(container, name)
    relative = relative[len(base) :].lstrip("/")
    folder = name.endswith("/") and relative
    return f"{location.links_url}/{quote(relative)}{'/' if folder else ''}"
