"""Freed download buffers are kept for reuse while a download runs, and given back after.

Each check runs in a fresh interpreter: glibc's thresholds move with what a process has freed
before, so only a process that has done nothing yet starts from glibc's own settings. What is
observed is glibc's own account of its memory (``mallinfo2``), not our code's.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        platform.libc_ver()[0] != "glibc", reason="the settings are glibc's; others are left as is"
    ),
]

PROBE = textwrap.dedent(
    """
    import ctypes, sys, threading

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    MB = 1 << 20

    def mapped_on_its_own():
        # Whether a fresh 1 MB buffer gets a mapping of its own (fresh pages, given back
        # when freed) rather than a place in a heap.
        before = libc.mallinfo2().hblks
        p = libc.malloc(MB)
        mapped = libc.mallinfo2().hblks > before
        libc.free(p)
        return mapped

    def free_kept_after_a_burst():
        # A thread's burst of 32 chunk-sized buffers, freed: bytes its heaps keep for reuse.
        out = []
        def burst():
            ps = [libc.malloc(MB) for _ in range(32)]
            for p in ps:
                ctypes.memset(p, 1, MB)
            for p in ps:
                libc.free(p)
            out.append(libc.mallinfo2().fordblks)
        t = threading.Thread(target=burst)
        t.start()
        t.join()
        return out[0]
    """
)


def _run(body: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE + textwrap.dedent(body)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_chunk_buffers_come_from_the_heaps_while_a_download_runs_and_are_given_back_after() -> None:
    out = _run(
        """
        from staging.memory import reused_buffers
        print("defaults", mapped_on_its_own(), free_kept_after_a_burst() // MB)
        with reused_buffers() as took:
            print("during", took, mapped_on_its_own(), free_kept_after_a_burst() // MB)
        print("after", mapped_on_its_own(), free_kept_after_a_burst() // MB)
        """
    )
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    # glibc's defaults, the churn: a fresh mapping per buffer, and the freed burst given back.
    assert rows["defaults"][0] == "True" and int(rows["defaults"][1]) < 16, out
    # During a download: buffers in the heaps, and the freed burst kept for the next chunks.
    assert rows["during"][:2] == ["True", "False"] and int(rows["during"][2]) >= 32, out
    # After it: glibc's initial settings again, and the memory given back.
    assert rows["after"][0] == "True" and int(rows["after"][1]) < 16, out


def test_overlapping_downloads_keep_the_settings_until_the_last_one_ends() -> None:
    out = _run(
        """
        from staging.memory import reused_buffers
        first = reused_buffers()
        first.__enter__()
        with reused_buffers():
            pass
        print("first-still-running", free_kept_after_a_burst() // MB)
        first.__exit__(None, None, None)
        print("all-ended", free_kept_after_a_burst() // MB)
        """
    )
    kept = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()}
    assert kept["first-still-running"] >= 32 and kept["all-ended"] < 16, out
