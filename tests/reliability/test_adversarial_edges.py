"""Smaller edges of the service: the demo's scratch data, the outputs gateway's answers that
its HTTP server writes itself, a HEAD of a large folder, and the relay's first token check.

(A ``links_url`` with a path, whose links all answered 404, is refused at load:
test_adversarial_run_config.py and tests/servers/test_gateway.py.)"""

from __future__ import annotations

import functools
import http.server
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from azure.storage.blob import ContainerClient

from servers.gateway import SAFETY_HEADERS, serve
from tests.reliability import report

# ---------------------------------------------------------------- the demo's scratch data


def test_a_stale_demo_dataset_without_train_is_written_again(tmp_path: Path) -> None:
    """Before: a .demo/digits without train/ (an older demo's layout, or a write cut short)
    made `make demo` and `make azurite` end in an OSError traceback (rename onto a folder)."""
    from scripts.demo import dataset

    demo = tmp_path / ".demo"
    (demo / "digits" / "test" / "digit_0").mkdir(parents=True)
    (demo / "digits" / "test" / "digit_0" / "0.png").write_bytes(b"old")
    (demo / "digits.tmp" / "train").mkdir(parents=True)  # an interrupted write
    source = dataset(demo)
    assert source == demo / "digits"
    classes = sorted(p.name for p in (source / "train").iterdir())
    assert len(classes) == 10 and (source / "test").is_dir()
    assert not (demo / "digits.tmp").exists()
    assert dataset(demo) == source  # written once: a complete one is kept as it is
    report.record(
        "inputs",
        ".demo/digits without train/ (and a digits.tmp left by an interrupted write)",
        "written again, no traceback",
    )


# ---------------------------------------------------------------- the outputs gateway


