"""A loopback TCP proxy that holds every HTTP request for a fixed delay before passing it on.

It stands in for the round trip to Blob storage in the region (a few milliseconds) in front of
Azurite, which answers on loopback in microseconds: a transfer tool that keeps few requests in
flight, or pays a round trip per file more than it must, shows it here as it would on Azure.

What counts as a request: on one connection, the first bytes the client sends after the server
has answered (HTTP/1.1 without pipelining, which is what every client benchmarked here speaks).
Those bytes, and the rest of that request, reach the server ``delay`` later; responses flow back
at once. It listens on 127.0.0.1 only and forwards only to a port on 127.0.0.1.

Runs as a process of its own (``python -m bench.delay_proxy --target PORT --delay-ms 10``), so
its CPU is not counted as the benchmarked client's; it prints its port on the first line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator

LOOPBACK = "127.0.0.1"
PIECE = 1 << 18


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: float,
    answered: list[bool],
    to_server: bool,
) -> None:
    try:
        while data := await reader.read(PIECE):
            if to_server:
                if answered[0]:  # the first bytes of a new request on this connection
                    answered[0] = False
                    await asyncio.sleep(delay)
            else:
                answered[0] = True
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(target: int, delay: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(LOOPBACK, target)
        except OSError:
            client_w.close()
            return
        answered = [True]  # the connection's first bytes are a request too
        await asyncio.gather(
            _pipe(client_r, server_w, delay, answered, True),
            _pipe(server_r, client_w, delay, answered, False),
        )

    server = await asyncio.start_server(handle, LOOPBACK, 0, limit=PIECE, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def delayed(target: int, delay_ms: float) -> Iterator[int]:
    """A proxy process in front of loopback port ``target``; yields its port. With no delay
    it yields ``target`` itself: the direct path, no proxy in the way."""
    if not delay_ms:
        yield target
        return
    command = [sys.executable, "-m", "bench.delay_proxy", "--target", str(target)]
    proc = subprocess.Popen(
        [*command, "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"delay proxy did not start (said {line!r})")
        yield int(line)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delay_proxy", description=__doc__)
    p.add_argument("--target", type=int, required=True, help="port on 127.0.0.1 to forward to")
    p.add_argument("--delay-ms", type=float, required=True, help="added to every request")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.target, args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
