"""``model.onnx`` beside ``model.pt``: the trained model for serving stacks that run ONNX
(onnxruntime, Triton, an Azure ML endpoint), checked before it is kept.

The file's contract is ``training.onnx_model``'s (one float32 ``images`` input, RGB 0-255,
any batch size; ``logits`` out; ``classes`` and ``input_size`` in its metadata). The export
is of the weights ``model.pt`` holds, on the CPU in float32 (whatever device and precision
trained them), with PyTorch's exporter (``torch.onnx.export(dynamo=True)``, which needs
onnxscript).

Before the file is written, onnxruntime runs it on real images of the test split beside
PyTorch: the share of images whose top class agrees and the largest difference in any class's
probability go to ``metrics.json``. A file further than :data:`TOLERANCE` from PyTorch is not
written and the run fails naming the figures: a served model is never silently another model.
A model the exporter cannot trace or convert fails naming the layer (the innermost module that
does not export on its own inputs) and the exporter's reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common.atomic import atomic_write
from training.models import build_model
from training.onnx_model import INPUT, OUTPUT, OnnxModel, softmax

# The largest difference in any class's probability, on any image checked, that the export
# may have from PyTorch. Float32 rounding in another operator order stays far below it
# (docs/onnx.md has the figures); a top class can then differ only between two classes whose
# probabilities are within twice this of each other.
TOLERANCE = 1e-4
CHECK_IMAGES = 128  # of the test split, spread over it: both runtimes on the same pixels
CHECK_BATCH = 32
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ExportError(RuntimeError):
    """The model cannot be shipped as ONNX: a layer does not export, or the export computes
    something else than PyTorch does."""


@dataclass(frozen=True)
class ExportCheck:
    """How the export compares with PyTorch on the images checked."""

    images: int
    top1_agreement: float  # share of images whose likeliest class is the same
    max_prob_diff: float  # largest |p_onnx - p_torch| over every image and class
    tolerance: float

    def as_metrics(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's warnings (torchvision's operators skipped, deprecations inside torch) say
    nothing about this model; its errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _reason(exc: BaseException) -> str:
    """The innermost cause's first line (the exporter wraps its reason in generic advice)."""
    seen: set[int] = set()
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _export(module: nn.Module, sample: tuple[Any, ...], dynamic: bool) -> Any:
    """``torch.onnx.export`` of ``module`` on ``sample``; its ONNXProgram."""
    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    with _quiet_exporter():
        return torch.onnx.export(
            module,
            sample,
            dynamo=True,
            input_names=[INPUT] if dynamic else None,
            output_names=[OUTPUT] if dynamic else None,
            dynamic_shapes=shapes,
            verbose=False,
        )


def _exports(module: nn.Module, sample: tuple[Any, ...]) -> bool:
    try:
        _export(module, sample, dynamic=False)
    except Exception:
        return False
    return True


def culprit(model: nn.Module, sample: torch.Tensor) -> str:
    """The innermost layer of ``model`` that does not export on the inputs it gets, as its
    dotted name and type: from the whole model down, the first child (in the order they run)
    that fails on its own; a layer whose children all export is the one at fault."""
    inputs: dict[int, tuple[Any, ...]] = {}

    def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) not in inputs:  # what it got first; a copy, as in-place layers follow
            inputs[id(module)] = tuple(
                a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args
            )

    hooks = [m.register_forward_pre_hook(capture) for m in model.modules()]
    try:
        with torch.no_grad():
            model(sample)
    except Exception:
        pass  # the layers that ran before the failure have their inputs
    finally:
        for hook in hooks:
            hook.remove()
    path: list[str] = []
    module = model
    while True:
        ran = [(n, c) for n, c in module.named_children() if id(c) in inputs]
        ran.sort(key=lambda item: list(inputs).index(id(item[1])))
        for name, child in ran:
            if not _exports(child, inputs[id(child)]):
                path.append(name)
                module = child
                break
        else:
            where = ".".join(path) or "the model"
            return f"{where} ({type(module).__name__})"


def export_onnx(
    model: nn.Module, input_size: int, class_names: Sequence[str], model_name: str
) -> bytes:
    """The ONNX file of ``model`` (on the CPU, in eval mode), with its metadata; ExportError
    naming the layer when it cannot be traced or converted."""
    import onnx

    sample = torch.zeros(2, 3, input_size, input_size)
    try:
        program = _export(model, (sample,), dynamic=True)
    except Exception as exc:
        layer = culprit(model, sample)
        raise ExportError(
            f"model.onnx: layer {layer} of the {model_name} cannot be exported to ONNX "
            f"({_reason(exc)})"
        ) from None
    proto = program.model_proto
    onnx.helper.set_model_props(
        proto,
        {
            "classes": json.dumps(list(class_names), ensure_ascii=False),
            "input_size": str(input_size),
            "model": model_name,
        },
    )
    buffer = io.BytesIO()
    onnx.save_model(proto, buffer)
    return buffer.getvalue()


@torch.no_grad()
def check_export(
    model: nn.Module, data: bytes, images: torch.Tensor, tolerance: float = TOLERANCE
) -> ExportCheck:
    """Run ``data`` (an ONNX file) with onnxruntime and ``model`` with PyTorch on ``images``
    (uint8 ``(N, 3, S, S)``); ExportError when they differ by more than ``tolerance``."""
    exported = OnnxModel(data)
    # A few images at a time: a large model's activations for the whole set need not fit.
    chunks = torch.split(images, CHECK_BATCH)
    ours = np.concatenate([softmax(model(chunk.float()).numpy()) for chunk in chunks])
    theirs = np.concatenate([exported.probabilities(chunk.numpy()) for chunk in chunks])
    check = ExportCheck(
        images=len(images),
        top1_agreement=float(np.mean(ours.argmax(1) == theirs.argmax(1))),
        max_prob_diff=float(np.abs(ours - theirs).max()),
        tolerance=tolerance,
    )
    if not check.max_prob_diff <= tolerance:
        raise ExportError(
            f"model.onnx differs from the PyTorch model on {check.images} test images: "
            f"probabilities up to {check.max_prob_diff:.3g} apart (tolerance {tolerance:g}), "
            f"top class the same on {check.top1_agreement:.1%}; the file was not written"
        )
    return check


def check_images(dataset: Any, count: int = CHECK_IMAGES) -> torch.Tensor:
    """Up to ``count`` images of ``dataset`` (a split's), spread evenly over it, as a batch."""
    total = len(dataset)
    if total == 0:
        raise ExportError("model.onnx cannot be checked: the test split has no image")
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(int))
    return torch.stack([dataset[int(i)][0] for i in picks])


def write_onnx(
    saved: dict[str, Any], images: torch.Tensor, path: Path, tolerance: float = TOLERANCE
) -> ExportCheck:
    """Export the model ``saved`` holds (``model.pt``'s dict), check it on ``images``, and only
    then write it to ``path`` (atomically)."""
    model = build_model(saved["model_name"], len(saved["class_names"]))
    model.load_state_dict({k: v.detach().cpu() for k, v in saved["state_dict"].items()})
    model.float().eval()
    data = export_onnx(model, saved["input_size"], saved["class_names"], saved["model_name"])
    check = check_export(model, data, images.cpu(), tolerance)
    atomic_write(path, lambda fh: fh.write(data))
    return check
