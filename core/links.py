"""Where the outputs gateway listens: decided from ``output.links_url`` by the gateway and by
``make service`` alike, so the links a run writes and the server that answers them agree."""

from __future__ import annotations

from urllib.parse import urlsplit

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
