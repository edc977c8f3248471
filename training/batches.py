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

from training.shards import ShardSplit


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

    def __len__(self) -> int:
        rows = len(self.sampler)  # type: ignore[arg-type]  # the trainer's samplers are sized
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def _gather(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        side = self.split.size
        out = torch.empty((len(indices), 3, side, side), dtype=torch.uint8, pin_memory=self.pin)
        return self.split.gather(indices, out)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = list(self.sampler)
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and chunks and len(chunks[-1]) < self.batch_size:
            chunks.pop()
        if not chunks:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="gather") as pool:
            ahead: Future[tuple[torch.Tensor, torch.Tensor]] = pool.submit(self._gather, chunks[0])
            for following in [*chunks[1:], None]:
                batch = ahead.result()
                if following is not None:
                    ahead = pool.submit(self._gather, following)
                yield batch
