"""What a run prints in a person's terminal: its own lines, not the libraries' chatter.

Each test runs the real component (the Great Expectations gate, Azurite, the command line's
Prefect settings) and reads what it wrote where a person would see it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ValidationConfig
from tests.gate_helpers import valid_manifest_rows

pytestmark = pytest.mark.processes  # each test starts the command it checks


def test_gate_draws_no_progress_bars(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from gate.suites import run_expectations

    rules = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)
    passed, records = run_expectations(valid_manifest_rows(), rules, tmp_path / "docs")
    out, err = capfd.readouterr()
    assert passed, [r for r in records if not r["success"]]
    assert "Calculating Metrics" not in out + err  # GX's tqdm bars, one set per metrics pass
    assert (tmp_path / "docs" / "index.html").is_file()  # the run's Data Docs still built


# What Prefect hands the temporary server process: the settings the person set explicitly, plus
# those of a `temporary_settings` block (prefect/server/api/server.py, _run_uvicorn_command).
_PROBE = """
import json, sys
from prefect.settings import (
    PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    get_current_settings,
)
from flows.temporary_server import temporary_server_settings

said = []
with temporary_server_settings(say=said.append):
    server_env = get_current_settings().to_environment_variables(exclude_unset=True)
    print(json.dumps({
        "timeout": PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(),
        "analytics": PREFECT_SERVER_ANALYTICS_ENABLED.value(),
        "server_analytics": server_env.get("PREFECT_SERVER_ANALYTICS_ENABLED"),
        "said": said,
    }))
"""


def _probe(tmp_path: Path, **env: str) -> dict[str, object]:
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GX_"))}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "home"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_temporary_server_gets_time_to_start_and_no_telemetry_when_unset(tmp_path: Path) -> None:
    from flows.temporary_server import STARTUP_TIMEOUT_SECONDS

    seen = _probe(tmp_path)
    assert seen["timeout"] == STARTUP_TIMEOUT_SECONDS > 20  # Prefect's default: 20 s
    assert seen["analytics"] is False
    assert seen["server_analytics"] == "False"  # what the server subprocess is started with
    (line,) = seen["said"]  # type: ignore[misc]
    assert "temporary Prefect server" in line and "PREFECT_API_URL=" in line
    assert f"up to {STARTUP_TIMEOUT_SECONDS} s" in line


def test_temporary_server_settings_a_person_set_are_kept(tmp_path: Path) -> None:
    seen = _probe(
        tmp_path,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="45",
        PREFECT_SERVER_ANALYTICS_ENABLED="true",
    )
    assert (seen["timeout"], seen["analytics"], seen["server_analytics"]) == (45, True, "True")
    assert "up to 45 s" in seen["said"][0]  # type: ignore[index]


def test_no_temporary_server_line_with_a_configured_server(tmp_path: Path) -> None:
    seen = _probe(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert seen["said"] == [] and seen["timeout"] == 20  # nothing changed: the server is theirs
