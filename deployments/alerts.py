"""Alerts: Prefect automations that send a notification through a Prefect notification block
(a webhook, Slack, Microsoft Teams, e-mail: whichever block ``alerts.notify_block`` names) when
a retrain run fails (naming its step), crashes, or promotes a new champion.

``python -m deployments.setup`` creates them, one automation per event and block, and updates
them in place when run again. The events: ``retrain.run.failed`` and ``retrain.model.promoted``,
which the flow emits (core/run_events.py), and Prefect's own ``prefect.flow-run.Crashed`` of
the retrain flow (a crashed run's process is gone and emits nothing). The block must exist on
the server: a name that finds none, or a block that cannot notify, is an error that names it,
never an automation that would send nothing. ``RETRAIN_ALERTS_WEBHOOK_URL`` makes (or updates)
the block from a URL for the webhook types, so a fresh server can alert from its first run
without anyone opening the UI (when no config names a block, it makes ``custom-webhook/
retrain-alerts``: ``RETRAIN_ALERTS_WEBHOOK_URL=<url> make service`` is the whole set-up). The
URL is a secret (Slack's and Teams' carry their token): it is never printed, and it is kept in
the block's secret fields (a custom webhook's URL in its ``secrets``, which its ``url``
refers to), which the API and the UI obfuscate.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from core.config import AlertEvent, PipelineConfig
from core.run_events import FLOW_NAME, MODEL_PROMOTED, RESOURCE_PREFIX, RUN_FAILED

WEBHOOK_URL_ENV = "RETRAIN_ALERTS_WEBHOOK_URL"
DEFAULT_BLOCK = "custom-webhook/retrain-alerts"  # made from the URL when no config names one
URL_SECRET = "webhook_url"  # the custom webhook's secret that holds its URL
# The block types a URL alone makes, and how.
WEBHOOK_TYPES = ("custom-webhook", "slack-webhook", "ms-teams-webhook")
# The flow run's page, where the server knows its UI's address (an API-only server does not).
LINK = "{% if flow_run|ui_url %}\n{{ flow_run|ui_url }}{% endif %}"


class AlertsError(RuntimeError):
    """The alerts cannot be set up as the config asks; the message names the block."""


@dataclass(frozen=True)
class Alert:
    """One automation: what it listens for and what it says."""

    kind: AlertEvent
    title: str
    expect: str
    match: dict[str, str]
    match_related: dict[str, str]
    subject: str
    body: str


ALERTS: dict[AlertEvent, Alert] = {
    "failed": Alert(
        "failed",
        "a retrain run failed",
        RUN_FAILED,
        {"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        {},
        "retrain run {{ flow_run.name }} failed in {{ event.payload.step }}",
        "The retrain run {{ event.payload.run_id }} (flow run {{ flow_run.name }}) failed in "
        "step {{ event.payload.step }}: {{ event.payload.reason }}" + LINK,
    ),
    "crashed": Alert(
        "crashed",
        "a retrain run crashed",
        "prefect.flow-run.Crashed",
        {"prefect.resource.id": "prefect.flow-run.*"},
        {"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
        "retrain run {{ flow_run.name }} crashed",
        "The retrain flow run {{ flow_run.name }} crashed (its process ended without "
        "reporting a step): {{ flow_run.state.message }}" + LINK,
    ),
    "promoted": Alert(
        "promoted",
        "a retrain run promoted a new champion",
        MODEL_PROMOTED,
        {"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        {},
        "retrain: a new champion for {{ event.payload.data_root }}",
        "The model of retrain run {{ event.payload.run_id }} (flow run {{ flow_run.name }}) "
        "is the new champion of {{ event.payload.data_root }}: {{ event.payload.reason }}" + LINK,
    ),
}


def automation_name(kind: AlertEvent, block: str) -> str:
    return f"retrain alert: {ALERTS[kind].title} -> {block}"


def _automation(kind: AlertEvent, block: str, block_id: UUID) -> Any:
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    alert = ALERTS[kind]
    return AutomationCore(
        name=automation_name(kind, block),
        description=f"made by python -m deployments.setup: {alert.title}, told to {block}",
        enabled=True,
        trigger=EventTrigger(
            match=alert.match,
            match_related=alert.match_related,
            expect={alert.expect},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[
            SendNotification(block_document_id=block_id, subject=alert.subject, body=alert.body)
        ],
    )


def _save_webhook_block(block: str, url: str) -> None:
    """The block ``block`` made from ``url`` (saved over one of the same name)."""
    from prefect.blocks.notifications import (
        CustomWebhookNotificationBlock,
        MicrosoftTeamsWebhook,
        SlackWebhook,
    )

    kind, name = block.split("/", 1)
    made: Any
    if kind == "custom-webhook":
        made = CustomWebhookNotificationBlock(
            name=name,
            url="{{" + URL_SECRET + "}}",  # filled in from the secret as the request is made
            json_data={"subject": "{{subject}}", "body": "{{body}}", "name": "{{name}}"},
            secrets={URL_SECRET: url},
        )
    elif kind == "slack-webhook":
        made = SlackWebhook(url=url)
    elif kind == "ms-teams-webhook":
        made = MicrosoftTeamsWebhook(url=url)
    else:
        raise AlertsError(
            f"alerts.notify_block {block}: {WEBHOOK_URL_ENV} makes blocks of the types "
            f"{', '.join(WEBHOOK_TYPES)}; create the {kind} block {name} yourself (the Prefect "
            "UI's Blocks page, or its Python class's .save())"
        )
    made.save(name, overwrite=True)


def _notification_block(client: Any, block: str) -> UUID:
    """The id of the notification block ``block`` (``<type>/<name>``) on the server."""
    from prefect.exceptions import ObjectNotFound

    kind, name = block.split("/", 1)
    try:
        document = client.read_block_document_by_name(name, kind)
    except ObjectNotFound:
        raise AlertsError(
            f"alerts.notify_block {block}: there is no {kind} block named {name} on the "
            "Prefect server: create it (the UI's Blocks page, or "
            f"{WEBHOOK_URL_ENV} for a webhook) before running deployments.setup"
        ) from None
    capabilities = document.block_schema.capabilities if document.block_schema else []
    if "notify" not in capabilities:
        raise AlertsError(
            f"alerts.notify_block {block}: a {kind} block cannot send notifications (it is "
            "no notification block: use e.g. custom-webhook, slack-webhook, ms-teams-webhook)"
        )
    return UUID(str(document.id))


def _wanted(configs: Iterable[PipelineConfig], url: str) -> dict[str, set[AlertEvent]]:
    """The blocks to tell, and what: the configs' own, else DEFAULT_BLOCK when ``url`` is
    given."""
    configs = list(configs)
    wanted: dict[str, set[AlertEvent]] = {}
    for config in configs:
        if config.alerts.notify_block:
            wanted.setdefault(config.alerts.notify_block, set()).update(config.alerts.on)
    if not wanted and url:
        for config in configs:
            wanted.setdefault(DEFAULT_BLOCK, set()).update(config.alerts.on)
    return wanted


def alerts_status(config: PipelineConfig, config_path: str) -> str:
    """Whether alerts are on for ``config``, and how to turn them on when they are not, in the
    words of a status line."""
    url = os.environ.get(WEBHOOK_URL_ENV, "").strip()
    wanted = _wanted([config], url)
    if not wanted:
        return (
            f"alerts off (alerts.notify_block is unset in {config_path}): "
            f"{WEBHOOK_URL_ENV}=<webhook URL> make service turns them on (docs/alerts.md)"
        )
    ((block, kinds),) = wanted.items()
    source = (
        f" (made from {WEBHOOK_URL_ENV})" if url and block.split("/")[0] in WEBHOOK_TYPES else ""
    )
    return f"alerts on: {', '.join(sorted(kinds))} runs told to {block}{source}"


def ensure_alerts(configs: Iterable[PipelineConfig]) -> list[str]:
    """The automations the configs' ``alerts`` ask for, created or updated; what was done."""
    from prefect.client.orchestration import get_client

    url = os.environ.get(WEBHOOK_URL_ENV, "").strip()
    wanted = _wanted(configs, url)
    if not wanted:
        return []
    done = []
    with get_client(sync_client=True) as client:
        for block, kinds in sorted(wanted.items()):
            if url:
                _save_webhook_block(block, url)
                done.append(f"notification block {block} saved from {WEBHOOK_URL_ENV}")
            block_id = _notification_block(client, block)
            for kind in sorted(kinds):
                automation = _automation(kind, block, block_id)
                existing = client.read_automations_by_name(automation.name)
                if existing:
                    client.update_automation(existing[0].id, automation)
                    done.append(f"automation '{automation.name}' updated")
                else:
                    client.create_automation(automation)
                    done.append(f"automation '{automation.name}' created")
    return done
