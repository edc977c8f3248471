"""``model.onnx`` read with onnxruntime alone: no torch, nothing else of this project's needed.

The trainer writes the file beside ``model.pt`` (``training.onnx_export``). Its contract, the
same as ``model.pt``'s: one input ``images``, float32 ``(N, 3, S, S)``, RGB values 0-255 (the
model normalises them itself), any batch size; one output ``logits``, ``(N, classes)``; the
metadata properties ``classes`` (a JSON list, in the order of the outputs) and ``input_size``
(``S``). An image becomes its input as ``imagedata.model_input.to_model_array`` makes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from training.model_file import ModelFileError, check_class_names, check_input_size

INPUT = "images"
OUTPUT = "logits"


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities from a batch of logits, row by row (float64: the same to 1e-12 whatever
    the batch's largest logit)."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


class OnnxModel:
    """An onnxruntime session over a ``model.onnx``, with the facts its metadata carries."""

    def __init__(self, source: Path | bytes, name: str | None = None) -> None:
        """``source``: the file, or its bytes (the trainer checks an export before writing
        it); ``name`` names it in errors (default: the path)."""
        import onnxruntime as ort

        where = name or str(source if isinstance(source, Path) else "model.onnx")
        if isinstance(source, Path) and not source.is_file():
            raise ModelFileError(f"model file {where} does not exist")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: its warnings are about graph fusions
        try:
            model = source if isinstance(source, bytes) else str(source)
            self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types for a damaged file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelFileError(
                f"model file {where} cannot be read ({type(exc).__name__}: {first})"
            ) from None
        meta: dict[str, Any] = self.session.get_modelmeta().custom_metadata_map
        try:
            names = json.loads(meta.get("classes", ""))
            size = int(meta.get("input_size", ""))
        except ValueError:
            raise ModelFileError(
                f"model file {where} lacks the metadata classes (a JSON list) and input_size: "
                "not written by training.train"
            ) from None
        self.class_names = check_class_names(where, names)
        self.input_size = check_input_size(where, size)
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != [INPUT] or outputs != [OUTPUT]:
            raise ModelFileError(
                f"model file {where} has inputs {inputs} and outputs {outputs}, not "
                f"[{INPUT!r}] and [{OUTPUT!r}]: not written by training.train"
            )

    def logits(self, images: np.ndarray) -> np.ndarray:
        """The logits of a batch of uint8 (or float) ``(N, 3, S, S)`` images."""
        batch = np.ascontiguousarray(images, dtype=np.float32)
        return np.asarray(self.session.run([OUTPUT], {INPUT: batch})[0])

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        return softmax(self.logits(images))
