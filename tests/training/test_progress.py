"""The trainer's lines as the task's unbuffered Python writes them: each whole, in one write."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from training.train import emit_progress, main


class _Writes(io.RawIOBase):
    """A file that records each write the way a pipe receives it."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.calls.append(bytes(data))
        return len(data)


def test_a_progress_line_reaches_the_pipe_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTHONUNBUFFERED (the task spec sets it) gives stdout a text layer that writes through to
    the file: any second write of one line lets another thread's log line in between."""
    pipe = _Writes()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(cast(Any, pipe), write_through=True))
    record = {"epoch": 1, "epochs": 3, "train_loss": 0.5}
    emit_progress(record)
    assert pipe.calls == [b"PROGRESS " + json.dumps(record).encode() + b"\n"]


def test_an_error_line_reaches_the_pipe_in_one_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trainer's refusal, on stderr, which the task merges with stdout: a print() with
    file=sys.stderr wrote its newline apart, where a thread's log line could glue to it."""
    pipe = _Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(cast(Any, pipe), write_through=True))
    monkeypatch.setenv("HOROVOD_RANK", "0")  # as if horovodrun had started a DDP trainer
    argv = ["--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "out"), "--engine", "ddp"]
    assert main(argv) == 2
    assert len(pipe.calls) == 1, pipe.calls
    assert pipe.calls[0].startswith(b"error: --engine ddp was started by horovodrun")
    assert pipe.calls[0].endswith(b"\n") and pipe.calls[0].count(b"\n") == 1
