"""A flow that runs until it is stopped: what a worker is running when it is killed."""

from __future__ import annotations

import time

from prefect import flow


@flow
def long_flow(seconds: float = 600.0) -> None:
    time.sleep(seconds)
