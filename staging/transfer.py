"""Downloads many blobs into files: verified, under a temp name then renamed, many in flight.

Why this engine: the storage SDK spends about 3 ms of interpreter-locked CPU per small blob
(request preparation, its policy pipeline, XML), which bounds a sync of small files whatever
the bandwidth or the thread count. Here each request is made by ``obstore`` (Rust's
``object_store`` with hyper and tokio): a blocking call that releases the interpreter lock for
the whole exchange, made by ``workers`` fetch threads at once. Driven from an asyncio loop
instead, the same engine costs two awaited futures per blob, each a wake-up of the loop, in
the one thread that also does the file work. ``bench/staging`` measures the step against
rclone.

Where the interpreter's time goes per small blob, and how it is kept down: the fetch threads
only fetch; the file work (MD5 check, temp file, write, rename) is queued to one writer thread,
a second and more being started only when the queue grows (on NFS each create and rename is a
round trip), so that most file system calls release the lock without another thread waiting
for it. A large blob (over :data:`PIECE`) is read as parallel ranged reads, each pinned with
If-Match to the same ETag: one blob of 64 MB is then up to 4 requests in flight (at most
:data:`RANGES_PER_CORE` ranges per core in all, so two such blobs at once on two cores, each
hashed by its own thread). Each range's body is streamed a :data:`CHUNK` at a time, written
in place with ``pwrite`` and hashed in order while the chunk is still in the processor's cache
(a range received whole cost 1.6 times the CPU with 8 MB ranges; with 16 MB ones the table of
choices in docs/performance.md has given 0.96-1.14x). Chunks that arrive ahead of their turn
are held in memory up to :data:`HOLD_BYTES` per blob; beyond that they are read back from the
file when their turn comes, so a slow first range of a blob of many GB does not hold the rest
of it in memory.

What each download guarantees:

* pinned: with ``pinned`` every request (each range of a large blob too) carries If-Match on
  the listed ETag (the data gate's), so what lands is what was validated; a changed or deleted
  blob is named. The ranges of a large blob carry it in any case: pieces of two versions of a
  blob never make one file, and a blob changed while its pieces are read fails, named;
* verified: the byte count, and the MD5 whenever the listing has one, are checked before the
  file gets its final name: a reader never sees a partial or wrong file under that name;
* temp name then rename: ``.staging-<random>-<n>.part`` beside the target, unique per
  download (a random token per sync and a counter), so two syncs into one folder (two runs, or
  two nodes on NFS) never write the same temp file;
* retried: the store retries each request (resets, 5xx, throttling, timeouts) with backoff,
  and a response that breaks off mid-body is fetched again (:class:`staging.blob.Retry`);
* cancelled after a hard failure: no queued download starts once one has failed for good
  (each would only retry against the same broken storage); those in flight finish and are
  reported, so the step's retry resumes where this one stopped. A large blob with pieces
  still to fetch is abandoned and its temp file removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from common.atomic import b64md5
from imagedata.staged_folder import TEMP_PREFIX
from staging.blob import Retry, redact
from staging.listing import ChangedSinceGateError, PinnedBlob
from staging.memory import keep_freed_buffers

if TYPE_CHECKING:
    from obstore.store import AzureStore

# A blob larger than this is read as ranges of this size, in parallel. Each request costs the
# service and the client a fixed part, and each range ahead of the hash's turn is hashed late,
# so fewer, larger ranges win until too few are left to keep a core per blob hashing: 16 MB
# against 8 and 32 in docs/performance.md.
PIECE = 16 << 20
CHUNK = 1 << 20  # a range's body is written and hashed this much at a time
HOLD_BYTES = 64 << 20  # per large blob, chunks kept in memory until their turn to be hashed
QUEUE_BYTES = 64 << 20  # bytes waiting for the writer before fetch threads write themselves
# Ranges of large blobs in flight, per usable core (at least 4 in all): more only switch
# threads, each woken for a little of its body, where a core moves hundreds of MB/s
# (docs/performance.md).
RANGES_PER_CORE = 4
SPAWN_AT = 32  # files waiting per writer thread before another writer starts
MAX_WRITERS = 8
T = TypeVar("T")

# What :func:`download_all` reports for each file it lands: the download, its MD5 (base64) and
# the file's status after the rename (size, modification and change times, inode), which the
# manifest records so that a later sync can trust the file without reading it.
Done = Callable[["Download", str, os.stat_result], None]


class IntegrityError(IOError):
    """A downloaded file's size or MD5 does not match what the service reported."""


class TransferError(IOError):
    """A blob could not be read after every retry; names the blob, never a credential."""


