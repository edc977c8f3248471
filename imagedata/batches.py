"""Batches of packed shards as the GPU takes them: gathered whole, pinned, one batch ahead.

The per-image path (a ``DataLoader`` calling ``__getitem__`` per row, collating the rows into a
batch, then copying the batch into pinned memory) copies every row three times and pays Python
per image; worker processes add a fourth copy through shared memory. A shard row is already the
model's uint8 input, so a batch is one copy per row, from the mapped file into page-locked
memory that the device reads without staging (``ShardSplit.gather``). One thread gathers the
next batch while the training step runs; ``bench/feed.py`` measures what one core delivers this
way against what one GPU consumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils.data import Sampler

from imagedata.shards import ShardSplit

RING = 3  # host buffers in turn when not pinned: the caller's, the one gathered, one spare


class ShardBatches:
    """An epoch of ``split`` in the order ``sampler`` gives (re-read each epoch, so a
    ``DistributedSampler``'s ``set_epoch`` reshuffles it), ``batch_size`` rows at a time."""

    def __init__(
        self,
        split: ShardSplit,
        sampler: Sampler[int],
        batch_size: int,
        *,
        drop_last: bool = False,
        pin: bool = False,
    ) -> None:
        self.split, self.sampler, self.batch_size = split, sampler, batch_size
        self.drop_last, self.pin = drop_last, pin
        self._ring: list[torch.Tensor | None] = [None] * RING

    def __len__(self) -> int:
        rows = len(self.sampler)  # type: ignore[arg-type]  # the trainer's samplers are sized
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def _buffer(self, rows: int, turn: int) -> torch.Tensor:
        """Where batch ``turn`` is gathered. Pinned: a new tensor from the caching host
        allocator, which reuses a block only once the device's copy out of it is done. Else one
        of three buffers in turn, each reused two batches later: the batch the caller is using
        and the one being gathered are the other two (a batch is the caller's until it asks for
        the next-but-one). Freshly allocated memory would be faulted in page by page at every
        batch: at 150 KB an image, that cost more than the copy."""
        side = self.split.size
        shape = (rows, 3, side, side)
        if self.pin:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        buffer = self._ring[turn % RING]
        if buffer is None or buffer.shape[0] < rows:
            buffer = self._ring[turn % RING] = torch.empty(shape, dtype=torch.uint8)
        return buffer[:rows]

    def _gather(self, indices: list[int], turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split.gather(indices, self._buffer(len(indices), turn))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = list(self.sampler)
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and chunks and len(chunks[-1]) < self.batch_size:
            chunks.pop()
        if not chunks:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="gather") as pool:
            ahead: Future[tuple[torch.Tensor, torch.Tensor]]
            ahead = pool.submit(self._gather, chunks[0], 0)
            for turn in range(1, len(chunks) + 1):
                batch = ahead.result()
                if turn < len(chunks):
                    ahead = pool.submit(self._gather, chunks[turn], turn)
                yield batch
                del batch  # the caller's alone: a pinned block goes back to the cache with it
