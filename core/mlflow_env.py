"""MLflow's environment, set wherever the project talks to MLflow or starts its server.

MLflow's telemetry is off: MLflow's documented switch (``MLFLOW_DISABLE_TELEMETRY``, read when
``mlflow`` is imported and again before each event) stops its telemetry thread, which on a
machine with no route out once failed a tracking call of the run with ``KeyError
'_MLFLOW_TELEMETRY_SESSION_ID'``. Set before ``mlflow`` is first imported, no telemetry client is
made at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

TELEMETRY_OFF: Mapping[str, str] = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def mlflow_environment(
    env: MutableMapping[str, str] | None = None, defaults: Mapping[str, str] | None = None
) -> MutableMapping[str, str]:
    """``env`` (this process's environment by default) with MLflow's telemetry off, and each
    of ``defaults`` set where it is not set already (a value the user set is kept)."""
    target = os.environ if env is None else env
    target.update(TELEMETRY_OFF)
    for name, value in (defaults or {}).items():
        target.setdefault(name, value)
    return target
