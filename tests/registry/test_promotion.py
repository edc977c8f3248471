"""The champion comparison (registry/promotion.py), against Azurite, through the records the
promotion itself writes: the data versions both numbers come from, the metric, every class's
recall, and a change of classes. The scores are the scorer's reports (confusion matrices); the
flow's own path is in tests/flows/test_champions.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from core.config import PromotionConfig
from core.data_versions import DataRoot
from registry.champion import Champion, champion_for
from registry.metrics import scores_of
from registry.promotion import Challenger, below_minimum, challenge

ROOT = DataRoot("c", "images")


def report(classes: list[str], matrix: list[list[int]]) -> dict[str, Any]:
    """A scorer's report (training.score) with this confusion matrix."""
    images = sum(map(sum, matrix))
    return {
        "accuracy": sum(matrix[i][i] for i in range(len(classes))) / images,
        "num_images": images,
        "class_names": classes,
        "confusion_matrix": matrix,
        "skipped_images": [],
    }


# Three classes, ten test images each.
GOOD = report(["a", "b", "c"], [[9, 1, 0], [1, 9, 0], [0, 1, 9]])  # accuracy 0.9
# Perfect on a and b, class c at recall 0.6 (accuracy 0.8667).
C_DROPS = report(["a", "b", "c"], [[10, 0, 0], [0, 10, 0], [0, 4, 6]])
BETTER = report(["a", "b", "c"], [[10, 0, 0], [0, 10, 0], [0, 1, 9]])


@pytest.fixture
def outputs(azurite: str) -> ContainerClient:
    container = ContainerClient.from_connection_string(azurite, f"promo-{uuid.uuid4().hex[:8]}")
    container.create_container()
    return container


def _run(
    outputs: ContainerClient,
    run_id: str,
    score: dict[str, Any],
    staged: str = "staged-a",
    data: str = "c/images/v1",
    root: DataRoot = ROOT,
    rescored: dict[str, Any] | None = None,
    **rules: Any,
) -> dict[str, Any]:
    def rescore(champion: Champion) -> dict[str, Any]:
        assert rescored is not None, "the champion was scored again on the same test split"
        return rescored

    challenger = Challenger(run_id, f"runs/{run_id}/model.pt", staged, score, root, data)
    blob = f"runs/{run_id}/promotion.json"
    challenge(outputs, "", challenger, PromotionConfig(**rules), rescore, blob)
    return json.loads(outputs.download_blob(blob).readall())


def test_the_metrics_come_from_the_confusion_matrix() -> None:
    scores = scores_of(C_DROPS)
    assert not isinstance(scores, str)
    assert scores.accuracy == pytest.approx(26 / 30)
    assert scores.balanced_accuracy == pytest.approx((1 + 1 + 0.6) / 3)
    assert scores.recall == {"a": 1.0, "b": 1.0, "c": 0.6}
    # F1 of b: precision 10/14, recall 1.
    f1_b = 2 * (10 / 14) / (10 / 14 + 1)
    assert scores.macro_f1 == pytest.approx((1 + f1_b + 2 * 0.6 / 1.6) / 3)
    on_ab = scores_of(C_DROPS, {"a", "b"})
    assert not isinstance(on_ab, str) and on_ab.accuracy == 1.0 and on_ab.classes == ("a", "b")
    assert "not 3 x 3" in str(
        scores_of({"class_names": ["a", "b", "c"], "confusion_matrix": [[1]]})
    )


# Class c never recognised: accuracy 0.6667, recall 1, 1, 0.
C_NEVER = report(["a", "b", "c"], [[10, 0, 0], [0, 10, 0], [5, 5, 0]])


