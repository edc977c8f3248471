"""A Python process whose import system refuses named packages: what runs in it provably needs
none of them (an ``import torch`` anywhere on its path raises instead of succeeding)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Every top-level package of this project (pyproject.toml's packages.find).
PROJECT = ("core", "training", "staging", "gate", "registry", "flows", "tasks", "backends")
PROJECT += ("deployments", "bench", "scripts", "tests")

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
