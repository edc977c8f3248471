"""The champion record under many promotions and in every damaged shape it was found in:
flat and bounded, history one record per promotion, damage a named decision (never a crash
after training, never taken for "no champion", the damaged bytes kept)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import container_client
from core.data_versions import DataRoot
from registry.champion import (
    Champion,
    ChampionMovedError,
    champion_for,
    parse_record,
    replace_champion,
)
from registry.layout import CHAMPION, champion_blob, dataset_folder
from tests.pipeline_helpers import make_config, new_container
from tests.registry.test_promotion import C_NEVER
from tests.registry.test_promotion import _run as promote_in
from tests.registry.test_promotion import report as score_of
from tests.reliability import report

ROOT = DataRoot("c", "images")


@pytest.fixture
def outputs(azurite: str) -> ContainerClient:
    return new_container(azurite, "champ")


def _champion(i: int, version: str = "v1") -> Champion:
    return Champion(
        f"20261123-{i:06d}-abcdef12",
        "accuracy",
        0.5 + i / 10_000,
        f"runs/{i}/model.pt",
        version,
        f"2026-11-23T00:00:{i % 60:02d}+00:00",
        classes=("a", "b"),
    )


def _score(accuracy: float, images: int, unreadable: int = 0) -> dict[str, Any]:
    """The scorer's report (training.score) on two classes, with this accuracy."""
    right, half = round(accuracy * images), images // 2
    a_right = min(right, half)
    b_right = right - a_right
    return {
        "accuracy": accuracy,
        "num_images": images,
        "class_names": ["a", "b"],
        "confusion_matrix": [[a_right, half - a_right], [images - half - b_right, b_right]],
        "skipped_images": [f"test/a/{i}.png: unreadable image" for i in range(unreadable)],
    }


def test_champion_stays_flat_over_many_promotions(outputs: ContainerClient) -> None:
    promotions = 60
    for i in range(promotions):
        before = champion_for(outputs, "", ROOT)
        replace_champion(outputs, "", ROOT, _champion(i), before)
    stored = outputs.download_blob(champion_blob("", ROOT)).readall()
    assert len(stored) < 1024 and "previous" not in json.loads(stored)
    assert champion_for(outputs, "", ROOT).champion == _champion(promotions - 1)
    history_folder = f"{dataset_folder('', ROOT)}/history/"
    history = sorted(b.name for b in outputs.list_blobs(name_starts_with=history_folder))
    assert len(history) == promotions and history[-1].endswith(
        f"{promotions - 1:06d}-abcdef12.json"
    )
    report.record(
        "adversarial",
        f"promotion: {promotions} promotions in a row",
        f"champion.json {len(stored)} bytes (flat); {promotions} history records",
        before_fix="every record nested in the next: 5 MB at 900, RecursionError at ~995",
    )


def test_a_stale_read_cannot_replace_the_champion(outputs: ContainerClient) -> None:
    before = champion_for(outputs, "", ROOT)
    replace_champion(outputs, "", ROOT, _champion(1), before)
    with pytest.raises(ChampionMovedError):
        replace_champion(outputs, "", ROOT, _champion(2), before)  # read before run 1 won
    assert champion_for(outputs, "", ROOT).champion == _champion(1)


def _nested(depth: int) -> bytes:
    """A record as the earlier code wrote them: every champion inside the next (built as text:
    encoding it from objects would hit the same recursion limit that reading it does)."""
    text = "null"
    for i in range(depth):
        text = (
            f'{{"run_id": "r{i}", "accuracy": 0.5, "model": "runs/r{i}/model.pt", '
            f'"previous": {text}}}'
        )
    return text.encode()


def test_records_of_the_earlier_nested_format() -> None:
    legacy = parse_record(_nested(3))
    assert isinstance(legacy, Champion) and legacy.run_id == "r2" and legacy.data_version is None
    assert parse_record(_nested(1200)) == "nested too deep to read"


