"""The step's speed switches on CPU: the choices they resolve to, bf16 autocast, channels-last
weights under Horovod's collectives, fused SGD, and a compiled model whose outputs keep the
plain model's keys."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, Result, child_env, run_trainer, trainer_command
from training import speed as fast
from training.models import build_model

CPU = torch.device("cpu")


def _speed(**options: object) -> fast.Speed:
    chosen: dict[str, object] = {
        "precision": "auto",
        "no_amp": False,
        "channels_last": False,
        "compile_model": False,
        "optimizer_kernel": "auto",
        **options,
    }
    return fast.resolve(device=CPU, **chosen)  # type: ignore[arg-type]


def test_cpu_choices() -> None:
    assert _speed().precision == "fp32"  # autocast on CPU mostly adds casts
    assert _speed(precision="bf16").precision == "bf16"
    assert _speed(precision="bf16", no_amp=True).precision == "fp32"
    assert _speed().fused_optimizer is False
    assert _speed(optimizer_kernel="fused").fused_optimizer is True
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        _speed(precision="fp16")
    with pytest.raises(ValueError, match="--optimizer-kernel foreach or auto"):
        _speed(channels_last=True, optimizer_kernel="fused")
    gpu = fast.resolve(
        device=torch.device("cuda"),
        precision="fp32",
        no_amp=False,
        channels_last=True,
        compile_model=False,
        optimizer_kernel="auto",
    )
    assert gpu.fused_optimizer is False  # split layouts: see the next test


def _steps(speed: fast.Speed, reference: torch.nn.Module, steps: int = 1) -> list[torch.Tensor]:
    model = copy.deepcopy(reference)
    optimizer = fast.sgd(model.parameters(), speed, lr=0.1, momentum=0.9, weight_decay=5e-4)
    fast.set_layout(model, speed)
    images = torch.randint(0, 256, (8, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        torch.manual_seed(1)  # the same dropout masks in every run
        logits = model(fast.to_input(images, speed))
        torch.nn.functional.cross_entropy(logits, torch.arange(8)).backward()
        optimizer.step()
        fast.zero_grads(optimizer, keep=speed.channels_last)
    return [p.detach() for p in model.parameters()]


@pytest.mark.processes
def test_channels_last_steps_equal_the_contiguous_ones() -> None:
    """Channels-last weights with contiguous gradients take the same steps as the plain model;
    the fused kernel on those split layouts did not (why ``resolve`` refuses it: 3e-2 apart
    after two steps). Two steps, so the momentum buffers are updated and not only created, from
    seeded weights: the layouts sum in other orders, and from some random initial weights (1
    in 25) a ReLU flipped by a last-bit difference moved weights by 5e-4, which says nothing
    about the optimizer (1.2e-7 apart from these)."""
    torch.manual_seed(0)
    reference = build_model("cnn", 10)
    plain = _steps(_speed(optimizer_kernel="foreach"), reference, steps=2)
    split = _steps(_speed(channels_last=True), reference, steps=2)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, split, strict=True)) < 1e-5
    fused = _steps(_speed(optimizer_kernel="fused"), reference, steps=2)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, fused, strict=True)) < 1e-5


@pytest.mark.processes
def test_bf16_channels_last_forward_and_step() -> None:
    speed = _speed(precision="bf16", channels_last=True)
    model = build_model("cnn", 10)
    fast.set_layout(model, speed)
    convs = [p for p in model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert not all(p.is_contiguous() for p in convs)
    optimizer = fast.sgd(model.parameters(), speed, lr=0.1, momentum=0.9)
    images = fast.to_input(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), speed)
    with fast.autocast(speed):
        logits = model(images)
    assert logits.dtype == torch.bfloat16
    torch.nn.functional.cross_entropy(logits.float(), torch.arange(8)).backward()
    # autograd accumulated into the contiguous buffers rather than replacing them
    assert all(p.grad is not None and p.grad.is_contiguous() for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    fast.zero_grads(optimizer, keep=True)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.processes
@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_channels_last_weights_under_two_ranks(engine: str, tmp_path: Path) -> None:
    """Horovod's collectives refuse non-contiguous tensors, which channels-last weights would
    give them as gradients; DDP builds its buckets on the weights' layout."""
    result = run_trainer(
        2,
        "synthetic:400",
        tmp_path / "out",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--channels-last",
        "--precision",
        "bf16",
        engine=engine,
    )
    assert result.returncode == 0, result.output
    m = result.metrics
    assert m["speed"] == {
        "precision": "bf16",
        "channels_last": True,
        "compile": False,
        "fused_optimizer": False,
    }
    assert m["weights_digest_per_rank"][0] == m["weights_digest_per_rank"][1]
    assert m["test_accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_momentum_loaded_in_another_layout_takes_the_weights_layout() -> None:
    """A checkpoint's momentum keeps the layout it was saved in; the fused kernel pairs weight
    and momentum as flat memory, so a resumed channels-last run must convert it."""
    reference = build_model("cnn", 10)
    plain = _speed(optimizer_kernel="fused")
    saved = copy.deepcopy(reference)
    optimizer = fast.sgd(saved.parameters(), plain, lr=0.1, momentum=0.9)
    images = fast.to_input(torch.randint(0, 256, (8, 3, 32, 32)), plain)
    torch.nn.functional.cross_entropy(saved.eval()(images), torch.arange(8)).backward()
    optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())

    def resumed(speed: fast.Speed) -> list[torch.Tensor]:
        model = copy.deepcopy(saved)
        fast.set_layout(model, speed)
        opt = fast.sgd(model.parameters(), speed, lr=0.1, momentum=0.9)
        opt.load_state_dict(copy.deepcopy(state))  # loading shares the tensors
        fast.match_state_layout(opt)
        for p in model.parameters():
            assert opt.state[p]["momentum_buffer"].stride() == p.stride()
            p.grad = torch.ones_like(p)
        opt.step()
        return [p.detach() for p in model.parameters()]

    channels_last = fast.resolve(
        device=CPU,
        precision="fp32",
        no_amp=False,
        channels_last=True,
        compile_model=False,
        optimizer_kernel="fused",
        contiguous_grads=False,  # as under DDP
    )
    want, got = resumed(plain), resumed(channels_last)
    assert max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True)) < 1e-6


