"""The run's record (``registry/run_record.py``) kept as the run goes: asked-for data when it
starts, the chosen data version once the gate has it, and how it ended.

Plain functions the flow calls, not steps: the record describes the steps, and a run whose
record cannot be written at its start fails before anything is paid for.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger

from backends.blob import container_client
from core.config import PipelineConfig
from core.data_versions import DataVersion
from core.run import Run
from registry.run_record import Outcome, RunRecord, error_summary, write_run_record
from tasks.steps import failed_step


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class RunLog:
    """Writes ``run.json`` into the run's outputs at each turn of the run."""

    def __init__(self, config: PipelineConfig, run: Run) -> None:
        self.outputs = container_client(config.output, config.retries.storage_retries, create=True)
        self.run = run
        data = config.data
        asked = {"container": data.container, "root": data.prefix, "version": data.version}
        self.record = RunRecord(run.id, "running", _now(), asked)
        self._write()

    def _write(self) -> None:
        write_run_record(self.outputs, self.run.output_prefix, self.record)

    def chose(self, version: DataVersion) -> None:
        self.record = self.record.but(data=version.as_record())
        self._write()

    def ended(
        self,
        outcome: Outcome,
        reason: str,
        accuracy: float | None = None,
        matched_run: str | None = None,
    ) -> None:
        self.record = self.record.but(
            outcome=outcome,
            reason=reason,
            accuracy=accuracy,
            matched_run=matched_run,
            finished_at=_now(),
        )
        self._write()

    def paid(self, cost: dict[str, Any] | None) -> None:
        """What the run paid and was estimated to, kept for the estimates and the budget of
        later runs (whatever its outcome: a failed run paid too); never raises."""
        if cost is None:
            return
        try:
            self.record = self.record.but(cost=cost)
            self._write()
        except Exception as problem:
            get_run_logger().warning("could not record the run's cost: %s", problem)

    def failed(self, exc: BaseException) -> None:
        """Record the failure; never raises (the run's own error is the one to see)."""
        try:
            self.record = self.record.but(
                outcome="failed",
                reason=error_summary(exc),
                failed_step=failed_step(exc),
                finished_at=_now(),
            )
            self._write()
        except Exception as problem:
            get_run_logger().warning("could not record the run's failure: %s", problem)
