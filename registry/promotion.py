"""Champion/challenger: promote the new model only when it is better by a margin.

Both numbers come from the same held-out data. The champion's recorded score was measured on
the test split of the data it was trained on; when this run's staged data differs, the
champion's model is scored again, on this run's test split (``rescore``, a task on the
cluster), and the decision is made on those two numbers (both are kept in ``promotion.json``).
A champion whose model cannot be scored on this data (it is gone, damaged, or knows other
classes) is no baseline for it: the challenger replaces it, and the decision says why.

A score is a measurement on the test split only if the scorer read most of it: the scorer skips
images it cannot decode, and a promotion was once decided on 3 of 28 test images. When the
scorer read less than ``promotion.min_scored_fraction`` of the split, nothing is decided: the
champion stays, and the decision names the numbers.

The champion record (``registry.champion``) is replaced with an ETag condition, so two runs
finishing together cannot both believe they won; a damaged record is a named decision.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from backends.cluster import Cluster
from registry.champion import (
    Champion,
    ChampionMovedError,
    ChampionRead,
    read_champion,
    replace_champion,
)
from registry.layout import CHAMPION
from registry.scoring import SCORER_REFUSED, run_scorer

RESCORE_NAME = "champion-score"  # its report in the run's outputs: champion-score.json
# Scores the champion's model on this run's test split: the scorer's report, or
# ``{"error": why}`` when the model cannot be scored on this data.
Rescore = Callable[[Champion], dict[str, Any]]


@dataclass(frozen=True)
class Challenger:
    """This run's model and its score."""

    run_id: str
    metric: str
    value: float
    model: str  # blob in the output container
    staged_version: str  # of the staged data it was trained and scored on
    test_images: int | None  # the test images the scorer read
    unreadable_test_images: int = 0  # those it skipped: files it could not decode
    data: str | None = None  # the data version it was trained on: container/prefix


@dataclass(frozen=True)
class Decision:
    promoted: bool
    reason: str
    note: str  # why there was nothing comparable to beat ("" when there was)
    record: dict[str, Any]  # what promotion.json holds


def decide(challenger: float, champion: float | None, margin: float) -> tuple[bool, str]:
    """Promote when the challenger beats the champion by more than ``margin``; the reason as a
    person would say it (no "by more than 0.0000" when no margin is asked for)."""
    if champion is None:
        return True, f"no champion yet: accuracy {challenger:.4f} becomes the first"
    ahead = challenger - champion
    versus = f"accuracy {challenger:.4f} against the champion's {champion:.4f}"
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


def _baseline(
    read: ChampionRead, challenger: Challenger, rescore: Rescore
) -> tuple[float | None, dict[str, Any] | None, str]:
    """The number the challenger must beat (None: nothing to beat), what was measured for
    it, and a note for the reason when there is nothing comparable."""
    champion = read.champion
    if read.damaged:
        return None, None, f"the champion record ({CHAMPION}) is damaged ({read.damaged})"
    if champion is None:
        return None, None, ""
    if champion.data_version == challenger.staged_version:
        return champion.value, None, ""
    rescored = rescore(champion)
    if "error" in rescored:
        return None, rescored, f"the champion cannot be scored on this data ({rescored['error']})"
    return float(rescored[challenger.metric]), rescored, ""


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


def challenge(
    container: Any,
    base: str,
    challenger: Challenger,
    margin: float,
    rescore: Rescore,
    record_blob: str,
    *,
    min_scored_fraction: float,
) -> Decision:
    """Read the champion, decide, and replace it when the challenger wins (unless another run
    replaced it meanwhile); the decision is written to ``record_blob`` either way. A score on
    less than ``min_scored_fraction`` of the test split decides nothing (the champion stays)."""
    metric, accuracy = challenger.metric, challenger.value
    read = read_champion(container, base, metric)
    unmeasured = too_little_scored(challenger, min_scored_fraction)
    baseline, rescored, note = (
        (None, None, unmeasured) if unmeasured else _baseline(read, challenger, rescore)
    )
    if unmeasured:
        stays = "the champion stays" if read.champion else "there is still no champion"
        promoted, reason = False, f"{unmeasured}: not promoted, {stays}"
    elif note:
        promoted, reason = True, f"{note}: accuracy {accuracy:.4f} becomes the champion"
    else:
        promoted, reason = decide(accuracy, baseline, margin)
        if read.champion is not None:
            reason += _both_scored(read.champion, challenger, rescored is not None)
    kept = None
    if promoted:
        new = Champion(
            challenger.run_id,
            metric,
            accuracy,
            challenger.model,
            challenger.staged_version,
            datetime.now(UTC).isoformat(),
            challenger.data,
        )
        try:
            kept = replace_champion(container, base, new, read)
        except ChampionMovedError:
            promoted, reason = False, "another run replaced the champion meanwhile: not promoted"
    champion = read.champion
    record = {
        "run_id": challenger.run_id,
        "promoted": promoted,
        "reason": reason,
        "metric": metric,
        "accuracy": accuracy,
        "challenger": {
            metric: accuracy,
            "data_version": challenger.staged_version,
            "data": challenger.data,
            "test_images": challenger.test_images,
            "unreadable_test_images": challenger.unreadable_test_images,
        },
        "champion_record": read.state,
        "champion_before": champion.as_record() if champion else None,
        # The champion's model on the challenger's test split, when the data versions differ.
        "champion_on_this_test_split": (
            {
                metric: rescored.get(metric),
                "test_images": rescored.get("num_images"),
                "error": rescored.get("error"),
            }
            if rescored is not None
            else None
        ),
    }
    if read.damaged:
        record["damaged_record"] = {"why": read.damaged, "kept_as": kept}
    container.upload_blob(record_blob, json.dumps(record, indent=2), overwrite=True)
    return Decision(promoted, reason, note, record)
