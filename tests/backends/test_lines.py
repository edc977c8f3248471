"""backends/lines.py: output that arrives in pieces is passed on a whole line at a time."""

from __future__ import annotations

import io

from backends.lines import pipe_lines, read_new_lines


def test_a_line_cut_by_a_read_comes_whole_with_the_next() -> None:
    log = b"epoch 1\nepoch 2\nepo"
    lines: list[str] = []
    offset = read_new_lines(len(log), 0, lambda start, end: log[start:end], lines.append)
    assert (lines, offset) == (["epoch 1", "epoch 2"], len(b"epoch 1\nepoch 2\n"))
    log += b"ch 3\n"
    offset = read_new_lines(len(log), offset, lambda start, end: log[start:end], lines.append)
    assert (lines[-1], offset) == ("epoch 3", len(log))


def test_nothing_is_read_when_the_file_has_not_grown() -> None:
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        return b""

    assert read_new_lines(10, 10, read, lambda _: None) == 10
    assert reads == []


def test_undecodable_bytes_do_not_stop_the_log() -> None:
    lines: list[str] = []
    read_new_lines(4, 0, lambda start, end: b"\xff\xfe\n\n"[start:end], lines.append)
    assert lines == ["\ufffd\ufffd", ""]


def test_piped_lines_lose_their_newline_and_are_copied_as_they_came() -> None:
    copy = io.StringIO()
    lines: list[str] = []
    pipe_lines(io.StringIO("a\nb\nlast"), lines.append, copy=copy)
    assert lines == ["a", "b", "last"]
    assert copy.getvalue() == "a\nb\nlast"
