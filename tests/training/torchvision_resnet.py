"""torchvision's own ResNet code, as ground truth for the project's ResNets.

torchvision cannot be imported here: its compiled ops are the CUDA build's, and the CPU torch
refuses them (docs/platform notes). Its architecture code, ``torchvision/models/resnet.py``, is
plain PyTorch, so ``make setup`` takes it from torchvision's published wheel (``python -m
tests.training.torchvision_resnet``: ``pip download --no-deps`` from PyPI or the configured
index) into the virtual environment, checked against the SHA-256 recorded below. The tests only
read that file: a test never downloads. It is executed in isolation: as the module
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

from common.atomic import atomic_write

RELEASE = "0.28.0"  # the torchvision release that goes with torch 2.13
SOURCE = "torchvision/models/resnet.py"
SOURCE_SHA256 = "9faf2f321fdaf7edbd791aedc6e3610c7edf9c892112cbd75861beae1e9518d1"
PACKAGE = "tvsource"  # never "torchvision": nothing of a real install is shadowed or reused


# In the virtual environment `make setup` made: gone with it, and fetched again with it.
INSTALLED = Path(sys.prefix) / "share" / "retrain-torchvision" / RELEASE / "resnet.py"


def fetch(target: Path = INSTALLED) -> Path:
    """torchvision's resnet.py at :data:`RELEASE` from its wheel into ``target`` (``make
    setup``); nothing is fetched when ``target`` holds it already."""
    if target.is_file() and _sha256(target.read_bytes()) == SOURCE_SHA256:
        return target
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
    got = _sha256(data)
    if got != SOURCE_SHA256:
        raise SystemExit(f"torchvision {RELEASE} {SOURCE}: SHA-256 {got}, want {SOURCE_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda fh: fh.write(data))
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def resnet_source(path: Path = INSTALLED) -> str:
    """The text of torchvision's resnet.py at :data:`RELEASE`, checked against its SHA-256."""
    if not path.is_file():
        raise AssertionError(
            f"{path} is missing: `make setup` fetches it (python -m tests.training."
            "torchvision_resnet); a test never downloads"
        )
    data = path.read_bytes()
    got = _sha256(data)
    if got != SOURCE_SHA256:
        raise AssertionError(f"{path}: SHA-256 {got}, want {SOURCE_SHA256} ({SOURCE})")
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


if __name__ == "__main__":
    print(f"torchvision {RELEASE} {SOURCE}: {fetch()}")
