"""The outputs gateway (``python -m cli.models serve``): the links a run writes open, carry no
signature, and nothing outside the served prefix can be reached, however the path is spelt or
whichever web page sends the request. Against Azurite, over real HTTP."""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import socket
import subprocess
import sys
import threading
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient, ContentSettings

from backends.blob import container_client
from backends.local.ports import free_port
from core.config import ConfigError, OutputLocation, load_config
from core.links import output_link
from servers.gateway import serve

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"
INDEX = b'<html><a href="validations/run.html">run</a><link href="static/style.css"></html>'


def _get(
    port: int, path: str, method: str = "GET", host: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One raw request: http.client sends the path exactly as given (no normalising)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Host": host} if host else {}
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


@pytest.fixture
def outputs(azurite: str, monkeypatch: pytest.MonkeyPatch) -> ContainerClient:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    location = OutputLocation(container=f"gw-{uuid.uuid4().hex[:10]}")
    return container_client(location, create=True)


def _seed(container: ContainerClient, base: str) -> dict[str, bytes]:
    files = {
        "runs/r1/model.pt": os.urandom(300_000),
        "runs/r1/score.json": b'{"accuracy": 0.9}',
        "runs/r1/logs/std out.txt": b"epoch 1 of 1\n",
        "runs/r1/data_docs/index.html": INDEX,
        "runs/r1/data_docs/validations/run.html": b"<html>validation</html>",
    }
    for name, data in files.items():
        container.upload_blob(f"{base}/{name}".lstrip("/"), data)
    return files


@pytest.fixture
def gateway(outputs: ContainerClient) -> Iterator[tuple[int, dict[str, bytes]]]:
    """An in-process gateway over ``team/a``; ``team/b`` beside it holds what must stay out."""
    files = _seed(outputs, "team/a")
    outputs.upload_blob("team/b/secret.txt", b"not yours")
    outputs.upload_blob("team/a-secret.txt", b"not yours either")
    server = serve(outputs, "team/a", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1]), files
    server.shutdown()
    server.server_close()


