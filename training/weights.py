"""Starting a training from weights (``--init-from PATH``): read them, check them, carry them.

Two kinds of file start a training:

- a ``model.pt`` this project's trainer wrote (it names its network, input size and classes):
  the whole network is carried, and the classifier's row of each class the new data set shares
  with it, by class name, whatever its index; a class the file does not know gets a freshly
  initialised row, and a class the data no longer has is dropped;
- a plain state dict of the same network, such as the ImageNet weights torchvision publishes
  for ``resnet18``/``resnet50`` (``models.py`` uses torchvision's names): the backbone is
  carried and the classifier, whose classes have no names here, starts afresh.

Everything is checked before a weight is applied, so a file that cannot start this training
(not a state dict, truncated, NaNs, another network, another input size, other shapes, a later
format, not the bytes the pipeline checked) stops the trainer at its start with
:class:`InitFromError`, naming the file and what is wrong, before any step is trained. The file is
loaded with ``weights_only``: a weights file from anywhere must not be able to run code. Nor may
it take the node's memory: torch reads each member of its zip archive into memory at the size
the archive declares, inflating compressed ones, so a file of 1 MB could declare 1 GB. The
archive's directory is read first, and a file whose members declare more than the file itself
holds (torch.save stores every member as it is, so its members never do), or more than any
weights file of these networks, is refused before anything is loaded.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.atomic import file_md5
from training.architectures import ARCHITECTURES
from training.models import (
    MODEL_FORMAT_VERSION,
    NETWORK,
    classifier_prefix,
    upgrade_state_dict,
)

MODEL_FILE_KEYS = {"state_dict", "class_names", "model_name", "input_size"}
# The largest weights file a training starts from: resnet50's model.pt is about 95 MB, so this is
# ten times the largest network's, and far less than a node's memory.
MAX_WEIGHTS_BYTES = 1 << 30


class InitFromError(ValueError):
    """The weights named by ``--init-from`` cannot start this training; the message names the
    file and what is wrong with it."""


@dataclass(frozen=True)
class StartingWeights:
    """A weights file, read and checked, in ``build_model``'s key names."""

    path: Path
    md5: str  # base64, as Blob storage and metrics.json's model_md5 write it
    kind: str  # "model file" (this project's model.pt) or "state dict"
    state: dict[str, torch.Tensor]
    class_names: list[str] | None = None  # a model file's classes, in its classifier's order
    model_name: str | None = None
    input_size: int | None = None


@dataclass(frozen=True)
class Carried:
    """What a training took from its starting weights: metrics.json's ``init_from``."""

    source: str
    md5: str
    kind: str
    run_id: str | None
    classes_carried: list[str]
    classes_new: list[str]
    classes_dropped: list[str] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "md5": self.md5,
            "kind": self.kind,
            "run_id": self.run_id,
            "classes_carried": self.classes_carried,
            "classes_new": self.classes_new,
            "classes_dropped": self.classes_dropped,
        }


def _unreadable(path: Path, why: str) -> InitFromError:
    return InitFromError(
        f"--init-from {path} cannot be read as PyTorch weights: truncated, or not a file "
        f"torch.save wrote ({why})"
    )


def check_archive(path: Path) -> None:
    """Refuse, before torch reads a byte of it, a weights file that would take more memory than
    it holds: larger than ``MAX_WEIGHTS_BYTES``, not the zip archive torch.save writes (the
    legacy format, older than torch 1.6, declares its storages' sizes in its pickle, unbounded
    until read), or with members that declare more bytes than the file holds or are
    compressed (a deflated member inflates when read; torch.save never writes one)."""
    size = path.stat().st_size
    if size > MAX_WEIGHTS_BYTES:
        raise InitFromError(
            f"--init-from {path} is {size} bytes, more than the {MAX_WEIGHTS_BYTES} a weights "
            "file of these networks may be (resnet50's model.pt is about 95 MB)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise _unreadable(
            path, f"not the zip archive torch.save writes: {type(exc).__name__}: {first}"
        ) from None
    declared = sum(m.file_size for m in members)
    packed = [m for m in members if m.compress_type != zipfile.ZIP_STORED]
    if declared > size or packed:
        largest = max(members, key=lambda m: m.file_size)
        how = (
            f"{len(packed)} of its members compressed (torch.save stores them as they are), "
            if packed
            else ""
        )
        raise InitFromError(
            f"--init-from {path}: its members declare {declared} bytes in a file of {size} "
            f"({how}the largest, {largest.filename!r}, {largest.file_size} bytes): reading it "
            "would take that much memory; refused before loading"
        )


