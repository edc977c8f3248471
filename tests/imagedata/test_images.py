"""The one decoder (imagedata/images.py ``to_rgb``): each kind of file a photo dump holds becomes
the picture it shows, compared pixel by pixel with the picture computed from the formats'
specifications (tests/image_mix.py), not with accuracies. The readers that share it (gate,
trainer, shard packer, scorer) are checked on the same mix in
tests/reliability/test_adversarial_images.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imagedata.images import BACKGROUND, open_image, to_rgb
from tests.image_mix import KINDS, MixedImage, photo_mix

# A JPEG is lossy: its pixels stay within these of the picture (a picture decoded wrongly, turned
# or clipped or on black, is off by 50 to 170 on average, or has its sides swapped).
JPEG_MEAN_ERROR, JPEG_MAX_ERROR = 3.0, 24


def decoded(image: MixedImage) -> np.ndarray:
    with open_image(io.BytesIO(image.data)) as opened:
        return np.asarray(to_rgb(opened))


def mismatch(image: MixedImage, pixels: np.ndarray) -> str | None:
    """Why ``pixels`` are not the picture ``image`` shows, or None when they are."""
    if pixels.shape != image.expected.shape:
        return f"{image.kind}: shape {pixels.shape}, the picture is {image.expected.shape}"
    error = np.abs(pixels.astype(int) - image.expected.astype(int))
    if image.lossy:
        if error.mean() > JPEG_MEAN_ERROR or error.max() > JPEG_MAX_ERROR:
            return f"{image.kind}: mean error {error.mean():.1f}, max {error.max()}"
        return None
    return None if not error.any() else f"{image.kind}: {int((error > 0).sum())} pixels differ"


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> list[MixedImage]:
    return photo_mix(tmp_path_factory.mktemp("mix"), per_class=4)


def test_every_kind_of_file_decodes_to_the_picture_it_shows(mix: list[MixedImage]) -> None:
    assert {m.kind for m in mix} == set(KINDS)
    problems = [why for m in mix if (why := mismatch(m, decoded(m)))]
    assert not problems, problems


def test_a_sixteen_bit_gradient_keeps_its_mean() -> None:
    """Pillow's convert("RGB") clipped 16-bit grayscale: a gradient of mean 127 arrived as
    mean 251."""
    gradient = np.linspace(0, 65535, 256 * 64).reshape(64, 256).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(gradient).save(buffer, "PNG")
    with open_image(io.BytesIO(buffer.getvalue())) as image:
        assert image.mode.startswith("I;16")
        pixels = np.asarray(to_rgb(image))
    assert pixels.shape == (64, 256, 3) and abs(pixels.mean() - 127.5) < 0.5


def test_transparent_pixels_show_the_stated_background() -> None:
    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # black under full transparency
    buffer = io.BytesIO()
    clear.save(buffer, "PNG")
    with open_image(io.BytesIO(buffer.getvalue())) as image:
        assert np.asarray(to_rgb(image)).tolist() == [[list(BACKGROUND)] * 8] * 8


def test_a_damaged_exif_block_leaves_the_picture_as_stored(tmp_path: Path) -> None:
    """An EXIF block that does not parse says nothing about orientation: the pixels are
    decoded as stored (as viewers do), not refused."""
    upright = np.arange(24 * 16, dtype=np.uint8).reshape(24, 16)
    buffer = io.BytesIO()
    Image.fromarray(upright).save(buffer, "PNG", exif=b"Exif\x00\x00MM\x00*garbage")
    with open_image(io.BytesIO(buffer.getvalue())) as image:
        pixels = np.asarray(to_rgb(image))
    assert (pixels[:, :, 0] == upright).all()


def test_the_suffix_is_pathlibs_for_every_name() -> None:
    """The string-only suffix agrees with PurePath's on every name of up to five pieces of an
    alphabet holding what changes the answer (dots, slashes, case)."""
    import itertools
    from pathlib import PurePath

    from imagedata.images import suffix

    for k in range(1, 6):
        for pieces in itertools.product(["a", ".", "/", "png", "P"], repeat=k):
            name = "".join(pieces)
            assert suffix(name) == PurePath(name).suffix.lower(), name
            assert suffix(PurePath(name)) == PurePath(name).suffix.lower(), name


def _png_bomb(side: int) -> bytes:
    """A valid grayscale PNG of side x side black pixels, a few hundred KB: its rows compress
    to almost nothing, so a small upload declares hundreds of megabytes of pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    packer = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte 0, then the row's pixels
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
    )


_BOMB_PROBE = """
import resource, sys
from gate.manifest import _decoded
from imagedata.model_input import decode_array
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
row = _decoded(data, None)
verdict = decode_array(__import__("pathlib").Path(sys.argv[1]), 32)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(row["readable"], row["width"], row["height"], grown // 1024, verdict)
"""


@pytest.mark.processes  # a fresh interpreter, whose peak memory is the probe's own
def test_an_image_bomb_is_refused_by_its_header_before_any_decode(tmp_path: Path) -> None:
    """A 13,000 x 13,000 PNG of a few hundred KB (169 M pixels: under Pillow's own bomb guard)
    is refused by the gate and by the predictor from its header: their peak memory does not
    grow by the image's pixels (169 MB as grey, 507 MB as RGB)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_bomb(13_000))
    assert bomb.stat().st_size < 400_000
    with open_image(io.BytesIO(_png_bomb(64))) as small:
        assert small.size == (64, 64)  # the same writer makes a PNG Pillow reads
    out = subprocess.run(
        [sys.executable, "-c", _BOMB_PROBE, str(bomb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split(maxsplit=4)
    readable, width, height, grown_mb, verdict = out
    assert (readable, width, height) == ("False", "13000", "13000")
    assert int(grown_mb) < 100, f"peak memory grew {grown_mb} MB: the image was decoded"
    assert "13000 x 13000 pixels is over the 50,000,000-pixel limit" in verdict
