"""How fast one training step runs: precision, memory layout, compilation, the optimizer's kernel.

Each switch is a trainer option, measured one at a time on one H100 (``bench/gpu_speed.py``,
docs/performance.md says what each bought). The choices below are resolved once, at set-up,
from the options and the device, so the training loop only asks this module for a context
(autocast), a scaler or an input batch and never tests the device itself.

Horovod's allreduce requires contiguous tensors, and a channels-last weight gets a channels-last
(non-contiguous) gradient from autograd. :func:`keep_grads_contiguous` gives every parameter a
contiguous gradient buffer before the first backward pass: autograd then accumulates into it in
place, keeping its layout, and the step zeroes it in place instead of freeing it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class Speed:
    """The resolved switches of one run on one device."""

    device: torch.device
    precision: Precision
    channels_last: bool
    compile: bool
    fused_optimizer: bool
    contiguous_grads: bool  # the engine's collectives take contiguous gradients only

    @property
    def keeps_grads(self) -> bool:
        """Whether gradients live in buffers of their own layout (zeroed, never freed)."""
        return self.channels_last and self.contiguous_grads

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def describe(self) -> dict[str, Any]:
        """The switches as plain values, for metrics.json and the log."""
        return {
            "precision": self.precision,
            "channels_last": self.channels_last,
            "compile": self.compile,
            "fused_optimizer": self.fused_optimizer,
        }


def resolve_precision(requested: str, no_amp: bool, device: torch.device) -> Precision:
    """``auto``: bf16 on a GPU that has it (no loss scaling, fp32's range), fp16 with a scaler
    on older GPUs, fp32 on CPU (where autocast would mostly add casts). ``--no-amp`` predates
    ``--precision`` and still means fp32."""
    if no_amp:
        return "fp32"
    if requested != "auto":
        if requested == "fp16" and device.type != "cuda":
            raise ValueError("--precision fp16 needs a GPU; use bf16 or fp32 on CPU")
        return requested  # type: ignore[return-value]  # a choice checked by the parser
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def resolve(
    *,
    device: torch.device,
    precision: str,
    no_amp: bool,
    channels_last: bool,
    compile_model: bool,
    optimizer_kernel: str,
    contiguous_grads: bool = True,
) -> Speed:
    """The run's switches from its options; ``optimizer_kernel`` ``auto`` fuses on a GPU.

    The fused kernel walks a weight, its gradient and its momentum as flat memory, so all three
    must share one layout: measured on CPU, channels-last weights with the contiguous gradients
    Horovod needs (``contiguous_grads``) came out wrong after three steps, while the foreach
    kernels matched the contiguous run to 1e-7. That combination gets foreach, and asking for
    it explicitly is an error."""
    split_layouts = channels_last and contiguous_grads
    if optimizer_kernel == "fused" and split_layouts:
        raise ValueError(
            "--optimizer-kernel fused with --channels-last needs gradients in the weights' "
            "layout, which Horovod's collectives refuse; use --optimizer-kernel foreach or auto"
        )
    fused = optimizer_kernel == "fused" or (
        optimizer_kernel == "auto" and device.type == "cuda" and not split_layouts
    )
    return Speed(
        device=device,
        precision=resolve_precision(precision, no_amp, device),
        channels_last=channels_last,
        compile=compile_model,
        fused_optimizer=fused,
        contiguous_grads=contiguous_grads,
    )


def configure_backends(speed: Speed) -> None:
    """cuDNN picks the fastest convolution algorithm for the (fixed) input shape once; TF32
    matmuls for what stays in fp32."""
    if speed.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def set_layout(model: nn.Module, speed: Speed) -> None:
    """Weights in channels-last layout (convolutions in NHWC) when asked. Called after the
    weights' broadcast, which, like every Horovod collective, takes contiguous tensors only;
    the parameters stay the same objects, so the optimizer keeps them."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        if speed.contiguous_grads:
            keep_grads_contiguous(model.parameters())


def match_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each weight's optimizer state (momentum) the weight's own layout. A state loaded
    from a checkpoint keeps the layout it was saved in, and the fused kernel, which reads
    weight and momentum as flat memory, would pair the wrong elements."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}  # a sharded optimizer's other shares: None
            for key, value in state.items():
                tensor = isinstance(value, torch.Tensor) and value.shape == p.shape
                if tensor and value.stride() != p.stride():
                    state[key] = torch.empty_like(p).copy_(value)


def keep_grads_contiguous(params: Iterable[nn.Parameter]) -> None:
    """A zeroed, contiguous gradient buffer for every parameter, before any backward pass (see
    the module docstring: Horovod's collectives refuse channels-last gradients). A gradient
    left by the optimizer state's broadcast was converted with its weight: replace it too."""
    # Autograd warns once that such a gradient breaks its layout contract: here it is the point.
    warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout")
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)


def zero_grads(optimizer: torch.optim.Optimizer, keep: bool) -> None:
    """Clear the gradients: in place when their buffers must keep their layout, else freed.

    Horovod's wrapper takes no ``set_to_none`` (it frees them), so the in-place zeroing calls
    torch's own ``Optimizer.zero_grad``, which zeroes them with one multi-tensor kernel per
    device and dtype under the foreach and fused optimizers :func:`sgd` makes. It is called
    after the step, where Horovod's check for gradients still being reduced has nothing to
    find."""
    if not keep:
        optimizer.zero_grad()
        return
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=False)


def sgd(params: Iterable[nn.Parameter], speed: Speed, **hyper: float) -> torch.optim.SGD:
    """SGD with one fused kernel for all parameters on a GPU, or the multi-tensor (foreach)
    kernels: either replaces a Python loop of small kernels per parameter."""
    if speed.fused_optimizer:
        return torch.optim.SGD(params, fused=True, **hyper)  # type: ignore[arg-type]
    return torch.optim.SGD(params, foreach=True, **hyper)  # type: ignore[arg-type]


def grad_scaler(speed: Speed) -> torch.amp.GradScaler | None:
    """Loss scaling for fp16 only: bf16 has fp32's exponent range and needs none."""
    return torch.amp.GradScaler("cuda") if speed.precision == "fp16" else None


def autocast(speed: Speed) -> contextlib.AbstractContextManager[Any]:
    dtype = speed.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(speed.device.type, dtype=dtype)


def forward_fn(model: nn.Module, speed: Speed) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the step calls to run the model: compiled when asked. The model itself stays the
    plain module, so checkpoints and model.pt keep their keys (a compiled wrapper's state dict
    prefixes every key with ``_orig_mod.``)."""
    if not speed.compile:
        return model
    return torch.compile(model)


def to_input(images: torch.Tensor, speed: Speed) -> torch.Tensor:
    """A batch as the model reads it: uint8 copied to the device without waiting (the loader
    pins it), converted there, in the model's layout. Normalisation is the model's first layer,
    so it runs on the device too."""
    images = images.to(speed.device, non_blocking=True).float()
    if speed.channels_last or speed.device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    return images
