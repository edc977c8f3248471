"""A task's SAS signed with a user delegation key when the orchestrator holds no account key
(Entra ID): the key is asked of the container's own account, with the container's token, over
TLS (the SDK sends a bearer token over nothing else), from a loopback endpoint that answers as
the Blob service's Get User Delegation Key does."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from azure.core.credentials import AccessToken
from azure.storage.blob import ContainerClient

from backends.azure.access import _container_sas
from staging.blob import API_VERSION

KEY_ANSWER = (
    '<?xml version="1.0" encoding="utf-8"?><UserDelegationKey>'
    "<SignedOid>11111111-2222-3333-4444-555555555555</SignedOid>"
    "<SignedTid>66666666-7777-8888-9999-000000000000</SignedTid>"
    "<SignedStart>2026-11-29T00:00:00Z</SignedStart><SignedExpiry>2026-11-29T04:00:00Z</SignedExpiry>"
    f"<SignedService>b</SignedService><SignedVersion>{API_VERSION}</SignedVersion>"
    "<Value>ZGVsZWdhdGlvbi1rZXktdmFsdWUtMzItYnl0ZXMtbG9uZyE=</Value></UserDelegationKey>"
).encode()


class Token:
    """An Entra ID credential as azure-identity's are: a token for the scope asked."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes += scopes
        return AccessToken("token-for-storage", int(time.time()) + 3600)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "host.pem", folder / "host.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
def blob_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list]]:
    """The endpoint on loopback over TLS, its certificate trusted through the variable requests
    reads; yields its port and each request's (method, path, query, Authorization)."""
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    seen: list[tuple[str, str, dict[str, list[str]], str]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(("POST", url.path, parse_qs(url.query), self.headers["Authorization"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(KEY_ANSWER)))
            self.end_headers()
            self.wfile.write(KEY_ANSWER)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port, seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.processes
def test_without_an_account_key_the_sas_is_signed_with_a_delegation_key_of_the_account(
    blob_service: tuple[int, list],
) -> None:
    port, seen = blob_service
    token = Token()
    container = ContainerClient(
        f"https://127.0.0.1:{port}/devstoreaccount1",
        "data",
        credential=token,
        api_version=API_VERSION,
    )
    start = datetime.datetime.now(datetime.UTC)
    sas = _container_sas(
        container, start, start + datetime.timedelta(hours=2), read=True, list=True
    )
    ((method, path, query, authorization),) = seen
    assert (method, path) == ("POST", "/devstoreaccount1/")  # the account, not the container
    assert query["restype"] == ["service"] and query["comp"] == ["userdelegationkey"]
    assert authorization == "Bearer token-for-storage"
    assert token.scopes == ["https://storage.azure.com/.default"]
    fields = parse_qs(sas)
    assert fields["skoid"] == ["11111111-2222-3333-4444-555555555555"]
    assert fields["sr"] == ["c"] and fields["sp"] == ["rl"] and fields["spr"] == ["https"]
    assert fields["sig"] and "token-for-storage" not in sas
