"""Helpers for tests of the data gate's expectations and of what they leave behind."""

from __future__ import annotations


def valid_manifest_rows() -> list[dict[str, object]]:
    """A manifest the gate passes: two classes, three train and one test image each."""
    return [
        {
            "path": f"{split}/c{c}/{split}{i}.png",
            "split": split,
            "label": f"c{c}",
            "width": 8,
            "height": 8,
            "channels": 1,
            "bytes": 100,
            "md5": f"{split}{c}{i}",
            "readable": True,
            "leak": False,
        }
        for c in range(2)
        for split, n in (("train", 3), ("test", 1))
        for i in range(n)
    ]
