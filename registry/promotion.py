"""Champion/challenger: promote the new model only when it is better by a margin, and no class
pays for it.

A run's model (the challenger) is compared with the champion of the data root it trained
(``data.container`` + ``data.prefix``; ``registry.champion``), never with another root's.
Both numbers come from the same held-out data. The champion's recorded scores were measured on
the test split of the data it was trained on; when this run's staged data differs (or the record
lacks what is compared), the champion's model is scored again, on this run's test split
(``rescore``, a task on the cluster), and the decision is made on those two (both are kept in
``promotion.json``). A champion whose model cannot be scored (it is gone or damaged) is no
baseline: the challenger replaces it, and the decision says why.

What is compared (``promotion``): the metric (``accuracy``, ``macro_f1`` or
``balanced_accuracy``, computed from each one's confusion matrix, ``registry.metrics``) must
beat the champion's by more than ``min_improvement``; and no class's recall may drop by more
than ``max_class_drop`` against the champion's on the same split: a refusal names the class and
both numbers, and ``promotion.json`` keeps the comparison of every class. A new version of the
data root that adds or removes a class is compared on the classes both know, and each class
the champion does not know must reach ``new_class_min_recall`` (null: a change of classes is
never promoted); the decision names that rule and the classes.

Any champion, the first one of a data root included, must reach ``promotion.minimum``: the
metric's floor and every class's recall floor. A model below it is not promoted whatever it is
compared with, and the decision names the rule and the classes; without it, the first model of
a data root was always promoted, one class at recall 0.0 or not.

A score is a measurement on the test split only if the scorer read most of it: the scorer skips
images it cannot decode, and a promotion was once decided on 3 of 28 test images. When the
scorer read less than ``promotion.min_scored_fraction`` of the split, nothing is decided: the
champion stays, and the decision names the numbers.

The champion record is replaced with an ETag condition, so two runs finishing together cannot
both believe they won; a damaged record is a named decision.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from backends.cluster import Cluster
from core.config import PromotionConfig
from core.data_versions import DataRoot
from registry.champion import (
    Champion,
    ChampionMovedError,
    ChampionRead,
    champion_for,
    replace_champion,
)
from registry.metrics import METRICS, Scores, scores_of
from registry.scoring import SCORER_REFUSED, run_scorer

RESCORE_NAME = "champion-score"  # its report in the run's outputs: champion-score.json
# Scores the champion's model on this run's test split (on the classes it knows): the scorer's
# report, or ``{"error": why}`` when the model cannot be scored on this data.
Rescore = Callable[[Champion], dict[str, Any]]
# A drop is compared at this precision: 0.3 - 0.2 is 0.09999999999999998 in floats.
PRECISION = 9


@dataclass(frozen=True)
class Challenger:
    """This run's model and the scorer's report on it (``training.score``: accuracy, the
    confusion matrix and each class's recall, the images it read and skipped)."""

    run_id: str
    model: str  # blob in the output container
    staged_version: str  # of the staged data it was trained and scored on
    score: Mapping[str, Any]
    root: DataRoot  # the data root it trained: whose champion it challenges
    data: str | None = None  # the data version it was trained on: container/prefix

    @property
    def test_images(self) -> int | None:
        images = self.score.get("num_images")
        return images if isinstance(images, int) else None

    @property
    def unreadable_test_images(self) -> int:
        return len(self.score.get("skipped_images") or [])

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.score.get("class_names") or ())


@dataclass(frozen=True)
class Decision:
    promoted: bool
    reason: str
    note: str  # why there was nothing comparable to beat ("" when there was)
    record: dict[str, Any]  # what promotion.json holds


def decide(
    challenger: float, champion: float | None, margin: float, metric: str = "accuracy"
) -> tuple[bool, str]:
    """Promote when the challenger beats the champion by more than ``margin``; the reason as a
    person would say it (no "by more than 0.0000" when no margin is asked for)."""
    if champion is None:
        return True, f"no champion yet: {metric} {challenger:.4f} becomes the first"
    ahead = challenger - champion
    versus = f"{metric} {challenger:.4f} against the champion's {champion:.4f}"
    if ahead > margin:
        needed = f", more than the {margin:g} required" if margin else ""
        return True, f"{versus}: better by {ahead:.4f}{needed}"
    if ahead > 0:
        return False, f"{versus}: better by only {ahead:.4f}, not more than the {margin:g} required"
    return False, f"{versus}: {'the same' if ahead == 0 else 'worse'}, so it does not beat it"