def test_the_cli_serves_every_link_a_run_writes(outputs: ContainerClient) -> None:
    files = _seed(outputs, "")
    port = free_port()
    links_url = f"http://127.0.0.1:{port}"
    overrides = [f"output.container={outputs.container_name}", f"output.links_url={links_url}"]
    config = load_config(LOCAL, overrides)
    sets = [arg for o in overrides for arg in ("--set", o)]
    process = subprocess.Popen(
        [sys.executable, "-m", "cli.models", "--config", str(LOCAL), *sets, "serve"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert f"read-only at {links_url}/" in first, first + process.stdout.read()
        for name, data in files.items():
            link = output_link(config.output, outputs, name)
            assert link.startswith(f"{links_url}/runs/r1/") and "sig=" not in link
            status, headers, body = _get(port, link[len(links_url) :])
            assert (status, body) == (200, data), name
            assert headers["x-content-type-options"] == "nosniff"
            assert headers["content-security-policy"].startswith("sandbox")
        # Data Docs open as a page (uploads store no type), in an origin of their own, and
        # their relative links resolve below the same folder.
        page = output_link(config.output, outputs, "runs/r1/data_docs/index.html")
        status, headers, _ = _get(port, page[len(links_url) :])
        assert headers["content-type"].startswith("text/html")
        assert headers["content-security-policy"].startswith("sandbox")
        status, _, body = _get(port, "/runs/r1/data_docs/validations/run.html")
        assert (status, body) == (200, b"<html>validation</html>")
        # HEAD: the length, no body.
        status, headers, body = _get(port, "/runs/r1/model.pt", "HEAD")
        assert (status, headers["content-length"], body) == (200, "300000", b"")
        # The run's folder: a page of relative links; without its slash, sent to it.
        folder = output_link(config.output, outputs, "runs/r1/")
        assert folder == f"{links_url}/runs/r1/"
        status, _, body = _get(port, "/runs/r1/")
        assert status == 200
        assert b'href="model.pt"' in body and b'href="logs/"' in body
        status, headers, _ = _get(port, "/runs/r1")
        assert (status, headers["location"]) == (301, "/runs/r1/")
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    "path",
    [
        "/../b/secret.txt",
        "/%2e%2e/b/secret.txt",
        "/%2E%2E%2Fb%2Fsecret.txt",
        "/runs/../../b/secret.txt",
        "/runs/%2e%2e/%2e%2e/b/secret.txt",
        "/runs//r1/model.pt",
        "/./runs/r1/model.pt",
        "/..%5cb%5csecret.txt",
        "/runs/r1/model.pt%00.txt",
        "/%0d%0aSet-Cookie:x=1",
        # Azure drops a segment's trailing dots: "..." or "x." name some other blob there.
        "/.../b/secret.txt",
        "/%2e%2e%2e/b/secret.txt",
        "/runs./r1/model.pt",
        "/runs/r1/model.pt.",
    ],
)
def test_no_spelling_of_a_path_leaves_the_prefix(
    gateway: tuple[int, dict[str, bytes]], path: str
) -> None:
    port, _ = gateway
    status, _, body = _get(port, path)
    assert status == 400, (status, body)
    assert b"not yours" not in body


def test_only_the_served_prefix_and_its_own_host_names(
    gateway: tuple[int, dict[str, bytes]],
) -> None:
    port, files = gateway
    assert _get(port, "/runs/r1/model.pt")[2] == files["runs/r1/model.pt"]
    # A blob beside the prefix that shares its first letters is not below it.
    assert _get(port, "-secret.txt")[0] == 400
    assert _get(port, "/-secret.txt")[0] == 404
    assert _get(port, "/runs/none.txt")[0] == 404
    # http.server folds a leading "//" into "/": still below the prefix (team/a/b/...).
    assert _get(port, "//b/secret.txt")[:3:2] == (404, b"no such output\n")
    root = _get(port, "/")
    assert root[0] == 200 and b'href="runs/"' in root[2] and b"secret" not in root[2]
    # A page elsewhere that resolves its own name to 127.0.0.1 (DNS rebinding) is refused.
    status, _, body = _get(port, "/runs/r1/score.json", host=f"attacker.example:{port}")
    assert status == 421 and b"accuracy" not in body
    assert _get(port, "/runs/r1/score.json", host=f"localhost:{port}")[0] == 200
    # Read-only: nothing but GET and HEAD.
    for method in ("PUT", "DELETE", "POST"):
        assert _get(port, "/runs/r1/model.pt", method)[0] == 501


def test_a_proxy_on_a_default_port_is_answered(outputs: ContainerClient) -> None:
    """links_url may spell the scheme's default port; browsers then send the host alone."""
    outputs.upload_blob("team/a/score.json", b"{}")
    server = serve(outputs, "team/a", "127.0.0.1", 0, "https://Outputs.example.com:443")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])
    try:
        for host in ("outputs.example.com", "outputs.example.com:443", f"[::1]:{port}"):
            assert _get(port, "/score.json", host=host)[::2] == (200, b"{}"), host
        for host in ("outputs.example.com:80", "outputs.example.com.evil", "127.0.0.1"):
            assert _get(port, "/score.json", host=host)[0] == 421, host
    finally:
        server.shutdown()
        server.server_close()