@dataclass(frozen=True)
class Download:
    blob: PinnedBlob
    target: Path


def _verify(blob: PinnedBlob, received: int, md5: str) -> None:
    if received != blob.size:
        raise IntegrityError(
            f"blob {blob.name!r}: downloaded {received} bytes, expected {blob.size}"
        )
    if blob.md5 and md5 != blob.md5:
        raise IntegrityError(f"blob {blob.name!r}: MD5 {md5} does not match stored {blob.md5}")


def _write_all(fd: int, data: Any, offset: int | None = None) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


def _read_all(fd: int, size: int, offset: int) -> bytes:
    parts = []
    while size:
        part = os.pread(fd, size, offset)
        if not part:
            raise IntegrityError(f"{size} bytes missing at {offset} of a file being written")
        parts.append(part)
        size, offset = size - len(part), offset + len(part)
    return b"".join(parts)


@dataclass(eq=False)
class _Large:
    """A blob read as ranges: its temp file, and the pieces hashed so far (in order)."""

    job: Download
    tmp: str
    fd: int
    pieces: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Chunks arrived, not yet hashed, by offset: (length, bytes, or None when read back).
    waiting: dict[int, tuple[int, Any]] = field(default_factory=dict)
    hashed: int = 0  # bytes hashed, from the first
    hashing: bool = False
    received: int = 0
    digest: Any = field(default_factory=lambda: hashlib.md5(usedforsecurity=False))
    held: int = 0  # bytes of ``waiting`` kept in memory (the others are read back)
    active: int = 0  # pieces being fetched or written: the file stays open while any is
    failed: bool = False
    closed: bool = False


