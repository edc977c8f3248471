"""A Python process whose import system refuses named packages: what runs in it provably needs
none of them (an ``import torch`` anywhere on its path raises instead of succeeding)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Every top-level package of this project (pyproject.toml's packages.find).
PROJECT = ("core", "common", "imagedata", "training", "staging", "gate", "registry", "flows")
PROJECT += ("tasks", "backends", "cli", "servers", "deployments", "bench", "scripts", "tests")

_PRELUDE = """\
import sys

class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in REFUSED:
            raise ImportError(name + " is refused in this process")
        return None

REFUSED = set(REFUSED_NAMES)
sys.meta_path.insert(0, _Refuse())
"""

_EPILOGUE = """
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in REFUSED)
assert not leaked, f"imported anyway: {leaked}"
"""


def run_refusing(
    refused: tuple[str, ...], code: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that refuses to import ``refused`` (and checks at
    the end that none of them is loaded)."""
    script = f"REFUSED_NAMES = {tuple(refused)!r}\n" + _PRELUDE + code + _EPILOGUE
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def onnx_docs_example() -> str:
    """The Python block of docs/onnx.md that labels an image with onnxruntime alone."""
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "onnx.md").read_text()
    section = page.split("## Labelling with onnxruntime alone", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/onnx.md has no Python example under its labelling heading"
    return match.group(1)


# Appended to the docs' example: every image of a test split labelled with its model_input()
# and session, and the accuracy printed.
ACCURACY = """
import pathlib

_images = sorted(pathlib.Path(TEST_SPLIT).rglob("*.png"))
_right = 0
for _start in range(0, len(_images), 64):
    _batch = _images[_start : _start + 64]
    _logits = session.run(None, {"images": np.stack([model_input(str(p)) for p in _batch])})[0]
    _right += sum(classes[int(i)] == p.parent.name for i, p in zip(_logits.argmax(1), _batch))
print("ACCURACY", json.dumps({"images": len(_images), "right": _right}))
"""


def label_with_onnxruntime_alone(model: Path, test_split: Path, work: Path) -> dict[str, int]:
    """Run docs/onnx.md's example over ``test_split`` (``<class>/<image>.png``) with ``model``,
    in a process that refuses torch and every package of this project; how many it got right."""
    import json
    import shutil

    work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, work / "model.onnx")
    shutil.copyfile(next(test_split.rglob("*.png")), work / "photo.jpg")  # the example's image
    code = f"TEST_SPLIT = {str(test_split)!r}\n" + onnx_docs_example() + ACCURACY
    proc = run_refusing(("torch", *PROJECT), code, work)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ACCURACY "))
    return dict(json.loads(line.split(" ", 1)[1]))
