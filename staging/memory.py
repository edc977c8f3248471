"""Freed download buffers kept for reuse (glibc's allocator thresholds), set once per process.

Why: a large blob arrives as chunks of about a megabyte, each in a buffer allocated by the
store's threads and freed by the thread that wrote and hashed it. With glibc's defaults a
thread's heap is handed back to the system as soon as a MB or two lies free at its top, so the
next chunk's buffer is fresh memory again: a page fault and a zeroed page for every 4 KB
received. On the large-file bench (4 x 64 MB from Azurite, 2 cores, rounds alternating with
rclone) that churn cost the step about 13% of its CPU per file; docs/performance.md gives the
figures and the trim thresholds tried (8 MB left most of the churn, 32 MB removed it, 128 MB
gained nothing more).

So on its first download a process sets glibc's thresholds to what glibc's own adjustment
reaches after freeing a large buffer: allocations up to :data:`MMAP_THRESHOLD` come from the
heaps, and a heap gives memory back once :data:`TRIM_THRESHOLD` lies free at its top (glibc's
adjustment goes as far as 32 MB and 64 MB). Each heap then keeps at most that much free memory
at its top. They are set for the rest of the process and never restored: setting a threshold
turns glibc's adjustment off for good, so "restoring" would mean its start-up values fixed
forever, and the same churn moved to whatever the process does next (the forked decoders that
pack shards after a sync inherit the settings). A process whose operator set glibc's malloc
thresholds (``MALLOC_*_THRESHOLD_``, ``GLIBC_TUNABLES``) keeps theirs; other C libraries (musl)
are left as they are.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the ceiling of glibc's own adjustment on 64-bit
TRIM_THRESHOLD = 32 << 20
OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_settled: bool | None = None  # None: not tried yet in this process


def _operator_set_thresholds() -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(name in os.environ for name in OPERATOR_SETTINGS) or any(
        key in tunables for key in ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
    )


def keep_freed_buffers() -> bool:
    """Set the thresholds once for this process; whether they are in force (False on another
    C library, where the operator chose theirs, or where glibc refused them)."""
    global _settled
    with _lock:
        if _settled is None:
            _settled = False
            if platform.libc_ver()[0] == "glibc" and not _operator_set_thresholds():
                try:
                    libc = ctypes.CDLL(None)  # the process's own symbols: glibc's
                except OSError:
                    return False
                if hasattr(libc, "mallopt"):
                    _settled = bool(
                        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                    )
        return _settled