def test_the_request_line_reaches_the_log_with_its_control_characters_escaped(
    gateway: tuple[int, dict[str, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """A terminal acts on escape sequences: a request line that carries them raw is refused
    by the HTTP layer before anything logs it, and a path that decodes to C1 controls is
    refused and logged escaped."""
    port, _ = gateway
    caplog.set_level(logging.INFO)
    for target in (b"/\x1b]0;owned\x07\x1b[2J", b"/runs/\xc2\x9b2J", b"/runs/%C2%9B2J"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET " + target + f" HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert sock.recv(4096).startswith(b"HTTP/1.1 400"), target
    logged = "".join(record.getMessage() for record in caplog.records)
    assert "GET /runs/%C2%9B2J 400" in logged
    assert not any(unicodedata.category(c) == "Cc" for c in logged), repr(logged)


def test_a_storage_failure_is_named_without_its_request(outputs: ContainerClient) -> None:
    """Blob storage refusing (here: a container that was deleted under the gateway) answers
    502 with the error's kind only; the storage request (which could carry a SAS) stays out."""
    outputs.upload_blob("x.txt", b"x")
    server = serve(outputs, "", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outputs.delete_container()
        status, _, body = _get(int(server.server_address[1]), "/")
        assert status in (404, 502)
        assert b"devstoreaccount1" not in body and b"http" not in body
    finally:
        server.shutdown()
        server.server_close()


def test_a_compressed_blob_goes_out_as_stored(
    outputs: ContainerClient, gateway: tuple[int, dict[str, bytes]]
) -> None:
    """A blob written with Content-Encoding: gzip is sent compressed, with that encoding and
    its stored length (decompressed, it would overrun the length announced and be cut short)."""
    port, _ = gateway
    packed = gzip.compress(b"epoch 1 of 1: loss 0.5\n" * 400)
    settings = ContentSettings(content_type="text/plain", content_encoding="gzip")
    outputs.upload_blob("team/a/runs/r1/logs/train.log", packed, content_settings=settings)
    for method in ("GET", "HEAD"):
        status, headers, body = _get(port, "/runs/r1/logs/train.log", method)
        assert (status, headers["content-length"]) == (200, str(len(packed))), method
        assert headers["content-encoding"] == "gzip", method
        assert body == (packed if method == "GET" else b"")


def test_a_blob_deleted_while_it_streams_cuts_the_download_short(
    azurite: str, outputs: ContainerClient
) -> None:
    """Once the status line and length are out, a storage failure closes the connection short
    of that length (the client sees a failed download) instead of writing an error answer
    into the file."""
    data = os.urandom(12 * 1024 * 1024)
    outputs.upload_blob("big/model.pt", data)
    # Small ranges, so the rest of the blob is still to be fetched when it is deleted.
    ranged = ContainerClient.from_connection_string(
        azurite, outputs.container_name, max_single_get_size=65536, max_chunk_get_size=65536
    )
    server = serve(ranged, "big", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            # A small receive window: the gateway can only run a few MiB ahead of the reader.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET /model.pt HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            received = sock.recv(4096)
            outputs.delete_blob("big/model.pt")
            while chunk := sock.recv(1 << 20):
                received += chunk
    finally:
        server.shutdown()
        server.server_close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and f"content-length: {len(data)}".encode() in head
    assert len(body) < len(data)
    assert body == data[: len(body)], "no error answer inside the file"


def test_links_without_a_gateway_are_plain_blob_addresses(outputs: ContainerClient) -> None:
    location = OutputLocation(container=outputs.container_name, prefix="team/a")
    link = output_link(location, outputs, "team/a/runs/r1/logs/std out.txt")
    assert link == f"{outputs.url}/team/a/runs/r1/logs/std%20out.txt"
    gated = location.model_copy(update={"links_url": "https://outputs.example.com"})
    assert (
        output_link(gated, outputs, "team/a/runs/r1/logs/std out.txt")
        == "https://outputs.example.com/runs/r1/logs/std%20out.txt"
    )
    # The gateway serves the prefix only: a blob beside it (another prefix's run, named in a
    # record the container shares) keeps its own address rather than open prefix/<its name>.
    for outside in ("team/b/runs/r1/model.pt", "team/ab/runs/r1/model.pt"):
        assert output_link(gated, outputs, outside) == f"{outputs.url}/{outside}"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("http://127.0.0.1:4280/?sig=abc", "must have no query"),
        ("https://user:pw@outputs.example.com", "must have no user or password"),
        ("ftp://outputs.example.com", "must be an http(s) URL"),
        ("127.0.0.1:4280", "must be an http(s) URL"),
        ("http://127.0.0.1:4280/outputs", "must have no path"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://out\tputs.example.com", "no spaces or control characters"),
        ("http://127.0.0.1:4280/a\nb", "no spaces or control characters"),
    ],
)
def test_links_url_takes_an_address_only(value: str, why: str) -> None:
    """Links are stored in artifacts, so the field refuses anything that could carry a secret."""
    with pytest.raises(ConfigError) as caught:
        load_config(LOCAL, [f"output.links_url={value}"])
    assert "output.links_url" in str(caught.value) and why in str(caught.value)


def test_a_request_that_never_ends_is_dropped(outputs: ContainerClient) -> None:
    """A client that sends half a request line and waits: its connection is closed after the
    request timeout instead of holding a server thread for good."""
    server = serve(outputs, "", "127.0.0.1", 0, request_timeout=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as client:
            client.settimeout(20)  # far past the server's: the test fails if it never closes
            client.sendall(b"GET /x")
            assert client.recv(1024) == b""
    finally:
        server.shutdown()
        server.server_close()


def test_a_loopback_ipv6_links_url_is_served(outputs: ContainerClient) -> None:
    outputs.upload_blob("runs/r1/score.json", b'{"accuracy": 0.9}')
    server = serve(outputs, "", "::1", 0, links_url="http://[::1]:4280")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        conn = http.client.HTTPConnection("::1", port, timeout=30)
        conn.request("GET", "/runs/r1/score.json", headers={"Host": f"[::1]:{port}"})
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b'{"accuracy": 0.9}')
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_outputs_go_out_with_the_type_of_what_they_are(outputs: ContainerClient) -> None:
    """By the outputs' own table, not the machine's /etc/mime.types (which named the model a
    Super NES page table, application/vnd.snesdev-page-table, and may not know web fonts)."""
    expected = {
        "runs/r1/model.pt": "application/octet-stream",
        "runs/r1/metrics.json": "application/json",
        "runs/r1/logs/stdout.txt": "text/plain; charset=utf-8",
        "runs/r1/tensorboard/events.out.tfevents.1700000000.node": "application/octet-stream",
        "runs/r1/data_docs/index.html": "text/html; charset=utf-8",
        "runs/r1/data_docs/static/vendor/x/css/all.min.css": "text/css; charset=utf-8",
        "runs/r1/data_docs/static/vendor/x/jquery.min.js": "text/javascript; charset=utf-8",
        "runs/r1/data_docs/static/vendor/x/webfonts/fa-solid-900.woff2": "font/woff2",
        "runs/r1/data_docs/static/vendor/x/webfonts/fa-solid-900.ttf": "font/ttf",
        "runs/r1/data_docs/static/images/favicon.ico": "image/vnd.microsoft.icon",
    }
    for name in expected:  # as the flow uploads them: no type of their own
        outputs.upload_blob(name, b"x")
    outputs.upload_blob(  # a type stored with the blob is kept
        "runs/r1/charts/curves.png", b"x", content_settings=ContentSettings("image/png")
    )
    expected["runs/r1/charts/curves.png"] = "image/png"
    server = serve(outputs, "", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = int(server.server_address[1])
        for name, kind in expected.items():
            status, headers, _ = _get(port, f"/{name}", host=f"127.0.0.1:{port}")
            assert (status, headers["content-type"]) == (200, kind), name
    finally:
        server.shutdown()
        server.server_close()


def test_a_second_request_that_never_ends_is_dropped(outputs: ContainerClient) -> None:
    """The deadline holds for every request of a kept-alive connection, not only its first:
    after an answer, half of a next request and a wait close it too."""
    outputs.upload_blob("runs/r1/score.json", b'{"accuracy": 0.9}')
    server = serve(outputs, "", "127.0.0.1", 0, request_timeout=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.settimeout(20)  # far past the server's: the test fails if it never closes
            client.sendall(
                f"GET /runs/r1/score.json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
            )
            answer = b""
            while not answer.endswith(b'{"accuracy": 0.9}'):
                answer += client.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            client.sendall(b"GET /runs/r1/sco")
            assert client.recv(1024) == b""
    finally:
        server.shutdown()
        server.server_close()


def test_a_gateway_with_a_credential_answers_only_requests_that_carry_it(
    outputs: ContainerClient, caplog: pytest.LogCaptureFixture
) -> None:
    """make service gives its gateway a credential: another local user without it gets 401
    (a browser asks the person once); the Data Docs' static assets excepted, which a sandboxed
    page loads without the browser's kept credentials, and no spelling of a path reaches
    anything else through that exception."""
    import base64

    caplog.set_level(logging.INFO)
    outputs.upload_blob("runs/r1/score.json", b'{"accuracy": 0.9}')
    outputs.upload_blob("runs/r1/data_docs/static/vendor/jquery.min.js", b"/* jquery */")
    server = serve(outputs, "", "127.0.0.1", 0, credential="retrain:pass-word_1")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])

    def get(path: str, token: str | None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", path, headers={"Authorization": token} if token else {})
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body

    right = "Basic " + base64.b64encode(b"retrain:pass-word_1").decode()
    try:
        status, headers, _ = get("/runs/r1/score.json", None)
        assert status == 401 and headers["www-authenticate"].startswith('Basic realm="')
        for wrong in (
            "Basic " + base64.b64encode(b"retrain:pass-word_2").decode(),
            "Basic not base64!",
            "Bearer retrain:pass-word_1",
            right.replace("Basic ", "Basic  x"),
        ):
            assert get("/runs/r1/score.json", wrong)[0] == 401, wrong
        assert get("/runs/r1/score.json", right)[::2] == (200, b'{"accuracy": 0.9}')
        assert get("/runs/r1/score.json", right.replace("Basic", "basic"))[0] == 200
        # The assets a sandboxed Data Docs page loads: open; their folder and the rest: not.
        asset = "/runs/r1/data_docs/static/vendor/jquery.min.js"
        assert get(asset, None)[::2] == (200, b"/* jquery */")
        assert get("/runs/r1/data_docs/static/vendor/", None)[0] == 401
        for sneaky in (
            "/runs/r1/data_docs/static/../../score.json",
            "/runs/r1/data_docs/static/%2e%2e/%2e%2e/score.json",
            "/runs/r1/data_docs/static//../../score.json",
        ):
            assert get(sneaky, None)[0] == 400, sneaky
    finally:
        server.shutdown()
        server.server_close()
    logged = "".join(record.getMessage() for record in caplog.records)
    assert "pass-word_1" not in logged and "GET /runs/r1/score.json 401" in logged
