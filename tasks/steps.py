"""What every step reports, and the one way a step is timed and recorded.

A step's body returns ``Done``: whether it ran or found its work already done, the details the
report shows, and the value later steps need (a code version, a score, a decision). ``step``
makes it a Prefect task of the step's name that times the body and returns a ``StepResult``:
the record and the value, kept apart, so nothing downstream digs a payload out of a report.
The report artifact, the flow's result and the benchmarks read the records, so they have one
shape everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, Literal, ParamSpec, TypeVar

from prefect import Task
from prefect.cache_policies import NONE

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class StepRecord:
    step: str
    status: Literal["ran", "skipped"]
    seconds: float
    details: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Done(Generic[T]):
    """What a step's body found: ``ran`` is False when its work was already done."""

    ran: bool
    value: T
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult(Generic[T]):
    record: StepRecord
    value: T


_FAILED_STEP = "retrain_failed_step"


def mark_failed_step(exc: BaseException, name: str) -> None:
    """Name the step ``exc`` came out of (the innermost, when a step calls another), so the
    run's record can say where it failed: the flow sees the exception, not the task run."""
    if getattr(exc, _FAILED_STEP, None) is None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, _FAILED_STEP, name)


def failed_step(exc: BaseException) -> str | None:
    """The step ``exc`` came out of; None when it did not come out of one."""
    value = getattr(exc, _FAILED_STEP, None)
    return value if isinstance(value, str) else None


def step(
    name: str, **task_options: Any
) -> Callable[[Callable[P, Done[T]]], Task[P, StepResult[T]]]:
    """A Prefect task named ``name`` (the step's name, said once) that times its body.

    Each attempt is timed on its own: a retried step reports the attempt that succeeded.
    Results are never cached (``cache_policy=NONE``): a step's inputs are clients and
    clusters, and whether its work is done is for the step itself to find out.
    """

    def decorate(body: Callable[P, Done[T]]) -> Task[P, StepResult[T]]:
        @functools.wraps(body)
        def timed(*args: P.args, **kwargs: P.kwargs) -> StepResult[T]:
            started = time.perf_counter()
            try:
                done = body(*args, **kwargs)
            except Exception as exc:
                mark_failed_step(exc, name)
                raise
            record = StepRecord(
                name,
                "ran" if done.ran else "skipped",
                round(time.perf_counter() - started, 3),
                done.details,
            )
            return StepResult(record, done.value)

        return Task(fn=timed, name=name, cache_policy=NONE, **task_options)

    return decorate
