"""Images a photo dump holds, through every reader: the data gate, the trainer's loose-file
reader, the shard packer and the scorer (which reads through the trainer's ``open_dataset``,
loose or packed) all see the picture each file shows.

16-bit grayscale became nearly white, EXIF-rotated photos trained sideways (and the gate
recorded their width and height swapped), transparent pixels became black: silently, every
file counted, nothing reported. The mix is real digits (scikit-learn's) stored in 13 kinds of
file (tests/image_mix.py); decoded pixels are compared with the pictures, not accuracies.
Recorded for docs/reliability.md ("Adversarial inputs").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.config import BlobLocation
from gate.manifest import build_manifest
from imagedata.data import open_dataset
from imagedata.dataset import to_model_input
from imagedata.shards import pack_shards
from tests.image_mix import KINDS, MixedImage, photo_mix, write_mix
from tests.pipeline_helpers import new_container
from tests.reliability import report

SIZE = 32  # the cnn's input size: every image is resized and cropped to it
# A JPEG is lossy: after the resize its pixels stay within these of the picture's. Decoded
# wrongly (turned, clipped, on black), an image is off by 50 to 170 on average.
JPEG_MEAN_ERROR, JPEG_MAX_ERROR = 3.0, 32


def _off(image: MixedImage, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` (a reader's model input) is not the picture ``image`` shows, at SIZE."""
    want = to_model_input(Image.fromarray(image.expected), SIZE).numpy().astype(int)
    error = np.abs(tensor.numpy().astype(int) - want)
    if image.lossy:
        ok = error.mean() <= JPEG_MEAN_ERROR and error.max() <= JPEG_MAX_ERROR
    else:
        ok = not error.any()
    return None if ok else f"{image.kind} ({image.rel}): mean error {error.mean():.1f}"


def test_a_photo_dump_is_decoded_as_the_pictures_it_holds_by_every_reader(
    azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mix = photo_mix(tmp_path, per_class=13)
    assert {m.kind for m in mix} == set(KINDS)
    by_rel = {m.rel: m for m in mix}

    # The gate: readable, and the picture's width and height (after the EXIF orientation).
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    container = new_container(azurite, "dump")
    for image in mix:
        container.upload_blob(f"dump/{image.rel}", image.data)
    location = BlobLocation(
        container=container.container_name,
        prefix="dump",
        connection_string_env="AZURE_STORAGE_CONNECTION_STRING",
    )
    rows, _ = build_manifest(location, tmp_path / "gate-cache")
    gate_wrong = [
        f"{m.kind} ({m.rel}): {row['width']}x{row['height']}, channels {row['channels']}"
        for row in rows
        if (m := by_rel[row["path"]])
        and not (
            row["readable"]
            and (row["width"], row["height"]) == (m.expected.shape[1], m.expected.shape[0])
            and row["channels"] == m.channels
        )
    ]
    assert not gate_wrong, gate_wrong

    # The trainer's loose files, then the shards staging packs (the scorer reads either).
    root = write_mix(mix, tmp_path / "data")
    loose = open_dataset(str(root), SIZE, use_shards=False)
    packed = pack_shards(root, SIZE, workers=1)
    assert packed.action == "packed" and packed.skipped == 0, packed
    shards = open_dataset(str(root), SIZE)
    assert shards.kind == "image-folders (packed shards)"
    wrong: dict[str, list[str]] = {"loose files": [], "shards": []}
    checked = 0
    for split, data in loose.splits.items():
        samples = data.dataset.samples  # type: ignore[attr-defined]  # an ImageFolderSplit
        assert len(samples) == len(shards.splits[split])
        for i, (path, _label) in enumerate(samples):
            image = by_rel[Path(path).relative_to(root).as_posix()]
            for reader, info in (("loose files", loose), ("shards", shards)):
                why = _off(image, info.splits[split].dataset[i][0])
                if why:
                    wrong[reader].append(why)
            checked += 1
    assert checked == len(mix)
    assert wrong == {"loose files": [], "shards": []}, wrong
    report.record(
        "adversarial",
        f"a photo dump of real digits in {len(KINDS)} kinds of file ({', '.join(KINDS)})",
        "gate, trainer (loose files), shard packer and scorer decode the picture each shows: "
        "lossless files pixel for pixel, JPEGs within their loss; gate sizes after EXIF "
        "orientation",
        images=len(mix),
    )
