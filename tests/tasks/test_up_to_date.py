"""The up-to-date decision and the last-run record it reads (tasks/up_to_date.py,
registry/last_run.py); the flow's up-to-date path is in tests/flows/test_retrain_local.py and
test_retrain_azure.py."""

from __future__ import annotations

import json

import pytest

from registry.last_run import LastRun, parse_last_run
from staging.listing import PinnedBlob, listing_version
from tasks.up_to_date import decide

CURRENT = {
    "data_version": "d1",
    "code_version": "c1",
    "image": "i1",
    "training": {"epochs": 4, "lr": 0.05},
    "processes": 2,
}


def last(**changes: object) -> LastRun:
    return LastRun(
        run_id="run-a",
        fingerprint={**CURRENT, **changes},
        model="runs/run-a/model.pt",
        outputs="runs/run-a",
        accuracy=0.93,
        finished_at="2026-11-23T02:10:00+00:00",
    )


def test_same_fingerprint_with_its_model_is_up_to_date() -> None:
    fresh, why = decide(CURRENT, last(), None, True, False)
    assert fresh and "run-a" in why and "force" in why


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"data_version": "d0"}, "data version d0 -> d1"),
        ({"code_version": "c0"}, "code version c0 -> c1"),
        ({"training": {"epochs": 3, "lr": 0.05}}, "training.epochs 3 -> 4"),
        ({"processes": 4}, "number of training processes 4 -> 2"),
    ],
)
def test_any_change_trains_and_is_named(change: dict[str, object], named: str) -> None:
    fresh, why = decide(CURRENT, last(**change), None, True, False)
    assert not fresh and named in why


def test_force_a_missing_model_and_no_record_train() -> None:
    assert decide(CURRENT, last(), None, True, True) == (
        False,
        "force is set: training again whatever the last run was",
    )
    fresh, why = decide(CURRENT, last(), None, False, False)
    assert not fresh and "runs/run-a/model.pt" in why and "no longer exists" in why
    fresh, why = decide(CURRENT, None, None, False, False)
    assert not fresh and "no earlier trained run" in why


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"not json", "not JSON"),
        (b"[]", "a JSON list, not an object"),
        (b"{}", "field run_id is missing"),
        (json.dumps({**vars(last()), "accuracy": True}).encode(), "field accuracy"),
    ],
)
def test_a_damaged_record_is_named_not_trusted(data: bytes, why: str) -> None:
    parsed = parse_last_run(data)
    assert isinstance(parsed, str) and why in parsed
    fresh, reason = decide(CURRENT, None, f"unusable ({parsed})", False, False)
    assert not fresh and why in reason


def test_gate_data_version_follows_every_write() -> None:
    """A blob's MD5 is what its writer sent (Put Block List stores it unchecked): the data
    version follows the ETag, which every write changes, as well as the MD5."""
    a = PinnedBlob("d/train/0/a.png", "etag-1", 10, "md5-a")
    same = PinnedBlob("d/train/0/a.png", "etag-1", 10, "md5-a")
    written_again = PinnedBlob("d/train/0/a.png", "etag-2", 10, "md5-a")
    new_content = PinnedBlob("d/train/0/a.png", "etag-1", 10, "md5-b")
    assert listing_version([a]) == listing_version([same])
    assert listing_version([a]) != listing_version([written_again])
    assert listing_version([a]) != listing_version([new_content])
    no_md5 = PinnedBlob("d/train/0/a.png", "etag-4", 10, None)
    rewritten = PinnedBlob("d/train/0/a.png", "etag-5", 10, None)
    assert listing_version([no_md5]) != listing_version([rewritten])


V1 = {"container": "c", "root": "images", "version": "v1", "chosen": "named by the run"}
V2 = {"container": "c", "root": "images", "version": "v2", "chosen": "the newest of 2"}


def test_a_version_trained_before_the_last_run_is_up_to_date_with_its_run() -> None:
    """The sensor reporting v1 after v2 was trained, or a run naming v1: the last run trained
    other data, but an earlier one trained exactly this, and its model is the one to use."""
    earlier = LastRun(
        "run-v1", CURRENT, "runs/run-v1/model.pt", "runs/run-v1", 0.9, "2026-11-24", V1
    )
    latest = last(data_version="d2")
    fresh, why = decide(CURRENT, latest, None, True, False, earlier, V1)
    assert fresh and "run run-v1" in why and "data version v1 (listing d1)" in why
    assert decide(CURRENT, latest, None, True, True, earlier, V1)[0] is False  # force


def test_a_changed_data_version_is_named() -> None:
    before = LastRun(
        "run-a",
        {**CURRENT, "data_version": "d0"},
        "runs/run-a/model.pt",
        "runs/run-a",
        0.9,
        "2026-11-24",
        V1,
    )
    fresh, why = decide(CURRENT, before, None, True, False, None, V2)
    assert not fresh
    assert "data version v1 (listing d0) -> v2 (listing d1)" in why
    # A record from before data versions names the listing only.
    fresh, why = decide(CURRENT, last(data_version="d0"), None, True, False, None, V2)
    assert "data version d0 -> v2 (listing d1)" in why


def test_each_trained_fingerprint_keeps_its_run(azurite: str) -> None:
    """models/trained/<digest>.json: found by the fingerprint, whatever ran after it."""
    import uuid

    from azure.storage.blob import ContainerClient

    from core.data_versions import DataRoot
    from registry.last_run import read_last_run, read_trained, write_last_run

    outputs = ContainerClient.from_connection_string(azurite, f"trained-{uuid.uuid4().hex[:8]}")
    outputs.create_container()
    first = LastRun("run-v1", CURRENT, "p/runs/run-v1/model.pt", "p/runs/run-v1", 0.9, "t", V1)
    second_fp = {**CURRENT, "data_version": "d2"}
    second = LastRun("run-v2", second_fp, "p/runs/run-v2/model.pt", "p/runs/run-v2", 0.8, "t", V2)
    root, faces = DataRoot("c", "images"), DataRoot("c", "faces")
    write_last_run(outputs, "p", root, first)
    write_last_run(outputs, "p", root, second)
    assert read_last_run(outputs, "p", root) == (second, None)
    assert read_trained(outputs, "p", root, CURRENT) == first
    assert read_trained(outputs, "p", root, {**CURRENT, "processes": 4}) is None
    assert read_trained(outputs, "other", root, CURRENT) is None
    # Another data root's runs are not this one's: its last run and fingerprints are its own.
    assert read_last_run(outputs, "p", faces) == (None, None)
    assert read_trained(outputs, "p", faces, CURRENT) is None