@pytest.fixture
def outputs(azurite: str) -> ContainerClient:
    container = ContainerClient.from_connection_string(azurite, f"edge-{uuid.uuid4().hex[:10]}")
    container.create_container()
    return container


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request written byte for byte (the HTTP server answers a malformed one itself);
    the status, headers and the body the server sent before it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head)
            if _ and length and len(body) >= int(length.group(1)):
                break
    raw_head, _, body = data.partition(b"\r\n\r\n")
    head = raw_head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize(
    ("case", "request_bytes", "status"),
    [
        ("a method it does not serve", b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 501),
        (
            "a control character in the request line",
            b"GET /\x1b[2J HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            400,
        ),
        ("a request without a Host header", b"GET / HTTP/1.1\r\n\r\n", 400),
        ("a request line over 64 KB", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 400),
        (
            "a header line over 64 KB",
            b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n",
            421,
        ),
        (
            "more than 100 headers",
            b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n",
            400,
        ),
    ],
)
def test_http_servers_own_answers_carry_the_gateways_headers(
    case: str, request_bytes: bytes, status: int, outputs: ContainerClient
) -> None:
    """Before (under http.server): the error pages it wrote itself went out without nosniff,
    the sandbox policy, no-store and no-referrer. Every answer of the gateway's application
    carries them. A request uvicorn cannot parse is answered by uvicorn itself (through no
    public setting that adds headers): its fixed text, declared text/plain, with nothing of
    the request in it, so there is nothing for a browser to run or sniff."""
    server = serve(outputs, "", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got, headers, body = _raw(int(server.server_address[1]), request_bytes)
    finally:
        server.shutdown()
        server.server_close()
    assert got == status
    if status == 400:
        assert headers.get("content-type") == "text/plain; charset=utf-8", (case, headers)
        assert body == b"Invalid HTTP request received.", (case, body)
        said = "uvicorn's fixed text/plain answer, nothing of the request echoed"
    else:
        for header, value in SAFETY_HEADERS.items():
            assert headers.get(header.lower()) == value, (case, headers)
        said = "the answer carries nosniff, the sandbox policy, no-store and no-referrer"
    report.record("adversarial", f"gateway: {case} (answered {status})", said)


def test_head_of_a_large_folder_lists_one_entry(outputs: ContainerClient, azurite: str) -> None:
    """Before: HEAD of a folder built its whole listing page (every entry read from storage)
    to send no body. The entries the gateway's storage client receives are counted."""
    names = [f"runs/r1/logs/part-{i:03d}.txt" for i in range(120)]
    for name in names:
        outputs.upload_blob(name, b"x")
    entries: list[int] = []

    def count(pipeline: Any) -> None:
        response = pipeline.http_response
        if "comp=list" in response.request.url:
            entries.append(response.text().count("<Name>"))

    watched = ContainerClient.from_connection_string(
        azurite, outputs.container_name, raw_response_hook=count
    )
    server = serve(watched, "", "127.0.0.1", 0)
    port = int(server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        head = requests.head(f"http://127.0.0.1:{port}/runs/r1/logs/", timeout=30)
        read_for_head = sum(entries)
        missing = requests.head(f"http://127.0.0.1:{port}/runs/r9/", timeout=30)
        entries.clear()
        page = requests.get(f"http://127.0.0.1:{port}/runs/r1/logs/", timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/html")
    assert head.headers["x-content-type-options"] == "nosniff"
    assert read_for_head <= 1, read_for_head
    assert missing.status_code == 404
    assert page.status_code == 200 and page.text.count(">part-") == 120 and sum(entries) >= 120
    report.record(
        "adversarial",
        "gateway: HEAD of a folder of 120 files",
        "200 from one listing entry (GET still lists all 120); a missing folder 404",
        entries_read=read_for_head,
    )


# ---------------------------------------------------------------- the relay's token check


@pytest.fixture
def held_keys(tmp_path: Path) -> Iterator[tuple[str, Any, dict[str, threading.Event]]]:
    """A tenant's signing keys served by a server that holds its answer until released (or
    20 s, less than the key client's own 30 s timeout), as a slow identity platform would."""
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig"}]}))
    events = {name: threading.Event() for name in ("asked", "release", "answered")}

    class Held(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            events["asked"].set()
            events["release"].wait(20)
            super().do_GET()
            events["answered"].set()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Held, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/keys.json", key, events
    finally:
        events["release"].set()
        server.shutdown()
        server.server_close()


@pytest.mark.processes
def test_the_relay_answers_others_while_it_fetches_signing_keys(
    held_keys: tuple[str, Any, dict[str, threading.Event]],
) -> None:
    """Before: the first bearer token made the relay fetch the tenant's keys on its event loop
    (about 0.8 s against Entra; as long as the key server takes, at worst): no other delivery,
    handshake or health check was answered meanwhile. Here the key server holds its answer, and
    a health check must be answered while it still does."""
    import jwt

    from core.data_versions import DataRoot
    from servers.relay import RelaySettings
    from tests.deployments.test_deployments import _eg_event, serving_relay

    url, key, events = held_keys
    tenant = "11111111-2222-3333-4444-555555555555"
    settings = RelaySettings(
        watches=[DataRoot("landing", "images")],
        entra_audience="api://retrain-relay",
        entra_tenant=tenant,
        jwks_url=url,
    )
    claims = {
        "aud": "api://retrain-relay",
        "iss": f"https://login.microsoftonline.com/{tenant}/v2.0",
        "exp": int(time.time()) + 600,
    }
    token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})
    outcome: dict[str, Any] = {}
    with serving_relay(settings) as (events_url, _):
        health_url = events_url.replace("/events", "/health")

        def deliver() -> None:
            outcome["reply"] = requests.post(
                events_url,
                json=[_eg_event("landing", "images/other/file.png", "0xA")],
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            )

        sender = threading.Thread(target=deliver)
        sender.start()
        assert events["asked"].wait(60), "the relay never asked for the signing keys"
        health = requests.get(health_url, timeout=120)
        held = not events["answered"].is_set()
        events["release"].set()
        sender.join(timeout=120)
    assert health.status_code == 200
    assert held, "the health check was answered only once the signing keys had arrived"
    assert outcome["reply"].status_code == 200  # the token itself was good
    report.record(
        "adversarial",
        "relay: a bearer token while the tenant's signing keys are slow to arrive",
        "other requests answered meanwhile (the check runs off the event loop); the token "
        "accepted once the keys arrive",
    )
