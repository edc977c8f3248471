"""Freed download buffers kept for reuse while blobs stream in (glibc's allocator settings).

Why: a large blob arrives as chunks of about a megabyte, each in a buffer allocated by the
store's threads and freed by the thread that wrote and hashed it. With glibc's defaults the
heaps those buffers come from are handed back to the system as soon as a megabyte or two lies
free at their top, so the next chunk's buffer is fresh memory again: a page fault and a zeroed
page for every 4 KB received. Measured on the large-file bench (4 x 64 MB from Azurite, 2
cores, separate processes alternating with rclone), that churn was about a sixth of the step's
CPU: 181-187 ms per 64 MB file with the defaults, 146-157 ms with buffers kept (rclone:
151-164 ms), docs/performance.md.

So while any download runs, allocations up to :data:`MMAP_THRESHOLD` come from the heaps and a
heap keeps up to :data:`TRIM_THRESHOLD` free before giving memory back. What is kept is bounded
by what the downloads hold at once (``staging.transfer``'s HOLD_BYTES and QUEUE_BYTES). When
the last download of the process ends, glibc's initial settings are restored and
``malloc_trim`` gives back what lies in its free lists; what a thread's heap keeps at its top
goes back at that heap's next large free (glibc trims a thread's heap only then). glibc offers
no way to turn its dynamic thresholds back on once a threshold was set, so after a first
download a process keeps the initial, memory-returning settings. Other C libraries (musl) are
left as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import threading
from collections.abc import Iterator
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (half its heaps' 64 MB)
TRIM_THRESHOLD = 128 << 20
INITIAL_THRESHOLD = 128 << 10  # both settings' values when a glibc process starts

_lock = threading.Lock()
_users = 0


@functools.cache
def _glibc() -> Any | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: glibc's, in a glibc process
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def reused_buffers() -> Iterator[bool]:
    """Freed buffers kept for reuse while the block runs (nested and concurrent uses share one
    setting; the last to leave restores glibc's initial one). Yields whether the allocator is
    glibc's and took the settings."""
    global _users
    libc = _glibc()
    if libc is None:
        yield False
        return
    with _lock:
        if _users == 0:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        _users += 1
    try:
        yield True
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                libc.mallopt(M_TRIM_THRESHOLD, INITIAL_THRESHOLD)
                libc.mallopt(M_MMAP_THRESHOLD, INITIAL_THRESHOLD)
                libc.malloc_trim(0)
