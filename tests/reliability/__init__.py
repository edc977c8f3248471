"""The reliability suite's shared parts: the fault-injecting proxy and the report it writes."""

import os

import pytest


def trials(default: int = 3) -> list[object]:
    """Trial numbers for a parametrized fault test: the first runs in `make test`, the others
    are marked slow and run by `make reliability` (RETRAIN_RELIABILITY_TRIALS sets how many)."""
    count = max(1, int(os.environ.get("RETRAIN_RELIABILITY_TRIALS", str(default))))
    return [pytest.param(i, marks=pytest.mark.slow if i else ()) for i in range(count)]
