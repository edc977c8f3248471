"""Output that arrives in pieces, passed on a whole line at a time.

A task's or a build's log reaches the orchestrator two ways: a process's pipe (the local
cluster, the docker CLI), or a growing file read by byte range (a Batch task's stdout.txt, an
ACR run's log blob). Each caller gets the same lines either way, and a line cut by the end of a
read is passed on whole with the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import IO

OnLine = Callable[[str], None]


def pipe_lines(stream: Iterable[str], on_line: OnLine, copy: IO[str] | None = None) -> None:
    """Every line of a text pipe, without its newline, as it comes; also written to ``copy``
    (flushed line by line, so a reader of that file sees what the pipe has said so far)."""
    for line in stream:
        if copy is not None:
            copy.write(line)
            copy.flush()
        on_line(line.rstrip("\n"))


def read_new_lines(
    size: int, offset: int, read: Callable[[int, int], bytes], on_line: OnLine
) -> int:
    """The whole lines a file of ``size`` bytes holds past ``offset``; ``read(start, end)``
    returns its bytes from start up to end (exclusive). Returns the offset of the first byte not
    yet passed on: a last line without its newline comes with the next read."""
    if size <= offset:
        return offset
    data = read(offset, size)
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        on_line(line)
    return offset + end
