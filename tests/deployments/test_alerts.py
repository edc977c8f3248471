"""Alerts (deployments/alerts.py) under a real Prefect server, whose trigger and action services
send them, to a webhook receiver on this machine: a failed run, a crash and a promotion each
produce exactly one notification, naming the run (and the failed step); a notification block
that does not exist, or cannot notify, is an error at setup that names it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("prefect_api")


class Receiver:
    """A webhook endpoint on loopback that keeps every JSON body posted to it."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        self.received: list[dict[str, Any]] = []

    def wait_for(self, count: int, seconds: float = 120.0) -> list[dict[str, Any]]:
        """The notifications once ``count`` have come (fails after ``seconds``)."""
        deadline = time.monotonic() + seconds
        while len(self.received) < count:
            assert time.monotonic() < deadline, (
                f"{len(self.received)} notifications: {self.received}"
            )
            time.sleep(0.5)
        return list(self.received)


@contextlib.contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append(json.loads(body or b"{}"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    receiver = Receiver(server)
    receiver.received = received
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


def config_file(tmp_path: Path, block: str | None, **data: str) -> Path:
    tree = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    tree["alerts"] = {"notify_block": block}
    tree["tracking"] = {"mlflow_uri": None}
    tree["data"].update(data)
    path = tmp_path / f"alerts-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _automations(block: str) -> list[Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [a for a in client.read_automations() if a.name.endswith(f"-> {block}")]


def _delete_automations(block: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for automation in _automations(block):
            client.delete_automation(automation.id)


def test_a_notification_block_that_does_not_exist_is_named_at_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect.blocks.system import Secret

    from deployments.setup import main

    missing = f"custom-webhook/missing-{uuid.uuid4().hex[:8]}"
    assert main(["--config", str(config_file(tmp_path, missing))]) == 2
    name = missing.split("/")[1]
    assert (
        f"error: alerts.notify_block {missing}: there is no custom-webhook block named {name}"
        in capsys.readouterr().err
    )
    assert _automations(missing) == []

    secret = f"not-a-notifier-{uuid.uuid4().hex[:8]}"
    Secret(value="s3cr3t-value").save(secret)
    assert main(["--config", str(config_file(tmp_path, f"secret/{secret}"))]) == 2
    err = capsys.readouterr().err
    assert f"alerts.notify_block secret/{secret}: a secret block cannot send notifications" in err
    assert "s3cr3t-value" not in err


def test_a_failed_run_a_crash_and_a_promotion_each_send_one_notification(
    tmp_path: Path,
    azurite: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from core.run_events import model_promoted
    from deployments.alerts import WEBHOOK_URL_ENV
    from deployments.setup import main
    from flows.retrain import retrain
    from tests.pipeline_helpers import make_config

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    block = f"custom-webhook/alerts-{uuid.uuid4().hex[:8]}"
    with webhook_receiver() as hook:
        try:
            # The block from the URL, then the automations; run again, they are updated.
            monkeypatch.setenv(WEBHOOK_URL_ENV, hook.url)
            path = config_file(tmp_path, block)
            assert main(["--config", str(path)]) == 0
            out = capsys.readouterr().out
            assert f"notification block {block} saved from {WEBHOOK_URL_ENV}" in out
            assert out.count("created") >= 3 and hook.url not in out
            # The URL is kept in the block's secrets: a read without them (the API's default,
            # the UI's) shows a placeholder for it, and nothing of the URL.
            kind, name = block.split("/")
            with get_client(sync_client=True) as client:
                stored = client.read_block_document_by_name(name, kind, include_secrets=False)
            assert stored.data["url"] == "{{webhook_url}}"
            assert hook.url not in json.dumps(stored.data, default=str)
            monkeypatch.delenv(WEBHOOK_URL_ENV)
            assert main(["--config", str(path)]) == 0
            assert capsys.readouterr().out.count("updated") == 3
            assert len(_automations(block)) == 3

            # A run that fails in its data gate: no data below its root.
            config = make_config(tmp_path, "data.prefix=nothing-here")
            failed = retrain(config=config, return_state=True)
            assert failed.is_failed()
            with get_client(sync_client=True) as client:
                failed_run = client.read_flow_run(failed.state_details.flow_run_id)
            (notice,) = hook.wait_for(1)
            assert notice["subject"] == f"retrain run {failed_run.name} failed in validate-data"
            assert notice["body"].startswith("The retrain run 20")
            assert (
                f"-{str(failed_run.id)[:8]} (flow run {failed_run.name}) failed in step "
                "validate-data: ResourceNotFoundError: The specified container does not exist."
            ) in notice["body"]

            # A run whose process died: Prefect's own Crashed event.
            with get_client(sync_client=True) as client:
                crashed = client.create_flow_run(retrain, parameters={})
                client.set_flow_run_state(crashed.id, Crashed(message="killed"), force=True)
            notice = hook.wait_for(2)[1]
            assert notice["subject"] == f"retrain run {crashed.name} crashed"
            assert "killed" in notice["body"]

            # A promotion, as the flow emits it.
            @flow(name=f"promoting-{uuid.uuid4().hex[:6]}")
            def promoting() -> str:
                model_promoted("20261128-000000-abcdef12", "data/digits", "no champion yet", "f1")
                return "done"

            assert promoting() == "done"
            notice = hook.wait_for(3)[2]
            assert notice["subject"] == "retrain: a new champion for data/digits"
            assert "retrain run 20261128-000000-abcdef12" in notice["body"]
            time.sleep(5)  # no second notification of any of them
            assert len(hook.received) == 3, hook.received
        finally:
            _delete_automations(block)
