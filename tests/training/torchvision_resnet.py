"""torchvision's own ResNet code, as ground truth for the project's ResNets.

torchvision cannot be imported here: its compiled ops are the CUDA build's, and the CPU torch
refuses them (docs/platform notes). Its architecture code, ``torchvision/models/resnet.py``, is
plain PyTorch, so it is taken from torchvision's published wheel (``pip download --no-deps``,
from PyPI or the configured index; cached under ``~/.cache/retrain-torchvision``), checked
against the SHA-256 recorded below, and executed in isolation: as the module
``tvsource.models.resnet`` of a package of stubs standing in for the imports it makes at module
level that only concern weight downloads, presets and telemetry (``..transforms._presets``,
``..utils``, ``._api``, ``._meta``, ``._utils``). Every line of ``conv3x3``, ``BasicBlock``,
``Bottleneck``, ``ResNet``, ``_resnet``, ``resnet18`` and ``resnet50`` runs as torchvision
wrote it.
"""

from __future__ import annotations

import enum
import hashlib
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

RELEASE = "0.28.0"  # the torchvision release that goes with torch 2.13
SOURCE = "torchvision/models/resnet.py"
SOURCE_SHA256 = "9faf2f321fdaf7edbd791aedc6e3610c7edf9c892112cbd75861beae1e9518d1"
CACHE = Path.home() / ".cache" / "retrain-torchvision"
PACKAGE = "tvsource"  # never "torchvision": nothing of a real install is shadowed or reused


def resnet_source() -> str:
    """The text of torchvision's resnet.py at :data:`RELEASE`, checked against its SHA-256."""
    cached = CACHE / RELEASE / "resnet.py"
    if not cached.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--quiet",
                    f"torchvision=={RELEASE}",
                    "-d",
                    tmp,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            (wheel,) = Path(tmp).glob("torchvision-*.whl")
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(SOURCE)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".tmp")
        partial.write_bytes(data)
        partial.replace(cached)
    data = cached.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != SOURCE_SHA256:
        raise AssertionError(f"{cached}: SHA-256 {got}, want {SOURCE_SHA256} ({SOURCE})")
    return data.decode()


class _Weights:
    """Stands in for ``torchvision.models._api.Weights``: metadata only, never fetched."""

    def __init__(self, **meta: Any) -> None:
        self.meta = meta


class _WeightsEnum(enum.Enum):
    @classmethod
    def verify(cls, obj: Any) -> Any:
        return obj


def _identity_decorator(*_args: Any, **_kwargs: Any) -> Any:
    return lambda fn: fn


def _stubs() -> dict[str, types.ModuleType]:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(f"{PACKAGE}.{name}" if name else PACKAGE)
        mod.__dict__.update(attrs)
        if name.count(".") == 0:
            mod.__path__ = []  # a package, for the relative imports below it
        return mod

    return {
        PACKAGE: module(""),
        f"{PACKAGE}.transforms": module("transforms"),
        f"{PACKAGE}.transforms._presets": module("transforms._presets", ImageClassification=object),
        f"{PACKAGE}.utils": module("utils", _log_api_usage_once=lambda _obj: None),
        f"{PACKAGE}.models": module("models"),
        f"{PACKAGE}.models._api": module(
            "models._api",
            register_model=_identity_decorator,
            Weights=_Weights,
            WeightsEnum=_WeightsEnum,
        ),
        f"{PACKAGE}.models._meta": module("models._meta", _IMAGENET_CATEGORIES=[]),
        f"{PACKAGE}.models._utils": module(
            "models._utils",
            _ovewrite_named_param=lambda kwargs, name, value: kwargs.__setitem__(name, value),
            handle_legacy_interface=_identity_decorator,
        ),
    }


def load_resnet_module() -> types.ModuleType:
    """torchvision's resnet.py executed as ``tvsource.models.resnet``; sys.modules is left as
    it was found."""
    source = resnet_source()
    stubs = _stubs()
    name = f"{PACKAGE}.models.resnet"
    saved = {k: sys.modules.get(k) for k in [*stubs, name]}
    sys.modules.update(stubs)
    try:
        module = types.ModuleType(name)
        module.__package__ = f"{PACKAGE}.models"
        module.__file__ = f"<torchvision {RELEASE} {SOURCE}>"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module
