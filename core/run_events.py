"""The Prefect events a retrain run emits for people to be told of: it failed (naming its step),
or it promoted a new champion. ``python -m deployments.setup`` turns them into notifications
through a notification block (deployments/alerts.py); a run that crashes (its process gone, so
it emits nothing) is told by Prefect's own ``prefect.flow-run.Crashed`` event.

Each event's resource is the retrain run (``retrain.run.<run id>``); Prefect relates the flow
run, its flow and deployment from the run's context, so a notification can name and link them.
Emitting never raises: telling people must not change how a run ends.
"""

from __future__ import annotations

import logging
from typing import Any

RUN_FAILED = "retrain.run.failed"
MODEL_PROMOTED = "retrain.model.promoted"
RESOURCE_PREFIX = "retrain.run."
FLOW_NAME = "retrain"  # the flow whose crashes are told
MAX_TEXT = 1000  # characters of a reason in an event (events are limited in size)
log = logging.getLogger("retrain.events")


def _text(value: str) -> str:
    return value if len(value) <= MAX_TEXT else f"{value[: MAX_TEXT - 3]}..."


def _emit(event: str, run_id: str, payload: dict[str, Any]) -> None:
    try:
        from prefect.events import emit_event

        emit_event(
            event,
            resource={
                "prefect.resource.id": f"{RESOURCE_PREFIX}{run_id}",
                "prefect.resource.name": run_id,
            },
            payload=payload,
        )
    except Exception as exc:  # a notification lost, never a run changed
        log.warning("could not emit %s for run %s: %s", event, run_id, exc)


def run_failed(run_id: str, step: str | None, reason: str) -> None:
    """A run failed in ``step`` (None: before its first step, e.g. a config it could not
    load); ``reason``: the error, credentials already taken out."""
    _emit(
        RUN_FAILED,
        run_id,
        {"run_id": run_id, "step": step or "before its first step", "reason": _text(reason)},
    )


def model_promoted(run_id: str, data_root: str, reason: str, metric: str) -> None:
    """The run's model became the champion of ``data_root``."""
    _emit(
        MODEL_PROMOTED,
        run_id,
        {"run_id": run_id, "data_root": data_root, "reason": _text(reason), "metric": metric},
    )