def rescore_on_cluster(
    cluster: Cluster, run_id: str, output_prefix: str, on_line: Callable[[str], None]
) -> Rescore:
    """``Rescore`` as a scoring task on ``cluster``, its report in this run's outputs."""

    def rescore(champion: Champion) -> dict[str, Any]:
        if not cluster.outputs.get_blob_client(champion.model).exists():
            return {"error": f"the champion's model {champion.model} no longer exists"}
        code, report = run_scorer(
            cluster,
            f"score-champion-{run_id}",
            champion.model,
            output_prefix,
            RESCORE_NAME,
            on_line,
            known_classes_only=True,
        )
        if code == SCORER_REFUSED and report and "error" in report:
            return {"error": str(report["error"])}
        if code != 0 or report is None or "error" in report:
            raise RuntimeError(f"scoring the champion's model {champion.model} exited with {code}")
        return report

    return rescore


def too_little_scored(challenger: Challenger, min_fraction: float) -> str:
    """Why the challenger's score measures too little of the test split, or ""."""
    scored, unreadable = challenger.test_images, challenger.unreadable_test_images
    if scored is None or not unreadable:
        return ""
    split = scored + unreadable
    if scored >= min_fraction * split:
        return ""
    return (
        f"the scorer read only {scored} of the {split} test images ({unreadable} could not be "
        f"decoded), less than the {min_fraction:g} of the split promotion.min_scored_fraction "
        "asks for a decision"
    )


@dataclass(frozen=True)
class Comparison:
    """The challenger and the champion on the same test split, over the classes compared."""

    ours: Scores
    theirs: Scores
    rescored: dict[str, Any] | None  # the champion's report on this split, when scored again
    added: tuple[str, ...] = ()  # classes the champion does not know
    removed: tuple[str, ...] = ()  # classes the challenger does not know
    compared: tuple[str, ...] = ()  # the classes both know (all, when none changed)
    drops: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def classes_changed(self) -> bool:
        return bool(self.added or self.removed)

    def worst_drop(self) -> tuple[str, dict[str, float]] | None:
        if not self.drops:
            return None
        return max(self.drops.items(), key=lambda item: (item[1]["drop"], item[0]))


def _recorded(champion: Champion) -> Scores | None:
    """The champion's scores as its record keeps them (None: a record from before they were
    kept, or without the recall of each class)."""
    if champion.classes is None or champion.recall is None:
        return None
    values = {metric: champion.score(metric) for metric in METRICS}
    if any(v is None for v in values.values()):
        return None
    return Scores(
        classes=tuple(c for c in champion.classes if c in champion.recall),
        accuracy=float(values["accuracy"] or 0.0),
        macro_f1=float(values["macro_f1"] or 0.0),
        balanced_accuracy=float(values["balanced_accuracy"] or 0.0),
        recall=dict(champion.recall),
        images=None,
    )


def _compare(champion: Champion, challenger: Challenger, rescore: Rescore) -> Comparison | str:
    """Both on this run's test split, or why the champion cannot be scored on it."""
    recorded = _recorded(champion)
    same_split = (
        champion.data_version == challenger.staged_version
        and champion.classes == challenger.classes
        and recorded is not None
    )
    rescored = None if same_split else rescore(champion)
    if rescored is not None and "error" in rescored:
        return f"the champion cannot be scored on this data ({rescored['error']})"
    known = tuple(rescored.get("class_names") or ()) if rescored else challenger.classes
    added = tuple(c for c in challenger.classes if c not in known)
    removed = tuple(c for c in known if c not in challenger.classes)
    compared = tuple(c for c in challenger.classes if c in known)
    only = set(compared) if added or removed else None
    ours = scores_of(challenger.score, only)
    theirs = recorded if rescored is None else scores_of(rescored, only)
    if isinstance(theirs, str) and only is None:
        raise RuntimeError(f"the champion's score on this test split cannot be read: {theirs}")
    if isinstance(ours, str) or isinstance(theirs, str) or theirs is None:
        # No class in common with a test image: nothing to compare but the new classes.
        empty = Scores((), 0.0, 0.0, 0.0, {}, None)
        ours = ours if isinstance(ours, Scores) else empty
        theirs = theirs if isinstance(theirs, Scores) else empty
    drops = {
        name: {
            "challenger": round(ours.recall[name], 6),
            "champion": round(theirs.recall[name], 6),
            "drop": round(theirs.recall[name] - ours.recall[name], 6),
        }
        for name in compared
        if name in ours.recall and name in theirs.recall
    }
    return Comparison(ours, theirs, rescored, added, removed, compared, drops)


