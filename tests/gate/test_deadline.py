"""The data gate's reads are bounded by validation.timeout_minutes: a blob whose read never
ends fails the gate, naming it, instead of holding the run and its pool."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from backends.blob import container_client, upload_directory
from core.run import Run
from tests.pipeline_helpers import make_config
from tests.reliability.fault_proxy import FaultProxy

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_read_that_never_ends_fails_the_gate_naming_the_blob(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow

    from tasks.validate import validate_data
    from tests.reliability import report

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path, "validation.timeout_minutes=0.05")
    upload_directory(container_client(config.data, create=True), small_folders, "digits")
    stuck = sorted(p for p in small_folders.rglob("*.png"))[0].relative_to(small_folders)
    released = threading.Event()
    proxy = FaultProxy(urlparse(azurite.split("BlobEndpoint=")[1].split(";")[0]).port or 0)

    def hold(path: str, headers: dict[str, str]) -> None:
        if path.endswith(stuck.as_posix()):
            released.wait(120)  # an answer that does not come while the gate waits

    proxy.before_get = hold
    parts = dict(kv.split("=", 1) for kv in azurite.split(";") if kv)
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        proxy.connection_string(parts["AccountName"], parts["AccountKey"]),
    )

    @flow
    def gate() -> Any:
        return validate_data(config, Run("r-stuck", "runs/r-stuck", tmp_path / "r-stuck"))

    try:
        state = gate(return_state=True)
    finally:
        released.set()
        proxy.close()
    assert state.is_failed()
    assert "validation.timeout_minutes (0.05)" in state.message
    assert f"still reading: {stuck.as_posix()}" in state.message
    report.record(
        "adversarial",
        "gate: a blob whose read never ends (validation.timeout_minutes=0.05)",
        "gate fails after 3 s, naming the blob still being read; nothing provisioned",
        before_fix="no bound: the run waited in the gate as long as the read did",
        message=state.message,
    )
