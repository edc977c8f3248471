"""A new user's first week, as found by trying it: what the pipeline tells them must be true
and whole. The settings' sources as they really are (a value given with ``--set`` is not "set in
the deployment's config"), and ``cli.models list`` showing each decision whole (wrapped to the
terminal, or one line with ``--wide``), never cut with "..."."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from cli.models import _table, main
from core.config import load_config
from core.recipe import describe, explicit_training_fields, training_settings
from registry.store import RunEntry
from tests.core.test_recipe import RECIPE
from tests.registry.test_promotion import ROOT as IMAGES
from tests.registry.test_promotion import _run as promote_in
from tests.registry.test_promotion import report as score_of
from tests.reliability import report

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_each_setting_names_where_the_run_set_it() -> None:
    """Before: every value the run stated was "set in the deployment's config", a value given
    with --set on the command line included."""
    config = load_config(
        LOCAL, ["training.follow_champion=true", "training.lr=0.02", "training.epochs=3"]
    ).training
    by_cli = explicit_training_fields(
        ["training.follow_champion=true", "training.lr=0.02"], {"training.epochs": 3}
    )
    _, origins = training_settings(config, by_cli, RECIPE, "the config file configs/local.yaml")
    lines = describe(origins)
    assert "training.follow_champion = True: set with --set training.follow_champion=true" in lines
    assert "training.lr = 0.02: set with --set training.lr=0.02" in lines
    assert "training.epochs = 3: set by the run's epochs parameter (3)" in lines
    engine = (
        "training.engine = 'horovod': the config file configs/local.yaml (not part of a recipe)"
    )
    assert engine in lines, lines
    assert not any("deployment" in line for line in lines), lines
    deployed = explicit_training_fields(["training.follow_champion=true"], deployed=True)
    assert deployed == {
        "follow_champion": "set by the run's overrides parameter (training.follow_champion=true)"
    }
    _, fresh = training_settings(config, {}, None, "the config file configs/local.yaml")
    fresh_lr = "training.lr = 0.02: the config file configs/local.yaml (no champion yet)"
    assert fresh_lr in describe(fresh)
    report.record(
        "adversarial",
        "first week: `--set training.follow_champion=true` on the command line, then the "
        "follow-champion step's settings",
        "each setting names its real source: --set, the run's overrides parameter or field, "
        "the champion's recipe, the config file",
        message=lines[[line.startswith("training.follow_champion") for line in lines].index(True)],
        before_fix="training.follow_champion = True: set in the deployment's config",
    )


def test_list_shows_whole_decisions_wrapped_or_wide(
    azurite: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decision of a new data version that added and removed classes, with the data versions
    both were scored on, is longer than the 300 characters `list` used to show."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"week-{uuid.uuid4().hex[:8]}"
    outputs = ContainerClient.from_connection_string(azurite, name)
    outputs.create_container()
    old = ["tabby-cat", "golden-retriever", "red-fox-in-snow"]
    new = ["tabby-cat", "golden-retriever", "arctic-hare-in-winter-coat"]
    first = score_of(old, [[9, 1, 0], [1, 9, 0], [0, 1, 9]])
    promote_in(outputs, "20261101-000000-aaaaaaaa", first, "staged-a", "photos/v1", IMAGES)
    on_v2 = score_of(old, [[9, 1, 0], [1, 9, 0], [0, 0, 0]])
    better = score_of(new, [[10, 0, 0], [0, 10, 0], [0, 1, 9]])
    run = "20261102-000000-bbbbbbbb"
    decision = promote_in(outputs, run, better, "staged-b", "photos/v2", IMAGES, rescored=on_v2)
    reason = decision["reason"]
    assert len(reason) > 300, reason

    where = ["--config", str(LOCAL), "--set", f"output.container={name}"]
    assert main([*where, "list"]) == 0  # not a terminal: one line per run, whole
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(run)]
    assert row.endswith(f"promoted: {reason}") and "..." not in row
    assert main([*where, "list", "--wide"]) == 0
    assert capsys.readouterr().out.count(reason) == 1

    # On a 100-column terminal: wrapped below the decision column, every word kept.
    entry = RunEntry(run, 0.9667, True, reason, False, "promoted", "v2", None, "photos")
    wrapped = _table([entry], width=100).splitlines()[1:]
    assert all(len(line) <= 100 for line in wrapped) and len(wrapped) > 3
    column = wrapped[0].index("promoted")
    assert all(line[:column].strip() == "" for line in wrapped[1:])
    assert " ".join(line[column:] for line in wrapped).split() == f"promoted: {reason}".split()
    narrow = _table([entry], width=40).splitlines()[1:]  # narrower than the columns
    assert narrow[0].startswith(run) and all(line.startswith("    ") for line in narrow[1:])
    assert " ".join(narrow[1:]).split() == f"promoted: {reason}".split()
    report.record(
        "adversarial",
        f"first week: `cli.models list` of a decision of {len(reason)} characters (classes "
        "changed, both data versions named)",
        "shown whole: one line per run in a pipe or with --wide, wrapped under the decision "
        "column on a terminal",
        before_fix="cut at 300 characters with '...'",
    )