def _both_scored(champion: Champion | None, challenger: Challenger, rescored: bool) -> str:
    """The clause that says which data both numbers come from, naming the data versions."""
    if challenger.data is None:
        return " (both scored on this run's test split)" if rescored else ""
    if not rescored:
        return f" (both trained and scored on {challenger.data})"
    trained = champion.data if champion is not None and champion.data else "other data"
    return (
        f" (both scored on the test split of {challenger.data}; the champion was trained on "
        f"{trained})"
    )


def _names(classes: tuple[str, ...]) -> str:
    return ", ".join(repr(c) for c in classes) or "none"


def _judge(
    comparison: Comparison, challenger: Challenger, rules: PromotionConfig
) -> tuple[bool, str]:
    """The decision on a comparison, and its reason: the metric first, then the recall of
    every class both know, then the classes the champion does not know."""
    metric = rules.metric
    ours, theirs = comparison.ours, comparison.theirs
    changed = comparison.classes_changed
    rule = ""
    if changed:
        rule = (
            f"the classes changed (added: {_names(comparison.added)}; removed: "
            f"{_names(comparison.removed)}): "
        )
        if rules.new_class_min_recall is None:
            return False, (
                f"{rule}promotion.new_class_min_recall is null, so a change of classes is not "
                "promoted: the champion stays"
            )
        rule += (
            f"compared on the {len(comparison.compared)} classes both know, each new class to "
            f"reach recall {rules.new_class_min_recall:g} (promotion.new_class_min_recall); "
        )
    if changed and not ours.classes:
        promoted, reason = True, "no class in common with the champion, nothing to compare"
    else:
        promoted, reason = decide(
            ours.metric(metric), theirs.metric(metric), rules.min_improvement, metric
        )
        if promoted and changed:
            reason += " on those classes"
    reason = rule + reason
    if not promoted:
        return False, reason
    worst = comparison.worst_drop()
    if (
        rules.max_class_drop is not None
        and worst is not None
        and round(worst[1]["drop"], PRECISION) > rules.max_class_drop
    ):
        name, drop = worst
        return False, (
            f"{reason}, but class {name!r} has recall {drop['challenger']:.4f} against the "
            f"champion's {drop['champion']:.4f}: a drop of {drop['drop']:.4f}, more than "
            f"promotion.max_class_drop {rules.max_class_drop:g}: not promoted"
        )
    recall = scores_of(challenger.score)
    for name in comparison.added:
        value = recall.recall.get(name, 0.0) if isinstance(recall, Scores) else 0.0
        minimum = rules.new_class_min_recall or 0.0
        if round(value, PRECISION) < minimum:
            return False, (
                f"{reason}, but new class {name!r} has recall {value:.4f}, less than the "
                f"{minimum:g} promotion.new_class_min_recall asks for: not promoted"
            )
    return True, reason


def below_minimum(whole: Scores, rules: PromotionConfig) -> str:
    """Why a model scored ``whole`` on its test split is below ``promotion.minimum`` (and so
    cannot be a champion, not even the first), or ""."""
    floor, metric = rules.minimum, rules.metric
    value = whole.metric(metric)
    if round(value, PRECISION) < floor.metric:
        return (
            f"{metric} {value:.4f} is less than the {floor.metric:g} "
            "promotion.minimum.metric asks for"
        )
    if floor.class_recall is None:
        return ""
    low = sorted(
        (recall, name)
        for name, recall in whole.recall.items()
        if round(recall, PRECISION) < floor.class_recall
    )
    if not low:
        return ""
    floor_text = f"less than the {floor.class_recall:g} promotion.minimum.class_recall asks for"
    if len(low) == 1:
        recall, name = low[0]
        return f"class {name!r} has recall {recall:.4f}, {floor_text}"
    named = ", ".join(f"{name!r} ({recall:.4f})" for recall, name in low[:5])
    more = f" and {len(low) - 5} more" if len(low) > 5 else ""
    return f"classes {named}{more} have recall {floor_text}"


def _champion_of(challenger: Challenger, ours: Scores, metric: str) -> Champion:
    """The record the challenger becomes when promoted: its scores on its whole test split."""
    return Champion(
        challenger.run_id,
        metric,
        ours.metric(metric),
        challenger.model,
        challenger.staged_version,
        datetime.now(UTC).isoformat(),
        challenger.data,
        challenger.root,
        {m: round(ours.metric(m), 6) for m in METRICS if m != metric},
        challenger.classes,
        {name: round(value, 6) for name, value in ours.recall.items()},
    )


