"""Freed download buffers are kept for reuse: the next chunk's buffer is not fresh memory.

Each check runs in a fresh interpreter: glibc's thresholds move with what a process has freed
before, and the settings last for the process. What is observed is the kernel's count of the
page faults a thread takes (``getrusage(RUSAGE_THREAD)``), not our code's account.
"""

from __future__ import annotations

import os
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
    import ctypes, resource, threading

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    MB = 1 << 20

    def faults_per_round():
        # What a download's chunks do, in a thread: 12 rounds of 8 buffers of a MB allocated,
        # filled and freed; the page faults of rounds 2 to 12, per round (the first round
        # finds no memory to reuse, whatever the settings).
        out = []
        def run():
            for n in range(12):
                if n == 1:
                    start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                ps = [libc.malloc(MB) for _ in range(8)]
                for p in ps:
                    ctypes.memset(p, 1, MB)
                for p in ps:
                    libc.free(p)
            out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start) // 11)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out[0]
    """
)
PAGES_PER_ROUND = 8 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")


def _run(body: str, env: dict[str, str] | None = None) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE + textwrap.dedent(body)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_chunk_buffers_are_not_fresh_memory_once_a_download_has_started() -> None:
    defaults = _run('print("faults", faults_per_round())')
    settled = _run(
        """
        from staging.memory import keep_freed_buffers
        print("settled", keep_freed_buffers())
        print("faults", faults_per_round())
        print("again", keep_freed_buffers())
        """
    )
    # glibc's defaults, the churn: each round's buffers are fresh pages again.
    assert int(defaults["faults"]) >= PAGES_PER_ROUND // 2, defaults
    # Set before any buffer was freed (a download's first chunk): the freed buffers are
    # reused, next to no page faults.
    assert settled["settled"] == "True" and settled["again"] == "True", settled
    assert int(settled["faults"]) < PAGES_PER_ROUND // 8, settled


def test_an_operators_own_malloc_thresholds_are_kept() -> None:
    out = _run(
        """
        from staging.memory import keep_freed_buffers
        print("settled", keep_freed_buffers())
        print("faults", faults_per_round())
        """,
        {"MALLOC_TRIM_THRESHOLD_": "65536"},  # give memory back at once, as the operator chose
    )
    assert out["settled"] == "False", out
    assert int(out["faults"]) >= PAGES_PER_ROUND // 2, out
