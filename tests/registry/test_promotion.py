"""The champion comparison names the data versions both numbers come from (registry/promotion.py),
against Azurite, through the records the promotion itself writes."""

from __future__ import annotations

import json
import uuid
from typing import Any

from azure.storage.blob import ContainerClient

from registry.champion import Champion
from registry.promotion import Challenger, challenge


def test_the_decision_and_the_champion_name_the_data_versions(azurite: str) -> None:
    outputs = ContainerClient.from_connection_string(azurite, f"promo-{uuid.uuid4().hex[:8]}")
    outputs.create_container()
    rescored: list[Champion] = []

    def rescore(champion: Champion) -> dict[str, Any]:
        rescored.append(champion)
        return {"accuracy": 0.5, "num_images": 30}

    def run(run_id: str, accuracy: float, staged: str, data: str) -> dict[str, Any]:
        model = f"runs/{run_id}/model.pt"
        challenger = Challenger(run_id, "accuracy", accuracy, model, staged, 30, data=data)
        blob = f"runs/{run_id}/promotion.json"
        challenge(outputs, "", challenger, 0.0, rescore, blob, min_scored_fraction=0.95)
        return json.loads(outputs.download_blob(blob).readall())

    first = run("r1", 0.8, "staged-a", "c/images/v1")
    assert first["promoted"] and first["challenger"]["data"] == "c/images/v1"
    champion = json.loads(outputs.download_blob("models/champion.json").readall())
    assert champion["data"] == "c/images/v1"

    same = run("r2", 0.7, "staged-a", "c/images/v1")  # the same staged data: no rescoring
    assert not same["promoted"] and not rescored
    assert same["reason"].endswith("(both trained and scored on c/images/v1)")

    newer = run("r3", 0.9, "staged-b", "c/images/v2")
    assert [c.run_id for c in rescored] == ["r1"]
    assert newer["reason"].endswith(
        "(both scored on the test split of c/images/v2; the champion was trained on c/images/v1)"
    )
    champion = json.loads(outputs.download_blob("models/champion.json").readall())
    assert (champion["run_id"], champion["data"]) == ("r3", "c/images/v2")