def challenge(
    container: Any,
    base: str,
    challenger: Challenger,
    rules: PromotionConfig,
    rescore: Rescore,
    record_blob: str,
) -> Decision:
    """Read the champion of the challenger's data root, decide, and replace it when the
    challenger wins (unless another run replaced it meanwhile); the decision is written to
    ``record_blob`` either way. A score on less than ``rules.min_scored_fraction`` of the test
    split decides nothing (the champion stays)."""
    metric = rules.metric
    whole = scores_of(challenger.score)
    if isinstance(whole, str):
        raise ValueError(f"run {challenger.run_id}'s score cannot be compared: {whole}")
    value = whole.metric(metric)
    where = challenger.root.where
    read: ChampionRead = champion_for(container, base, challenger.root)
    unmeasured = too_little_scored(challenger, rules.min_scored_fraction)
    floor = below_minimum(whole, rules)
    comparison: Comparison | None = None
    note = ""
    promoted, reason = False, ""
    stays = (
        "the champion stays"
        if read.champion
        else "the damaged champion record stays"
        if read.damaged
        else "there is still no champion"
    )
    if unmeasured:
        promoted, reason = False, f"{unmeasured}: not promoted, {stays}"
        note = unmeasured
    elif floor:
        # Before any comparison: a model below the floor serves nobody, first or not.
        first = "" if read.champion or read.damaged else f"no champion of {where} yet, but "
        promoted, reason = False, f"{first}{floor}: not promoted, {stays}"
    elif read.damaged:
        note = f"the champion record of {where} ({read.blob}) is damaged ({read.damaged})"
    elif read.champion is None:
        promoted, reason = (
            True,
            f"no champion of {where} yet: {metric} {value:.4f} becomes the first",
        )
    else:
        compared = _compare(read.champion, challenger, rescore)
        if isinstance(compared, str):
            note = compared
        else:
            comparison = compared
            promoted, reason = _judge(comparison, challenger, rules)
            reason += _both_scored(read.champion, challenger, comparison.rescored is not None)
    if note and not unmeasured:
        promoted, reason = True, f"{note}: {metric} {value:.4f} becomes the champion"
    kept = None
    if promoted:
        try:
            kept = replace_champion(
                container, base, challenger.root, _champion_of(challenger, whole, metric), read
            )
        except ChampionMovedError:
            promoted, reason = False, "another run replaced the champion meanwhile: not promoted"
    champion = read.champion
    record: dict[str, Any] = {
        "run_id": challenger.run_id,
        "promoted": promoted,
        "reason": reason,
        "metric": metric,
        "accuracy": whole.accuracy,
        "data_root": {"container": challenger.root.container, "prefix": challenger.root.prefix},
        "challenger": {
            **{m: whole.metric(m) for m in METRICS},
            "data_version": challenger.staged_version,
            "data": challenger.data,
            "test_images": challenger.test_images,
            "unreadable_test_images": challenger.unreadable_test_images,
            "classes": list(challenger.classes),
        },
        "champion_record": read.state,
        "champion_before": champion.as_record() if champion else None,
        # The champion's model on the challenger's test split, when it was scored again.
        "champion_on_this_test_split": None,
        "rules": rules.model_dump(mode="json"),
    }
    if comparison is not None:
        rescored = comparison.rescored
        if rescored is not None:
            record["champion_on_this_test_split"] = {
                **{m: comparison.theirs.metric(m) for m in METRICS},
                "test_images": rescored.get("num_images"),
                "classes": rescored.get("class_names"),
            }
        record["classes"] = {
            "compared": list(comparison.compared),
            "added": list(comparison.added),
            "removed": list(comparison.removed),
            "challenger_on_compared": comparison.ours.as_record(),
            "champion_on_compared": comparison.theirs.as_record(),
        }
        record["per_class"] = comparison.drops
    elif note and not unmeasured and "cannot be scored" in note:
        record["champion_on_this_test_split"] = {"error": note}
    if floor:
        record["below_minimum"] = floor
    if read.damaged:
        record["damaged_record"] = {"why": read.damaged, "kept_as": kept}
    container.upload_blob(record_blob, json.dumps(record, indent=2), overwrite=True)
    return Decision(promoted, reason, note, record)
