"""`make demo` as a person runs it (scripts/demo.py): it ends by saying how to look at the run it
made, and ``--keep`` (``make demo DEMO_ARGS=--keep``) leaves Azurite, the Prefect UI and the
outputs gateway up until Ctrl-C. Before, nothing was left to look at: the temporary Prefect
server was gone, and the run's page with it."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from backends.local.ports import free_port
from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.processes  # each test starts the command it checks

FLOW_RUN = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")


def _get(url: str, accept: str = "*/*") -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status), response.headers["Content-Type"], response.read()


def _closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_demo_says_where_its_run_is_and_keep_leaves_it_open(tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:10]
    gateway = free_port()
    # The demo's config, on containers, folders, a pool and ports of this test's own; one rank
    # and one epoch (what is checked is where the run can be looked at, not how it learns).
    sets = [
        f"data.container=demo-data-{suffix}",
        f"output.container=demo-out-{suffix}",
        f"share.local_dir={tmp_path / 'share'}",
        f"nfs.local_dir={tmp_path / 'nfs'}",
        f"work_dir={tmp_path / 'work'}",
        f"pool.id=demo-{suffix}",
        f"output.links_url=http://127.0.0.1:{gateway}",
        "training.epochs=1",
        # One epoch is near chance: no floor, or whether there is a champion to download is
        # chance too.
        "promotion.minimum.class_recall=null",
        "pool.processes_per_node=1",
        "image.builder=none",
        f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}",  # nothing listens there
    ]
    command = [
        sys.executable,
        "scripts/demo.py",
        "--dir",
        str(tmp_path / "demo"),
        *[arg for s in sets for arg in ("--set", s)],
    ]
    env = child_env()
    env.pop("PREFECT_API_URL", None)  # the demo as typed on a fresh machine: no server running
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")

    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    said = first.stdout[first.stdout.index("demo finished in") :]  # its last lines
    assert "to look at the run: `.venv/bin/prefect server start`, then open " in said, said
    page = FLOW_RUN.search(said)
    assert page and said.count("http://127.0.0.1:4200/runs/flow-run/") == 1, said
    assert "make demo DEMO_ARGS=--keep" in said
    trained = re.search(r"^run (\S+): test accuracy", first.stdout, re.M)
    assert trained, first.stdout
    assert (tmp_path / "demo" / "model.pt").is_file()
    # No tracking server: one line says so, and the run does not warn on every request.
    assert ": this run is not tracked" in first.stdout, first.stdout
    assert "Connection refused" not in first.stdout + first.stderr

    # Then with --keep: a run of the same inputs (up to date), on a Prefect server it keeps up.
    azurite, prefect = free_port(), free_port()
    kept = subprocess.Popen(
        [*command, "--keep", f"--port={azurite}", f"--prefect-port={prefect}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(900, kept.kill)
    watchdog.start()
    try:
        assert kept.stdout is not None
        lines: list[str] = []
        for line in kept.stdout:  # until it says it holds everything up (or exits)
            lines.append(line)
            if "until Ctrl-C stops them all" in line:
                break
        output = "".join(lines)
        assert kept.poll() is None, output
        assert "nothing trained" in output  # the same inputs: up to date
        shown = next(x for x in lines if x.startswith("the run: "))
        own = FLOW_RUN.search(shown)
        assert own and f"http://127.0.0.1:{prefect}/runs/flow-run/" in shown, shown
        api = f"http://127.0.0.1:{prefect}/api"
        # The run the first demo named is on the kept server's UI, and so is this one.
        for flow_run in (page.group(1), own.group(1)):
            status, _, body = _get(f"{api}/flow_runs/{flow_run}")
            record: dict[str, Any] = json.loads(body)
            assert status == 200 and record["state_type"] == "COMPLETED", record
        # The page itself, as a browser asks for it (the UI answers its routes to HTML requests).
        status, kind, _ = _get(shown.split()[2], accept="text/html")
        assert status == 200 and kind.startswith("text/html")
        # The run's links open: the outputs gateway serves the trained run's outputs.
        assert f"its links (outputs, Data Docs): http://127.0.0.1:{gateway}/" in output
        status, _, body = _get(f"http://127.0.0.1:{gateway}/runs/{trained.group(1)}/score.json")
        assert status == 200 and "accuracy" in json.loads(body)
        assert f"Azurite on 127.0.0.1:{azurite}" in output and not _closed(azurite)
        kept.send_signal(signal.SIGINT)  # Ctrl-C
        rest, _ = kept.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if kept.poll() is None:
            kept.kill()
            kept.wait()
    assert kept.returncode == 0, output + rest
    assert "stopped: the outputs gateway, the Prefect server and Azurite" in rest
    assert all(_closed(port) for port in (azurite, prefect, gateway))