def test_the_minimum_names_the_metric_or_every_class_below_it() -> None:
    scores = scores_of(C_NEVER)
    assert not isinstance(scores, str)
    rules = PromotionConfig()
    assert below_minimum(scores, rules) == (
        "class 'c' has recall 0.0000, less than the 0.1 promotion.minimum.class_recall asks for"
    )
    assert below_minimum(scores, PromotionConfig(minimum={"class_recall": None})) == ""
    assert below_minimum(scores, PromotionConfig(minimum={"metric": 0.7})) == (
        "accuracy 0.6667 is less than the 0.7 promotion.minimum.metric asks for"
    )
    two = scores_of(report(["a", "b", "c"], [[10, 0, 0], [9, 1, 0], [10, 0, 0]]))
    assert not isinstance(two, str)
    assert below_minimum(two, PromotionConfig(minimum={"class_recall": 0.5})) == (
        "classes 'c' (0.0000), 'b' (0.1000) have recall less than the 0.5 "
        "promotion.minimum.class_recall asks for"
    )
    assert below_minimum(scores_of(GOOD), rules) == ""  # type: ignore[arg-type]


def test_the_decision_and_the_champion_name_the_data_versions(outputs: ContainerClient) -> None:
    first = _run(outputs, "r1", GOOD)
    assert first["promoted"] and first["challenger"]["data"] == "c/images/v1"
    assert first["reason"] == "no champion of c/images yet: accuracy 0.9000 becomes the first"
    champion = champion_for(outputs, "", ROOT).champion
    assert champion is not None and (champion.run_id, champion.data) == ("r1", "c/images/v1")
    assert champion.recall == {"a": 0.9, "b": 0.9, "c": 0.9} and champion.root == ROOT

    same = _run(outputs, "r2", report(["a", "b", "c"], [[8, 2, 0], [1, 9, 0], [0, 1, 9]]))
    assert not same["promoted"]  # its own recorded scores: no rescoring on the same data
    assert same["reason"].endswith("(both trained and scored on c/images/v1)")

    newer = _run(outputs, "r3", BETTER, "staged-b", "c/images/v2", rescored=GOOD)
    assert newer["reason"].endswith(
        "(both scored on the test split of c/images/v2; the champion was trained on c/images/v1)"
    )
    assert newer["champion_on_this_test_split"]["accuracy"] == pytest.approx(0.9)
    champion = champion_for(outputs, "", ROOT).champion
    assert champion is not None and (champion.run_id, champion.data) == ("r3", "c/images/v2")


def test_another_data_root_has_a_champion_of_its_own(outputs: ContainerClient) -> None:
    """The faces run that replaced the texture champion: a run over another data root, under
    the same output prefix, becomes that root's first champion and leaves the other one's."""
    _run(outputs, "textures", GOOD)
    faces = DataRoot("c", "faces")
    other = report(["face", "other"], [[5, 5], [5, 5]])
    decision = _run(outputs, "faces", other, "staged-f", "c/faces/v1", faces)
    assert decision["promoted"] and decision["champion_before"] is None
    assert decision["reason"].startswith("no champion of c/faces yet")
    kept = champion_for(outputs, "", ROOT).champion
    assert kept is not None and kept.run_id == "textures"
    faces_champion = champion_for(outputs, "", faces).champion
    assert faces_champion is not None and faces_champion.classes == ("face", "other")


def test_a_class_that_drops_more_than_allowed_refuses_the_promotion_by_name(
    outputs: ContainerClient,
) -> None:
    """A champion at 0.6 on a and b and 0.9 on c; a challenger perfect on a and b that loses
    three images of c: better overall by 0.1667, and refused by class c."""
    weak = report(["a", "b", "c"], [[6, 4, 0], [4, 6, 0], [0, 1, 9]])  # c 0.9, others 0.6
    _run(outputs, "r0", weak, root=DataRoot("c", "weak"), data="c/weak/v1")
    dropped = _run(outputs, "r3", C_DROPS, root=DataRoot("c", "weak"), data="c/weak/v1")
    assert not dropped["promoted"]
    assert (
        "accuracy 0.8667 against the champion's 0.7000: better by 0.1667, but class 'c' has "
        "recall 0.6000 against the champion's 0.9000: a drop of 0.3000, more than "
        "promotion.max_class_drop 0.1: not promoted"
    ) in dropped["reason"]
    assert dropped["per_class"]["c"] == {"challenger": 0.6, "champion": 0.9, "drop": 0.3}
    assert dropped["per_class"]["a"] == {"challenger": 1.0, "champion": 0.6, "drop": -0.4}
    allowed = _run(
        outputs,
        "r4",
        C_DROPS,
        root=DataRoot("c", "weak"),
        data="c/weak/v1",
        max_class_drop=0.3,
    )
    assert allowed["promoted"], allowed["reason"]