def _check(path: Path) -> None:
    """What is checked of the file before a byte of it is read: that it is one, and its
    archive's declared sizes."""
    if path.is_dir():
        raise InitFromError(f"--init-from {path} is a folder, not a weights file")
    if not path.is_file():
        raise InitFromError(f"--init-from {path} is not a regular file (a device, a pipe)")
    try:
        check_archive(path)
    except FileNotFoundError:
        raise InitFromError(f"--init-from {path} does not exist") from None
    except PermissionError:
        raise InitFromError(f"--init-from {path} cannot be read (permission denied)") from None


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InitFromError(f"--init-from {path} does not exist") from None
    except PermissionError:
        raise InitFromError(f"--init-from {path} cannot be read (permission denied)") from None
    except Exception as exc:  # torch raises many types for a cut or foreign file
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise _unreadable(path, f"{type(exc).__name__}: {first}") from None


def _model_file(path: Path, saved: dict[str, Any]) -> tuple[dict[str, Any], list[str], str, int]:
    version = saved.get("format_version", 1)
    if type(version) is not int or version > MODEL_FORMAT_VERSION:
        raise InitFromError(
            f"--init-from {path} has model format version {version!r}: written by a later "
            f"trainer than this one (which reads up to {MODEL_FORMAT_VERSION})"
        )
    names, name, size = saved["class_names"], saved["model_name"], saved["input_size"]
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise InitFromError(f"--init-from {path}: class_names is not a list of class names")
    if len(set(names)) != len(names):
        raise InitFromError(f"--init-from {path}: class_names names a class twice")
    if name not in ARCHITECTURES:
        raise InitFromError(
            f"--init-from {path}: model_name {name!r} is not one of {sorted(ARCHITECTURES)}"
        )
    if type(size) is not int or size < 1:
        raise InitFromError(f"--init-from {path}: input_size {size!r} is not a size in pixels")
    state = saved["state_dict"]
    if not isinstance(state, dict):
        raise InitFromError(f"--init-from {path}: its state_dict is not a dict of tensors")
    return upgrade_state_dict(name, state), names, name, size


