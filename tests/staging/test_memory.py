"""Freed download buffers are kept for reuse while a download runs, and given back after.

Each check runs in a fresh interpreter: glibc's thresholds move with what a process has freed
before, so only a process that has done nothing yet starts from glibc's own settings. What is
observed is the kernel's count of the process's resident memory (``/proc/self/statm``) and
glibc's own count of its mappings (``mallinfo2``), not our code's account.
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
    import ctypes, os, threading

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    MB = 1 << 20

    def resident():
        # The kernel's count of this process's resident memory, in MB.
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // MB

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Info

    def mapped_on_its_own():
        # Whether a MB buffer gets a mapping of its own (glibc's initial setting) rather
        # than a place in a heap; asked of the main thread, whose heap holds no free MB.
        before = libc.mallinfo2().hblks
        p = libc.malloc(MB)
        mapped = libc.mallinfo2().hblks > before
        libc.free(p)
        return mapped

    def burst():
        # What a download's chunks do: a thread allocates 32 buffers of a MB, fills them and
        # frees them; the resident memory after, in MB.
        def run():
            ps = [libc.malloc(MB) for _ in range(32)]
            for p in ps:
                ctypes.memset(p, 1, MB)
            for p in ps:
                libc.free(p)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return resident()
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


def test_chunk_buffers_are_kept_while_a_download_runs_and_the_settings_restored_after() -> None:
    out = _run(
        """
        from staging.memory import reused_buffers
        before = resident()
        print("defaults", burst() - before)
        with reused_buffers() as took:
            start = resident()
            print("during", took, burst() - start)
        print("after", mapped_on_its_own())
        """
    )
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    # glibc's defaults, the churn: the freed buffers' memory goes back at once, and the next
    # chunks get fresh pages again.
    assert int(rows["defaults"][0]) < 16, out
    # During a download the freed buffers stay, for the next chunks to reuse.
    assert rows["during"][0] == "True" and int(rows["during"][1]) >= 28, out
    # After it, glibc's initial settings: a MB buffer is a mapping of its own again.
    assert rows["after"] == ["True"], out


def test_overlapping_downloads_keep_the_settings_until_the_last_one_ends() -> None:
    out = _run(
        """
        from staging.memory import reused_buffers
        first = reused_buffers()
        first.__enter__()
        with reused_buffers():
            pass
        start = resident()
        print("first-still-running", burst() - start)
        first.__exit__(None, None, None)
        print("all-ended", mapped_on_its_own())
        """
    )
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert int(rows["first-still-running"]) >= 28 and rows["all-ended"] == "True", out