@pytest.mark.parametrize(
    ("metric", "promoted"),
    [("accuracy", False), ("balanced_accuracy", True), ("macro_f1", True)],
)
def test_the_metric_decides(outputs: ContainerClient, metric: str, promoted: bool) -> None:
    """Class b is rare: the champion gets every image of a and c right and none of b; the
    challenger trades two of a for both of b. Accuracy calls that the same; balanced accuracy
    and macro F1 call it better."""
    champion = report(["a", "b", "c"], [[20, 0, 0], [2, 0, 0], [0, 0, 20]])
    challenger = report(["a", "b", "c"], [[18, 2, 0], [0, 2, 0], [0, 0, 20]])
    # Class b at recall 0: a champion only with the floor off.
    _run(outputs, "r1", champion, metric=metric, minimum={"class_recall": None})
    decision = _run(outputs, "r2", challenger, metric=metric, max_class_drop=None)
    assert decision["promoted"] is promoted, decision["reason"]
    assert decision["reason"].startswith(f"{metric} ")
    assert decision["metric"] == metric and metric in decision["challenger"]


def test_a_class_added_is_compared_on_the_classes_both_know_and_must_reach_the_minimum(
    outputs: ContainerClient,
) -> None:
    _run(outputs, "r1", GOOD)
    # v2 adds class d; the champion, scored again on v2's test split, knows a, b and c.
    on_v2 = report(["a", "b", "c"], [[9, 1, 0], [1, 9, 0], [0, 1, 9]])
    weak_d = report(
        ["a", "b", "c", "d"], [[10, 0, 0, 0], [0, 10, 0, 0], [0, 0, 10, 0], [0, 0, 7, 3]]
    )
    refused = _run(outputs, "r2", weak_d, "staged-b", "c/images/v2", rescored=on_v2)
    assert not refused["promoted"]
    assert refused["reason"].startswith(
        "the classes changed (added: 'd'; removed: none): compared on the 3 classes both know, "
        "each new class to reach recall 0.5 (promotion.new_class_min_recall); accuracy 1.0000 "
        "against the champion's 0.9000: better by 0.1000 on those classes, but new class 'd' "
        "has recall 0.3000, less than the 0.5 promotion.new_class_min_recall asks for"
    )
    assert refused["classes"]["added"] == ["d"] and refused["classes"]["compared"] == [
        "a",
        "b",
        "c",
    ]
    good_d = report(
        ["a", "b", "c", "d"], [[10, 0, 0, 0], [0, 10, 0, 0], [0, 0, 10, 0], [0, 0, 2, 8]]
    )
    promoted = _run(outputs, "r3", good_d, "staged-b", "c/images/v2", rescored=on_v2)
    assert promoted["promoted"], promoted["reason"]
    never = _run(
        outputs, "r4", good_d, "staged-c", "c/images/v3", rescored=GOOD, new_class_min_recall=None
    )
    assert not never["promoted"]
    assert (
        "promotion.new_class_min_recall is null, so a change of classes is not promoted"
        in (never["reason"])
    )


def test_a_class_removed_is_named_and_the_rest_compared(outputs: ContainerClient) -> None:
    _run(outputs, "r1", GOOD)
    # v2 drops class c: the champion is scored on a and b only (the scorer's known classes).
    on_v2 = report(["a", "b", "c"], [[9, 1, 0], [1, 9, 0], [0, 0, 0]])
    ab = report(["a", "b"], [[10, 0], [0, 10]])
    decision = _run(outputs, "r2", ab, "staged-b", "c/images/v2", rescored=on_v2)
    assert decision["promoted"], decision["reason"]
    assert decision["reason"].startswith("the classes changed (added: none; removed: 'c')")
    assert decision["classes"]["removed"] == ["c"]
