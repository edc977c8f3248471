"""Packed shards a batch at a time (imagedata.batches): the rows and labels the per-image path
gives, in the sampler's order, across shard files; buffers reused only once the caller is done
with them; the trainer's loader for shards; and augmentation on the device."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from imagedata.augment import SHIFT_FRACTION, flip_crop
from imagedata.batches import ShardBatches
from imagedata.data import open_dataset
from imagedata.make_images import write_synthetic
from imagedata.shards import ShardSplit, pack_shards
from training.args import parse_trainer_args
from training.distributed import World
from training.train import _loader

SIZE = 16


@pytest.fixture
def packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ShardSplit:
    """A split over several shard files (7 rows each) so that batches cross them."""
    monkeypatch.setattr("imagedata.shards.TARGET_SHARD_BYTES", 7 * 3 * SIZE * SIZE)
    root = tmp_path / "data"
    write_synthetic(root, classes=3, per_class=20, size=SIZE, test_fraction=0.2, seed=2)
    pack_shards(root, SIZE)
    split = open_dataset(str(root), SIZE).splits["train"].dataset
    assert isinstance(split, ShardSplit) and len(split.paths) > 3
    return split


def test_batches_hold_the_rows_the_per_image_path_gives(packed: ShardSplit) -> None:
    sampler = RandomSampler(packed, generator=torch.Generator().manual_seed(0))
    order = list(sampler)
    sampler = RandomSampler(packed, generator=torch.Generator().manual_seed(0))
    got = [(x.clone(), y) for x, y in ShardBatches(packed, sampler, 8)]  # buffers are reused
    assert len(packed) % 8 and [len(x) for x, _ in got] == [8] * 6 + [len(packed) % 8]
    images = torch.cat([x for x, _ in got])
    labels = torch.cat([y for _, y in got])
    reference = DataLoader(packed, batch_size=len(packed), sampler=order)
    want_images, want_labels = next(iter(reference))
    assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64


def test_drop_last_drops_only_the_partial_batch(packed: ShardSplit) -> None:
    batches = ShardBatches(packed, SequentialSampler(packed), 8, drop_last=True)
    assert len(batches) == len(packed) // 8 == len(list(batches))
    assert all(len(x) == 8 for x, _ in batches)


class AnnouncedGathers(ShardSplit):
    """The real split, announcing each gather once it is done (they run in a thread)."""

    def __init__(self, split: ShardSplit) -> None:
        counts = [b - a for a, b in zip([0, *split.ends], split.ends, strict=False)]
        super().__init__(list(zip(split.paths, counts, strict=True)), split.labels, split.size)
        self.done = threading.Semaphore(0)

    def gather(
        self, indices: Sequence[int], out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = super().gather(indices, out)
        self.done.release()
        return gathered


def test_a_batch_stays_intact_until_the_next_but_one_is_asked_for(packed: ShardSplit) -> None:
    """Unpinned, three buffers take turns: once the batch after the one in use is gathered,
    the one in use and the one before it still hold what they held."""
    split = AnnouncedGathers(packed)
    batches = ShardBatches(split, SequentialSampler(split), 5)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (batch, its copy), the last two
    finished = 0
    for turn, (images, _) in enumerate(batches):
        while finished < min(turn + 2, len(batches)):  # the gathering ahead is done
            split.done.acquire()
            finished += 1
        held = [*held[-1:], (images, images.clone())]
        for batch, copy in held:
            assert torch.equal(batch, copy), turn


def test_the_trainer_reads_shards_a_batch_at_a_time(packed: ShardSplit, tmp_path: Path) -> None:
    from imagedata.dataset import SplitData

    args = parse_trainer_args(
        ["--data-dir", "d", "--output-dir", str(tmp_path), "--batch-size", "8"]
    )
    world = World(0, 1, 0, 1, torch.device("cpu"))
    sampler = SequentialSampler(packed)
    assert isinstance(_loader(SplitData(packed), sampler, args, world), ShardBatches)
    synthetic = open_dataset("synthetic:40", SIZE).splits["train"]
    assert isinstance(
        _loader(synthetic, SequentialSampler(synthetic.dataset), args, world), DataLoader
    )


def test_flip_crop_shifts_and_mirrors_each_image_within_bounds() -> None:
    """Pixel (y, x) of image i holds y * 100 + x: each output row and column says where it was
    taken from. Rows are shifted by one amount per image, columns too, mirrored or not."""
    n, side = 64, 32
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    images = (ys * 100 + xs).expand(n, 3, side, side).contiguous()
    torch.manual_seed(0)
    out = flip_crop(images)
    assert out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    limit = side // SHIFT_FRACTION
    flips = set()
    for image in out:
        assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
        rows, cols = image[0] // 100, image[0] % 100
        assert (rows == rows[:, :1]).all() and (cols == cols[:1, :]).all()
        dy = rows[side // 2, 0] - side // 2
        assert abs(int(dy)) <= limit
        line = cols[0]
        flipped = bool(line[0] > line[-1])
        flips.add(flipped)
        source = torch.arange(side).flip(0) if flipped else torch.arange(side)
        assert any(
            torch.equal(line, (source + dx).clamp(0, side - 1)) for dx in range(-limit, limit + 1)
        )
    assert flips == {True, False}  # 64 images: both ways drawn


def test_augment_draws_from_the_seeded_stream() -> None:
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(5)
    first = flip_crop(images)
    torch.manual_seed(5)
    assert torch.equal(flip_crop(images), first)