@pytest.mark.processes
def test_compiled_model_trains_without_recompiling_and_saves_plain_keys(tmp_path: Path) -> None:
    """248 training images in batches of 16 leave a last batch of 8: compiled, the step drops
    it rather than compile again for its shape (the compiler's own log of recompilations,
    ``TORCH_LOGS=recompiles``, stays empty over two epochs)."""
    out = tmp_path / "out"
    cmd = trainer_command(1, "synthetic:310", out, "--epochs", "2", "--batch-size", "16")
    proc = subprocess.run(
        [*cmd, "--compile"],
        cwd=ROOT,
        env={**child_env(), "TORCH_LOGS": "recompiles"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    result = Result(proc.returncode, proc.stdout, out)
    assert result.returncode == 0, result.output
    assert result.metrics["speed"]["compile"] is True
    assert result.metrics["dataset"]["num_train"] == 248
    # Less the slice early stopping watches (synthetic data has no val split), in full batches.
    trained = 248 - result.metrics["early_stopping"]["images"]
    assert [e["images"] for e in result.metrics["epochs"]] == [trained // 16 * 16] * 2
    assert "Recompiling" not in result.output
    assert result.metrics["test_accuracy"] > 0.3
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert saved["state_dict"] and not any("_orig_mod" in k for k in saved["state_dict"])
    fresh = build_model("cnn", 10)
    fresh.load_state_dict(saved["state_dict"])  # the scorer's way in: must not raise
