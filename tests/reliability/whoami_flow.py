"""A flow that writes the effective uid of the process that runs it: which account a worker's
flow runs run as."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow


@flow
def whoami(out: str) -> None:
    Path(out).write_text(f"{os.geteuid()}\n")
