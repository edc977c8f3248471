"""The trainer's Scheduled Events watcher (training/preemption.py) against the emulated endpoint
(tests/fakes/scheduled_events.py, Microsoft's documented format): a Preempt notice handed over
once, other events ignored; an endpoint that is down, slow or answers nonsense never stops the
thread nor the caller, and says so once."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.fakes.scheduled_events import ScheduledEvents
from training.preemption import (
    EventsDocumentError,
    PreemptionWatcher,
    preempt_notices,
    read_events,
)

pytestmark = pytest.mark.processes  # the endpoint is a server (in a thread)


@pytest.fixture
def events() -> Iterator[ScheduledEvents]:
    with ScheduledEvents() as endpoint:
        yield endpoint


def test_the_endpoint_answers_as_documented(events: ScheduledEvents) -> None:
    events.schedule("Reboot", ["vm-0"])
    document = read_events(events.url(), timeout=10)
    assert set(document) == {"DocumentIncarnation", "Events"}
    (event,) = document["Events"]
    assert event["EventType"] == "Reboot" and event["EventStatus"] == "Scheduled"
    assert event["ResourceType"] == "VirtualMachine" and event["Resources"] == ["vm-0"]
    assert event["NotBefore"].endswith(" GMT") and event["EventSource"] == "Platform"
    with pytest.raises(urllib.error.HTTPError) as refused:  # no Metadata header
        urllib.request.urlopen(events.url(), timeout=10)
    assert refused.value.code == 400


def test_a_preempt_notice_is_handed_over_once(events: ScheduledEvents) -> None:
    watcher = PreemptionWatcher(events.url(), timeout=10)
    events.schedule("Freeze", ["vm-0"])  # not a preemption
    watcher.poll_once()
    assert watcher.take() is None
    event_id = events.preempt(["vm-1"], notice_seconds=30)
    watcher.poll_once()
    notice = watcher.take()
    assert notice is not None and notice.event_id == event_id
    assert notice.resources == ("vm-1",) and notice.status == "Scheduled"
    events.start(event_id)  # the same event, started: not a new notice
    watcher.poll_once()
    assert watcher.take() is None
    assert "Preempt event" in notice.describe() and "vm-1" in notice.describe()


def test_the_thread_polls_until_stopped(events: ScheduledEvents) -> None:
    watcher = PreemptionWatcher(events.url(), poll_seconds=0.05, timeout=10).start()
    try:
        event_id = events.preempt(["vm-0"], notice_seconds=30)
        deadline = time.monotonic() + 20
        while (notice := watcher.take()) is None:
            assert time.monotonic() < deadline, "no notice within 20 s"
            time.sleep(0.02)
        assert notice.event_id == event_id
    finally:
        watcher.stop()


@pytest.mark.parametrize("fault", ["down", "slow", "nonsense"])
def test_an_endpoint_down_slow_or_wrong_stops_nothing_and_says_so_once(
    fault: str, events: ScheduledEvents, caplog: pytest.LogCaptureFixture
) -> None:
    url = events.url()
    if fault == "down":
        events.failing = 503
    elif fault == "slow":
        events.delay = 2.0
    else:
        url = events.url("2015-01-01")  # refused: an answer that is no events document
    watcher = PreemptionWatcher(url, poll_seconds=0.01, timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="training"):
        started = time.monotonic()
        watcher.start()
        assert watcher.take() is None  # the caller never waits for the endpoint
        assert time.monotonic() - started < 0.3
        deadline = time.monotonic() + 20
        while events.requests < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    watcher.stop()
    assert watcher.failing is not None
    said = [r.getMessage() for r in caplog.records if "scheduled events at" in r.getMessage()]
    assert len(said) == 1 and "training goes on" in said[0]
    events.failing, events.delay = None, 0.0
    if fault != "nonsense":
        watcher.poll_once()
        assert watcher.failing is None and watcher.polls == 1


def test_a_document_of_another_shape_is_refused_by_field() -> None:
    with pytest.raises(EventsDocumentError, match="DocumentIncarnation"):
        preempt_notices({"Events": []}, 0.0)
    with pytest.raises(EventsDocumentError, match=r"Events\[0\] lacks NotBefore"):
        preempt_notices(
            {
                "DocumentIncarnation": 2,
                "Events": [
                    {
                        "EventId": "x",
                        "EventType": "Preempt",
                        "ResourceType": "VirtualMachine",
                        "Resources": [],
                        "EventStatus": "Scheduled",
                    }
                ],
            },
            0.0,
        )