DAMAGED = {
    "not JSON": (b"{not json", "not JSON"),
    "empty object {}": (b"{}", "lacks run_id, accuracy, model"),
    "a JSON list": (b"[1, 2]", "a JSON list, not an object"),
    "accuracy NaN": (
        b'{"run_id": "r", "accuracy": NaN, "model": "runs/r/model.pt"}',
        "accuracy is nan, not a finite number",
    ),
    "accuracy Infinity": (
        b'{"run_id": "r", "accuracy": Infinity, "model": "runs/r/model.pt"}',
        "accuracy is inf, not a finite number",
    ),
    "accuracy a string": (
        b'{"run_id": "r", "accuracy": "0.9", "model": "runs/r/model.pt"}',
        "accuracy is '0.9', not a number",
    ),
    "run_id a number": (
        b'{"run_id": 5, "accuracy": 0.9, "model": "runs/r/model.pt"}',
        "run_id is 5",
    ),
    "nested 1200 deep": (_nested(1200), "nested too deep"),
    # A ranged read of an empty blob answers 416, which crashed the promotion.
    "empty (0 bytes)": (b"", "empty (0 bytes)"),
    # JSON integers have no bound: 1e400 written as one raised OverflowError.
    "accuracy 1e400 written as an integer": (
        b'{"run_id": "r", "accuracy": 1' + b"0" * 400 + b', "model": "runs/r/model.pt"}',
        "accuracy is an integer of about 401 digits, not a finite number in [0, 1]",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_champion_record_is_a_named_decision(
    case: str,
    prefect_api: None,
    azurite: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect import flow

    from backends.local.cluster import LocalCluster
    from core.run import Run
    from tasks.promote import promote

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    raw, why = DAMAGED[case]
    config = make_config(tmp_path)
    outputs = container_client(config.output, create=True)
    outputs.upload_blob(champion_blob("", config.data.root), raw)
    cluster = LocalCluster(
        tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs
    )  # a damaged record needs no re-scoring: the pool is never used

    run = Run("run-new", "runs/run-new", tmp_path / "work" / "runs" / "run-new")

    @flow
    def promote_once() -> dict[str, Any]:
        return promote(config, cluster, run, _score(0.7, 20), "v9").value.record

    decision = promote_once()
    assert decision["promoted"] is True and decision["champion_record"] == "damaged"
    assert why in decision["reason"] and CHAMPION in decision["reason"]
    kept = decision["damaged_record"]["kept_as"]
    assert outputs.download_blob(kept).readall() == raw  # nothing stored is lost
    champion = champion_for(outputs, "", config.data.root).champion
    assert champion is not None and champion.run_id == "run-new"
    assert json.loads(outputs.download_blob("runs/run-new/promotion.json").readall()) == decision
    report.record(
        "adversarial",
        f"promotion: champion.json is {case}",
        "named decision: damaged record kept in history, challenger promoted",
    )


@pytest.mark.parametrize(
    ("scored", "unreadable", "champion", "promoted"),
    [
        (3, 25, True, False),  # the case found: 25 of 28 test images skipped by the scorer
        (3, 25, False, False),  # no champion yet: a score of 3 images does not become one
        (27, 1, True, True),  # one image the scorer could not read: still a measurement
    ],
)
def test_a_test_split_the_scorer_could_not_mostly_read_decides_nothing(
    scored: int,
    unreadable: int,
    champion: bool,
    promoted: bool,
    prefect_api: None,
    azurite: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scorer's report as it writes it (num_images, skipped_images) goes to the promote
    step: a score on less than promotion.min_scored_fraction (0.95) of the test split is no
    measurement, so the champion stays (or none is made), and the decision says why."""
    from prefect import flow

    from backends.local.cluster import LocalCluster
    from core.run import Run
    from tasks.promote import promote

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    assert config.promotion.min_scored_fraction == 0.95
    outputs = container_client(config.output, create=True)
    root = config.data.root
    if champion:
        # Its scores on the test split of v9, the data this run trained: no scoring again.
        recorded = dataclasses.replace(
            _champion(1, "v9"),
            scores={"macro_f1": 0.5, "balanced_accuracy": 0.5},
            recall={"a": 0.5, "b": 0.5},
        )
        replace_champion(outputs, "", root, recorded, champion_for(outputs, "", root))
    cluster = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    run = Run("run-new", "runs/run-new", tmp_path / "work" / "runs" / "run-new")
    score = _score(1.0, scored, unreadable)  # better than any champion, on what it read

    @flow
    def promote_once() -> dict[str, Any]:
        return promote(config, cluster, run, score, "v9").value.record

    decision = promote_once()
    assert decision["promoted"] is promoted, decision["reason"]
    assert decision["challenger"]["unreadable_test_images"] == unreadable
    now = champion_for(outputs, "", root).champion
    if promoted:
        assert now is not None and now.run_id == "run-new"
        return
    split = scored + unreadable
    assert (
        f"the scorer read only {scored} of the {split} test images ({unreadable} could not be "
        "decoded), less than the 0.95 of the split promotion.min_scored_fraction asks for"
    ) in decision["reason"]
    assert (now and now.run_id) == (_champion(1).run_id if champion else None)
    report.record(
        "adversarial",
        f"promotion: the scorer read {scored} of {split} test images"
        + ("" if champion else " (no champion yet)"),
        "not promoted, a named decision: " + decision["reason"].split(": ", 1)[-1],
    )


def test_a_first_model_below_the_minimum_is_not_promoted_by_default(
    outputs: ContainerClient,
) -> None:
    """Before: the first model of a data root was always promoted, a class at recall 0.0 or
    not ("no champion yet: accuracy 0.6667 becomes the first")."""
    refused = promote_in(outputs, "r0", C_NEVER)
    assert not refused["promoted"]
    assert refused["reason"] == (
        "no champion of c/images yet, but class 'c' has recall 0.0000, less than the 0.1 "
        "promotion.minimum.class_recall asks for: not promoted, there is still no champion"
    )
    assert refused["below_minimum"] and refused["rules"]["minimum"]["class_recall"] == 0.1
    assert champion_for(outputs, "", ROOT).state == "absent"
    # Nor over a champion it beats: the floor is any champion's.
    weak = score_of(["a", "b", "c"], [[6, 4, 0], [4, 6, 0], [5, 4, 1]])  # accuracy 0.4333
    promote_in(outputs, "r1", weak, minimum={"class_recall": None})
    over = promote_in(outputs, "r2", C_NEVER)
    assert not over["promoted"] and over["reason"].startswith("class 'c' has recall 0.0000")
    assert over["reason"].endswith(": not promoted, the champion stays")
    champion = champion_for(outputs, "", ROOT).champion
    assert champion is not None and champion.run_id == "r1"
    report.record(
        "adversarial",
        "promotion: a data root's first model, one class at recall 0.0 (default rules)",
        "not promoted, the decision names promotion.minimum.class_recall and the class; no "
        "champion written; nor does it replace a champion it beats",
        before_fix="promoted: the first model always became the champion",
    )
