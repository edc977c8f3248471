"""Layout detection at ``--data-dir``: what is neither image folders nor CIFAR is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from imagedata.data import open_dataset
from imagedata.dataset import DatasetError


def test_not_a_dataset_named(tmp_path: Path) -> None:
    (tmp_path / "random").mkdir()
    with pytest.raises(DatasetError, match="no train/ or test/ folders and no CIFAR-10 batches"):
        open_dataset(str(tmp_path / "random"), 32)
    with pytest.raises(DatasetError, match="does not exist"):
        open_dataset(str(tmp_path / "nowhere"), 32)
