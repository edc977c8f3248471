"""The relay's shared secret and its request's query string, at the ASGI layer."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.parametrize(
    "query",
    [
        "key=S",
        "KEY=S",
        "Key=S",
        "x=1;key=S",
        "k%65y=S",
        "key=S&key=S",
        "x=S",
        "key",
        "%ZZ=S",
    ],
)
def test_no_spelling_of_the_relay_query_reaches_the_access_log(query: str) -> None:
    """What an access log prints of a request is the scope's query string: whatever a sender
    put there (the secret under any name, case or separator) is replaced before any code of the
    relay or the server sees it; the authenticator gets the value of ``key`` as it was."""
    from servers.relay import _hide_key

    seen: list[dict[str, object]] = []

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        seen.append(scope)

    secret = "S3cretValue"
    scope = {"type": "http", "query_string": query.replace("S", secret).encode()}
    asyncio.run(_hide_key(app)(scope, None, None))
    assert secret.encode() not in seen[0]["query_string"]  # type: ignore[operator]
    assert seen[0]["query_string"] == b"query=REDACTED"
    taken = seen[0].get("state", {}).get("relay_key")  # type: ignore[union-attr]
    assert taken == (secret if query.startswith(("key=", "k%65y=")) else None)