class _Engine:
    def __init__(
        self, store: AzureStore, pinned: bool, done: Done, retry: Retry, piece: int, ranges: int
    ) -> None:
        self.store, self.pinned, self.retry, self.piece = store, pinned, retry, piece
        self.ranges = threading.BoundedSemaphore(ranges)
        self._done = done
        self._done_lock = threading.Lock()
        self.failures: list[BaseException] = []
        self.token = uuid.uuid4().hex[:12]
        self.counter = itertools.count()
        self.made: set[str] = set()
        self.queue: queue.SimpleQueue[tuple[Download, Any] | None] = queue.SimpleQueue()
        self.queued = 0  # bytes waiting in the queue
        self.queued_lock = threading.Lock()
        self.writers: list[threading.Thread] = []
        self.writers_lock = threading.Lock()
        self.unfinished: set[_Large] = set()

    # -- files ----------------------------------------------------------------------------

    def _temp(self, target: str) -> str:
        folder = os.path.dirname(target)
        if folder not in self.made:
            os.makedirs(folder, exist_ok=True)
            self.made.add(folder)
        return f"{folder}/{TEMP_PREFIX}{self.token}-{next(self.counter)}.part"

    def land_whole(self, job: Download, data: Any) -> None:
        """A blob read in one piece: verified, then temp file, write, rename."""
        md5 = b64md5(hashlib.md5(data, usedforsecurity=False))
        _verify(job.blob, len(data), md5)
        target = os.fspath(job.target)
        tmp = self._temp(target)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            try:
                _write_all(fd, data)
                os.replace(tmp, target)
                # The status of the inode written here, not of whatever the path names by now
                # (another sync into the same folder may have renamed its file onto it).
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink(tmp)
            raise
        self.done(job, md5, st)

    def done(self, job: Download, md5: str, st: os.stat_result) -> None:
        with self._done_lock:
            self._done(job, md5, st)

    # -- requests -------------------------------------------------------------------------

    def _refusal(self, blob: PinnedBlob, exc: Exception) -> Exception:
        """What a request refused for good (not worth trying again) means, naming the blob."""
        from obstore.exceptions import NotFoundError, PreconditionError

        if isinstance(exc, PreconditionError | NotFoundError):
            if self.pinned:  # a condition on a deleted blob is answered 412 or 404
                return ChangedSinceGateError(
                    f"blob {blob.name!r} changed or was deleted after the data gate "
                    f"validated it (its ETag is no longer {blob.etag}): it is not staged "
                    "unvalidated; run again to validate it"
                )
            if isinstance(exc, PreconditionError):
                return TransferError(
                    f"blob {blob.name!r} changed while it was being downloaded (its ETag is "
                    f"no longer {blob.etag}); run again to stage the new version"
                )
            return TransferError(f"blob {blob.name!r} vanished during the sync: {redact(str(exc))}")
        # the store's other refusals: permissions, authentication
        return TransferError(f"blob {blob.name!r}: {redact(str(exc))}")

    def _retried(self, blob: PinnedBlob, request: Callable[[], T]) -> T:
        """``request()`` until it succeeds, again after a failure on the way (a reset, a body
        that breaks off); a refusal (a changed blob, no permission) raises at once, named."""
        from obstore.exceptions import BaseError, GenericError

        wait = self.retry.first_wait
        for attempt in range(1, self.retry.blob_attempts + 1):
            try:
                return request()
            except GenericError as exc:
                if attempt == self.retry.blob_attempts:
                    raise TransferError(
                        f"blob {blob.name!r}: {redact(str(exc))} (after {attempt} attempts)"
                    ) from None
            except BaseError as exc:
                raise self._refusal(blob, exc) from None
            time.sleep(wait)
            wait = min(self.retry.max_wait, wait * 2)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _get(self, blob: PinnedBlob) -> Any:
        """A whole blob's bytes (pinned to its ETag when ``pinned``)."""
        import obstore

        options = {"if_match": blob.etag} if self.pinned else None
        return self._retried(
            blob,
            lambda: obstore.get(self.store, blob.name, options=options).bytes(),  # type: ignore[arg-type]
        )

    # -- large blobs ----------------------------------------------------------------------

    def open_large(self, job: Download) -> _Large:
        target = os.fspath(job.target)
        tmp = self._temp(target)
        # Read as well as written: pieces not held in memory are read back to be hashed.
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        pieces = -(-job.blob.size // self.piece)
        large = _Large(job, tmp, fd, pieces)
        self.unfinished.add(large)
        return large

    def _span(self, large: _Large, k: int) -> tuple[int, int]:
        start = k * self.piece
        return start, min(large.job.blob.size, start + self.piece)

    def piece_of(self, large: _Large, k: int) -> None:
        """One range of a large blob, streamed: each chunk is written in place and, when it is
        next in order, hashed while it is still in the processor's cache (a range received
        whole, 16 MB, is out of the cache by the time it is written and hashed). A body that
        breaks off is asked for again from the first byte not received, with If-Match always:
        the pieces of one file must come from one version of the blob."""
        import obstore

        blob = large.job.blob
        start, end = self._span(large, k)
        at = start

        def rest() -> None:
            nonlocal at
            if at == end:  # all of it arrived before the failure: nothing left to ask for
                return
            options = {"if_match": blob.etag, "range": (at, end)}
            result = obstore.get(self.store, blob.name, options=options)  # type: ignore[arg-type]
            for chunk in result.stream(min_chunk_size=CHUNK):
                if at + len(chunk) > end:
                    raise IntegrityError(
                        f"blob {blob.name!r}: range {start}-{end} gave more than "
                        f"{end - start} bytes"
                    )
                _write_all(large.fd, chunk, at)
                self._hash_in_order(large, at, chunk)
                at += len(chunk)

        self._retried(blob, rest)
        if at != end:
            raise IntegrityError(f"blob {blob.name!r}: range {start}-{end} gave {at - start} bytes")

    def _hash_in_order(self, large: _Large, offset: int, chunk: Any) -> None:
        """Hash in order: whoever finds the next bytes waiting hashes them and those after
        them; the others leave theirs and go on fetching. A chunk ahead of its turn is kept
        only while the blob holds less than HOLD_BYTES; otherwise it is read back from the
        file when its turn comes."""
        with large.lock:
            keep = offset == large.hashed or large.held + len(chunk) <= HOLD_BYTES
            large.waiting[offset] = (len(chunk), chunk if keep else None)
            large.held += len(chunk) if keep else 0
            large.received += len(chunk)
            if large.hashing:
                return
            large.hashing = True
        while True:
            with large.lock:
                item = large.waiting.pop(large.hashed, None)
                if item is None:
                    large.hashing = False
                    finished = large.hashed == large.job.blob.size
                    break
                at, (length, held) = large.hashed, item
                large.held -= length if held is not None else 0
                large.hashed += length
            if held is None:
                held = _read_all(large.fd, length, at)
            large.digest.update(held)  # hashlib releases the lock on large buffers
        if finished:
            self._finish_large(large)

    def _finish_large(self, large: _Large) -> None:
        md5 = b64md5(large.digest)
        target = os.fspath(large.job.target)
        try:
            _verify(large.job.blob, large.received, md5)
            os.replace(large.tmp, target)
            st = os.fstat(large.fd)  # the inode written here (see land_whole)
            os.close(large.fd)
            large.closed = True
        except BaseException:
            self._abandon(large)  # a wrong or unrenamed file: its temp file goes
            raise
        finally:
            self.unfinished.discard(large)
        self.done(large.job, md5, st)

    @staticmethod
    def _abandon(large: _Large) -> None:
        """Close and remove the temp file of a large blob that will not be finished."""
        if not large.closed:
            os.close(large.fd)
            large.closed = True
        _unlink(large.tmp)

    # -- threads --------------------------------------------------------------------------

    def deliver(self, job: Download, data: Any) -> None:
        """Hand a whole blob to the writers, or write it here when they are behind."""
        with self.queued_lock:
            behind = self.queued > QUEUE_BYTES
            if not behind:
                self.queued += len(data)
        if behind:
            self.land_whole(job, data)
            return
        self.queue.put((job, data))
        if self.queue.qsize() > SPAWN_AT * len(self.writers) and len(self.writers) < MAX_WRITERS:
            self.start_writer()

    def start_writer(self) -> None:
        with self.writers_lock:
            if len(self.writers) >= MAX_WRITERS:
                return
            thread = threading.Thread(target=self.writer, name="staging-write", daemon=True)
            self.writers.append(thread)
            thread.start()

    def writer(self) -> None:
        while (item := self.queue.get()) is not None:
            job, data = item
            with self.queued_lock:
                self.queued -= len(data)
            try:  # fetched before a failure, if any: it lands and is reported all the same
                self.land_whole(job, data)
            except BaseException as exc:
                self.failures.append(exc)

    def fetcher(self, tasks: Iterator[tuple[Download | _Large, int]], lock: threading.Lock) -> None:
        while not self.failures:
            try:
                with lock:  # opening a large blob's temp file happens here, and may fail
                    task = next(tasks, None)
            except BaseException as exc:
                self.failures.append(exc)
                return
            if task is None:
                return
            what, k = task
            try:
                if isinstance(what, _Large):
                    self.large_piece(what, k)
                else:
                    self.deliver(what, self._get(what.blob))
            except BaseException as exc:
                self.failures.append(exc)
                return

    def large_piece(self, large: _Large, k: int) -> None:
        """One piece of a large blob; a failed piece fails the blob, and its temp file goes
        once no other piece of it is being written (never while a write may still use its
        descriptor, whose number could by then name another file)."""
        with large.lock:
            if large.failed:
                return  # its blob failed: its other pieces are not fetched
            large.active += 1
        try:
            with self.ranges:
                if large.failed:  # failed while this range waited for its turn
                    return
                self.piece_of(large, k)
        except BaseException:
            with large.lock:
                large.failed = True
            raise
        finally:
            with large.lock:
                large.active -= 1
                last = large.active == 0 and large.failed
            if last:
                self.unfinished.discard(large)
                self._abandon(large)

    def tasks(self, jobs: Iterable[Download]) -> Iterator[tuple[Download | _Large, int]]:
        """Whole blobs, and the pieces of large ones, in listing order (called under a lock)."""
        for job in jobs:
            if job.blob.size <= self.piece:
                yield job, 0
                continue
            large = self.open_large(job)
            for k in range(large.pieces):
                yield large, k


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def download_all(
    store: AzureStore,
    jobs: Iterable[Download],
    pinned: bool,
    workers: int,
    done: Done,
    retry: Retry | None = None,
    piece: int | None = None,
    ranges: int | None = None,
) -> None:
    """Download every job, ``workers`` requests in flight, calling ``done(job, md5, stat)`` as
    each file lands; raises the first hard failure once the requests in flight have ended.
    ``piece``: the range size of large blobs (by default :data:`PIECE`, read at each call, as
    every setting here is). ``ranges``: ranges of large blobs in flight at most (by default
    :data:`RANGES_PER_CORE` per usable core), within the ``workers``.

    Plain threads, no event loop: a caller that already runs one (a Prefect task, a notebook)
    calls this as a plain function.
    """
    if ranges is None:
        ranges = max(4, RANGES_PER_CORE * len(os.sched_getaffinity(0)))
    if piece is None:
        piece = PIECE
    keep_freed_buffers()  # each chunk's buffer is not fresh memory again (staging.memory)
    engine = _Engine(store, pinned, done, retry or Retry(), piece, ranges)
    engine.start_writer()
    tasks, lock = engine.tasks(jobs), threading.Lock()
    fetchers = [
        threading.Thread(target=engine.fetcher, args=(tasks, lock), name="staging-fetch")
        for _ in range(max(1, workers))
    ]
    try:
        for thread in fetchers:
            thread.start()
    finally:
        for thread in fetchers:
            if thread.ident is not None:
                thread.join()
        for _ in engine.writers:
            engine.queue.put(None)
        for thread in engine.writers:
            thread.join()
        for large in list(engine.unfinished):  # cut short: their temp files go
            engine._abandon(large)
    if engine.failures:
        raise engine.failures[0]
