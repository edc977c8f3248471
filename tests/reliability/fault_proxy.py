"""An HTTP proxy in front of Azurite that injects the faults storage clients meet on Azure.

At a configurable rate, per request, chosen with a seeded RNG:
- ``reset``: the connection is closed before the request is forwarded;
- ``503``: ServerBusy with Retry-After, not forwarded;
- ``slow``: forwarded, answered after a delay;
- ``truncate``: forwarded, the answer cut off halfway through its body (downloads);
- ``lost``: forwarded (so the write happened), the connection closed before the answer.
``cut_after`` makes every request after the first N successful blob GETs fail, to interrupt a
sync midway. Counters say what was injected and which blobs were served in full.
``before_get``, when set, is called with the path and headers of each blob GET before it is
forwarded: to see what a client asks for, or to change a blob between two of its requests.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import unquote, urlparse

FAULTS = ("reset", "503", "slow", "truncate", "lost")


class FaultProxy:
    def __init__(
        self,
        target_port: int,
        rate: float = 0.0,
        seed: int = 0,
        faults: tuple[str, ...] = FAULTS,
        slow_seconds: float = 0.3,
    ) -> None:
        self.target_port, self.rate, self.faults = target_port, rate, faults
        self.slow_seconds = slow_seconds
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.served_gets: Counter[str] = Counter()  # blob path -> complete GET answers
        self.requests = 0
        self.cut_after: int | None = None
        self.before_get: Callable[[str, dict[str, str]], None] | None = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._handle(self)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def connection_string(self, account: str, key: str) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{account};"
        )

    def _choose(self, method: str) -> str | None:
        with self._lock:
            self.requests += 1
            if self.cut_after is not None and sum(self.served_gets.values()) >= self.cut_after:
                self.injected["cut"] += 1
                return "reset"
            if self.rng.random() >= self.rate:
                return None
            fault = self.rng.choice(self.faults)
            if fault == "truncate" and method != "GET":
                fault = "reset"
            self.injected[fault] += 1
            return fault

    def _handle(self, h: socketserver.StreamRequestHandler) -> None:
        request_line = h.rfile.readline().decode("latin-1").strip()
        if not request_line:
            return
        method, target, _ = request_line.split(" ", 2)
        headers: list[tuple[str, str]] = []
        while (line := h.rfile.readline().decode("latin-1")) not in ("\r\n", "\n", ""):
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        body = h.rfile.read(length) if length else b""
        if self.before_get and method == "GET" and "comp=" not in target:
            self.before_get(unquote(urlparse(target).path), {k.lower(): v for k, v in headers})
        fault = self._choose(method)
        if fault == "reset":
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "503":
            h.wfile.write(
                b"HTTP/1.1 503 Server Busy\r\nx-ms-error-code: ServerBusy\r\n"
                b"Retry-After: 0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=60)
        forward = {k: v for k, v in headers if k.lower() not in ("connection", "host")}
        forward["Host"] = f"127.0.0.1:{self.target_port}"
        upstream.request(method, target, body=body, headers=forward)
        answer = upstream.getresponse()
        data = answer.read()
        upstream.close()
        if fault == "lost":
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "slow":
            time.sleep(self.slow_seconds)
        out = [f"HTTP/1.1 {answer.status} {answer.reason}"]
        for k, v in answer.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                out.append(f"{k}: {v}")
        # A HEAD's answer has no body but the Content-Length of the GET it stands for.
        length_out = answer.getheader("Content-Length", "0") if method == "HEAD" else len(data)
        out += [f"Content-Length: {length_out}", "Connection: close", "", ""]
        h.wfile.write("\r\n".join(out).encode("latin-1"))
        if fault == "truncate" and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(data)
        if method == "GET" and answer.status in (200, 206) and "comp=" not in target:
            with self._lock:
                self.served_gets[unquote(urlparse(target).path)] += 1
