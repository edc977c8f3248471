"""How every benchmark hands over its figures: printed, and as JSON for ``bench.report``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[1]


def emit(report: dict[str, Any], path: Path | None) -> int:
    """Print ``report``; also write it to ``path`` (whole or not at all) when one is given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        atomic_write(path, lambda fh: fh.write(text.encode()))
    return 0


def dataset_main(
    parser: argparse.ArgumentParser,
    name: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    argv: list[str] | None,
) -> int:
    """The options every benchmark on generated datasets shares; then run it and emit."""
    parser.add_argument(
        "--source", type=Path, default=ROOT / ".bench" / "source", help="datasets, reused"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".bench" / name, help="scratch")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    return emit(run(args), args.json)
