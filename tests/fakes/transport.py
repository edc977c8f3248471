"""Route the real SDK clients to in-process fake services through their HTTP transport.

A requests adapter hands each request whose host belongs to a fake to that fake's handler and
sends everything else (Azurite) over the network as usual. The SDKs build, sign and serialize
their requests exactly as for Azure; only the socket is replaced.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import requests
from azure.core.credentials import AccessToken, AccessTokenInfo
from azure.core.pipeline.transport import RequestsTransport
from requests.adapters import BaseAdapter, HTTPAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.response import HTTPResponse


@dataclass
class Request:
    method: str
    host: str
    path: str  # unquoted
    query: dict[str, str]
    headers: CaseInsensitiveDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class Response:
    status: int
    body: bytes | str | dict[str, Any] | list[Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


def _read_body(body: Any) -> bytes:
    if body is None:
        return b""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    if hasattr(body, "read"):
        return bytes(body.read())
    return b"".join(bytes(chunk) for chunk in body)


class FakeServiceAdapter(BaseAdapter):
    def __init__(self, services: dict[str, Handler]) -> None:
        super().__init__()
        self.services = services
        self.network = HTTPAdapter()

    def send(self, request: Any, stream: bool = False, **kwargs: Any) -> requests.Response:
        url = urlparse(request.url)
        handler = self.services.get(url.hostname or "")
        if handler is None:
            return self.network.send(request, stream=stream, **kwargs)
        fake = Request(
            request.method,
            url.hostname or "",
            unquote(url.path),
            {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()},
            CaseInsensitiveDict(request.headers),
            _read_body(request.body),
        )
        answer = handler(fake)
        body = answer.body
        headers = dict(answer.headers)
        if isinstance(body, dict | list):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json; odata=minimalmetadata")
        elif isinstance(body, str):
            body = body.encode()
        content = body or b""
        if request.method == "HEAD":  # a HEAD answer has headers only, errors included
            content = b""
        else:
            headers.setdefault("Content-Length", str(len(content)))
        headers.setdefault("x-ms-request-id", "00000000-0000-0000-0000-000000000000")
        headers.setdefault("Date", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()))
        response = requests.Response()
        response.status_code = answer.status
        response.headers = CaseInsensitiveDict(headers)
        response.raw = HTTPResponse(
            body=io.BytesIO(content),
            headers=headers,
            status=answer.status,
            preload_content=False,
            request_method=request.method,
        )
        response.url = request.url
        response.request = request
        response.reason = "OK" if answer.status < 400 else "Error"
        response.encoding = "utf-8"
        return response

    def close(self) -> None:
        self.network.close()


class FakeCredential:
    """A TokenCredential: the fakes check that a bearer token arrives, not who signed it."""

    token = "fake-entra-token"

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self.token, int(time.time()) + 3600)

    def get_token_info(self, *scopes: str, options: Any = None) -> AccessTokenInfo:
        return AccessTokenInfo(self.token, int(time.time()) + 3600)


def transport_factory(services: dict[str, Handler]) -> Callable[[], RequestsTransport]:
    def make() -> RequestsTransport:
        session = requests.Session()
        adapter = FakeServiceAdapter(services)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return RequestsTransport(session=session, session_owner=True)

    return make


class Recorder:
    """The requests a fake received, in order, safe to read from the test thread."""

    def __init__(self) -> None:
        self._items: list[Request] = []
        self._lock = threading.Lock()

    def add(self, request: Request) -> None:
        with self._lock:
            self._items.append(request)

    def all(self) -> list[Request]:
        with self._lock:
            return list(self._items)

    def find(self, method: str, path: str) -> list[Request]:
        return [r for r in self.all() if r.method == method and r.path == path]
