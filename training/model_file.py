"""What a model file the trainer wrote must say about itself, whichever form it takes.

``model.pt`` (read by ``training.score``, with torch) and ``model.onnx`` (read by
``training.onnx_model``, with onnxruntime alone) carry the same facts: the class names in the
order of the model's outputs and the input size. Both readers check them here, so a file that
is not the trainer's is refused by name in the same words, and the ONNX path needs no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_INPUT_SIZE = 4096  # pixels; the trainer's configs stop far below


class ModelFileError(ValueError):
    """The model file is missing, damaged or not one the trainer wrote."""


def check_class_names(path: Path | str, names: Any) -> list[str]:
    """``names`` when it is a list of two or more class names, else ModelFileError."""
    if not (isinstance(names, list) and len(names) >= 2 and all(isinstance(n, str) for n in names)):
        raise ModelFileError(f"model file {path}: class_names is not a list of class names")
    return names


def check_input_size(path: Path | str, size: Any) -> int:
    """``size`` when it is a whole number of pixels the readers can resize to."""
    if type(size) is not int or not 8 <= size <= MAX_INPUT_SIZE:
        raise ModelFileError(f"model file {path}: input_size {size!r} is not 8..{MAX_INPUT_SIZE}")
    return size
