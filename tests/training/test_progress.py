"""The trainer's PROGRESS line as the task's unbuffered Python writes it."""

from __future__ import annotations

import io
import json
import sys
from typing import Any, cast

import pytest

from training.train import emit_progress


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
