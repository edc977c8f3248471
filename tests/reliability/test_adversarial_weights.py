"""``--init-from`` files built to take rank 0's memory: torch reads each member of a weights
archive into memory at the size the archive declares, inflating a compressed one, so a file of a
few kilobytes can declare gigabytes. Each is refused by its archive's directory, naming the
file, before torch reads a byte of it; a file torch.save wrote still loads."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from tests.reliability import report
from training.weights import MAX_WEIGHTS_BYTES, InitFromError, read_weights

INFLATED = 16 << 20  # floats of zeros: 64 MB once read


def _deflated(path: Path) -> None:
    """A state dict of torch.save whose members are written again deflated: the zeros of its
    storage shrink a thousandfold, and torch's reader inflates them back when it loads."""
    saved = io.BytesIO()
    torch.save({"weight": torch.zeros(INFLATED)}, saved)
    with zipfile.ZipFile(saved) as plain, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in plain.infolist():
            out.writestr(info.filename, plain.read(info.filename))


def test_an_archive_that_inflates_a_thousandfold_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    bomb = tmp_path / "bomb.pt"
    _deflated(bomb)
    size = bomb.stat().st_size
    assert size < 200_000  # about 66 KB on disk
    with zipfile.ZipFile(bomb) as archive:
        declared = sum(m.file_size for m in archive.infolist())
    assert declared > 4 * INFLATED  # 64 MB declared
    with pytest.raises(InitFromError) as refused:
        read_weights(bomb)
    message = str(refused.value)
    assert message.startswith(f"--init-from {bomb}: its members declare {declared} bytes")
    assert f"in a file of {size}" in message and "refused before loading" in message
    # What it refused is what torch would have read: the zeros, inflated, as a state dict.
    assert torch.load(bomb, weights_only=True)["weight"].numel() == INFLATED
    report.record(
        "adversarial",
        f"--init-from a file of {size // 1024} KB whose deflated members declare "
        f"{declared >> 20} MB",
        "refused by the archive's declared sizes before torch reads it, naming the file",
        message=message,
        before_fix="loaded whole: rank 0 took the inflated size in memory before any check "
        "(1 MB that inflates to 1 GB took it to 3 GB)",
    )


def test_a_file_over_the_size_of_any_weights_or_not_torchs_archive_is_refused(
    tmp_path: Path,
) -> None:
    huge = tmp_path / "huge.pt"
    with huge.open("wb") as out:  # sparse: no disk, and no byte of it is read
        out.truncate(MAX_WEIGHTS_BYTES + 1)
    with pytest.raises(InitFromError, match=f"is {MAX_WEIGHTS_BYTES + 1} bytes, more than"):
        read_weights(huge)
    legacy = tmp_path / "legacy.pt"  # not a zip: a pickle declares its storages' sizes
    legacy.write_bytes(pickle.dumps({"weight": [0.0] * 4}))
    with pytest.raises(InitFromError, match=r"not the zip archive torch\.save writes"):
        read_weights(legacy)
    pipe = tmp_path / "pipe.pt"
    os.mkfifo(pipe)  # reading it would wait for a writer that never comes
    with pytest.raises(InitFromError, match="is not a regular file"):
        read_weights(pipe)
    plain = tmp_path / "plain.pt"
    torch.save({"weight": torch.ones(3)}, plain)
    assert torch.equal(read_weights(plain).state["weight"], torch.ones(3))
    report.record(
        "adversarial",
        "--init-from a sparse file of 1 GiB + 1 byte, a legacy pickle, a named pipe",
        "each refused by name before a byte is read (size class, not torch's zip archive, not a "
        "regular file); a torch.save file loads",
        before_fix="the sparse file was read whole for its MD5, then by torch; the pipe blocked",
    )
