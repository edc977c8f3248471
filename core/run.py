"""A run's names: its id, and where its outputs and local files go.

One definition, because the flow, ``--plan`` (which prints the paths a run would use) and the
steps in between must agree on them: the data gate pins its listing under the output prefix and
staging reads it from there, the trainer uploads into it and the scorer reads the model back.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path


def new_run_id(flow_run_id: object | None, now: datetime | None = None) -> str:
    """``<UTC time>-<first 8 characters of the flow run id>``: ids sort in the order runs
    started (the champion's history relies on it), and name the Prefect run they came from."""
    moment = now or datetime.now(UTC)
    return f"{moment:%Y%m%d-%H%M%S}-{str(flow_run_id or 'local')[:8]}"


def output_prefix(base: str, run_id: str) -> str:
    """Where a run's outputs go in the output container: ``<output.prefix>/runs/<run id>``."""
    return f"{base}/runs/{run_id}".lstrip("/")


@dataclass(frozen=True)
class Run:
    """One run's id and the two places its files go."""

    id: str
    output_prefix: str  # in the output container
    work_dir: Path  # on the orchestrator: the gate's Data Docs, before they are uploaded

    @classmethod
    def start(cls, flow_run_id: object | None, output_base: str, work_dir: Path) -> Run:
        run_id = new_run_id(flow_run_id)
        return cls(run_id, output_prefix(output_base, run_id), work_dir / "runs" / run_id)