def read_weights(path: Path) -> StartingWeights:
    """The weights in ``path``, checked to be whole and finite; InitFromError says why not."""
    if not path.exists():
        raise InitFromError(f"--init-from {path} does not exist")
    _check(path)
    md5 = file_md5(path)
    saved = _load(path)
    if isinstance(saved, dict) and saved.keys() >= MODEL_FILE_KEYS:
        state, names, name, size = _model_file(path, saved)
        kind: str = "model file"
    elif isinstance(saved, dict) and {"format_version", "model", "optimizer"} <= saved.keys():
        raise InitFromError(
            f"--init-from {path} is a training checkpoint, which names no classes: start from "
            "the model.pt its run wrote"
        )
    elif (
        isinstance(saved, dict)
        and saved
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in saved.items())
    ):
        state, names, name, size, kind = saved, None, None, None, "state dict"
    else:
        what = type(saved).__name__ if not isinstance(saved, dict) else "dict of other things"
        raise InitFromError(
            f"--init-from {path} holds a {what}: neither a state dict (parameter name -> "
            "tensor) nor a model.pt of this trainer"
        )
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise InitFromError(
                f"--init-from {path}: {key} is a {type(tensor).__name__}, not a tensor"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InitFromError(
                f"--init-from {path}: {key} holds NaN or infinite values (a training that "
                "diverged, or a damaged file)"
            )
    return StartingWeights(path, md5, kind, dict(state), names, name, size)


def _in_model_names(
    state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A plain state dict's keys as ``build_model``'s: torchvision's names are the network's,
    which build_model keeps under ``1.``."""
    if any(k in want for k in state):
        return state
    return {f"{NETWORK}.{k}": v for k, v in state.items()}


def check_fits(weights: StartingWeights, model_name: str, input_size: int) -> None:
    """Refuse a model file of another network or input size: its weights were learnt for
    other pictures, or do not fit at all."""
    path = weights.path
    if weights.model_name is not None and weights.model_name != model_name:
        raise InitFromError(
            f"--init-from {path} is a {weights.model_name}; this training is a {model_name} "
            "(--model): start from a model of the same network"
        )
    if weights.input_size is not None and weights.input_size != input_size:
        raise InitFromError(
            f"--init-from {path} was trained on {weights.input_size} px images; this training "
            f"reads {input_size} px (--image-size): start from a model of the same input size"
        )


def carry(
    weights: StartingWeights,
    model: nn.Module,
    model_name: str,
    input_size: int,
    class_names: list[str],
    source: str | None = None,
    run_id: str | None = None,
) -> Carried:
    """Load what ``weights`` can give into ``model`` (``build_model(model_name, len(class_names))``,
    freshly initialised): the whole network but its classifier, and the classifier's rows of
    the classes both know. Nothing is applied unless everything fits."""
    check_fits(weights, model_name, input_size)
    path = weights.path
    want = model.state_dict()
    head = classifier_prefix(model_name)
    head_keys = {f"{head}.weight", f"{head}.bias"}
    state = _in_model_names(weights.state, want)
    # The normalisation's constants are the model's own (a plain state dict has none).
    network = {k for k in want if k.startswith(f"{NETWORK}.")}
    have = set(state) - {k for k in state if not k.startswith(f"{NETWORK}.")}
    if have - head_keys != network - head_keys:
        missing = sorted((network - head_keys) - have)[:3]
        extra = sorted((have - head_keys) - network)[:3]
        raise InitFromError(
            f"--init-from {path} is not a {model_name}: its parameters differ from the "
            f"network's (missing e.g. {missing}, unknown e.g. {extra})"
        )
    for key in sorted(network - head_keys):
        if tuple(state[key].shape) != tuple(want[key].shape):
            raise InitFromError(
                f"--init-from {path}: {key} is {tuple(state[key].shape)}, the {model_name}'s "
                f"is {tuple(want[key].shape)}"
            )
    new = {k: v.clone() for k, v in want.items()}
    for key in network - head_keys:
        new[key] = state[key].to(want[key].dtype)
    carried: list[str] = []
    dropped: list[str] = []
    weight, bias = f"{head}.weight", f"{head}.bias"
    if weights.class_names is not None:
        old_w, old_b = state.get(weight), state.get(bias)
        rows = len(weights.class_names)
        if (
            old_w is None
            or old_b is None
            or tuple(old_w.shape) != (rows, want[weight].shape[1])
            or tuple(old_b.shape) != (rows,)
        ):
            shown = tuple(old_w.shape) if old_w is not None else None
            raise InitFromError(
                f"--init-from {path}: its classifier {weight} is {shown}, not one row of "
                f"{want[weight].shape[1]} per class of its {rows} class names"
            )
        index = {name: i for i, name in enumerate(weights.class_names)}
        for row, name in enumerate(class_names):
            if name in index:
                new[weight][row] = old_w[index[name]].to(want[weight].dtype)
                new[bias][row] = old_b[index[name]].to(want[bias].dtype)
                carried.append(name)
        dropped = [n for n in weights.class_names if n not in set(class_names)]
    model.load_state_dict(new, strict=True)
    fresh = [n for n in class_names if n not in set(carried)]
    return Carried(source or str(path), weights.md5, weights.kind, run_id, carried, fresh, dropped)


def network_parameters(
    model: nn.Module, model_name: str
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``build_model``'s parameters split into the backbone's and the classifier's, for their
    optimizer groups (the classifier learns at the full rate, the backbone at a scaled one)."""
    head = classifier_prefix(model_name) + "."
    backbone: list[nn.Parameter] = []
    classifier: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        (classifier if name.startswith(head) else backbone).append(param)
    return backbone, classifier
