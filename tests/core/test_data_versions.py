"""The one definition of a data version (core/data_versions.py): which data a run trains, and
which blob completes which version, for the gate, the relay, the sensor and the runs alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from core.config import ConfigError, load_config
from core.data_versions import (
    Complete,
    DataRoot,
    DataVersionError,
    Survey,
    check_version_name,
    choose,
)
from tests.conftest import ROOT

ROOT_ = DataRoot("training-data", "images")
T0 = datetime(2026, 11, 25, 2, 0, tzinfo=UTC)


def survey(
    complete: dict[str, int] | None = None,
    incomplete: tuple[str, ...] = (),
    splits: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
) -> Survey:
    """``complete``: version name -> minutes after T0 its marker was written."""
    done = [Complete(n, f"0x{n}", T0 + timedelta(minutes=m)) for n, m in (complete or {}).items()]
    return Survey(ROOT_, list(files), list(splits), done, list(incomplete))


def test_the_newest_complete_version_is_the_one_whose_marker_came_last() -> None:
    """Not the greatest name: v10 sorts before v9, and a version re-completed later is newer."""
    chosen = choose(survey({"v9": 5, "v10": 9, "v2": 1}, incomplete=("v11",)), None)
    assert (chosen.version, chosen.marker_etag, chosen.prefix) == ("v10", "0xv10", "images/v10")
    assert chosen.chosen == "the newest of 3 complete versions"
    assert chosen.completed_at == (T0 + timedelta(minutes=9)).isoformat()
    assert choose(survey({"v1": 0}), None).chosen == "the only complete version"


@pytest.mark.parametrize(
    ("names", "newest"),
    [(("v9", "v10"), "v10"), (("2024-1-9", "2024-1-10"), "2024-1-10"), (("v2", "v10b"), "v10b")],
)
def test_markers_of_one_second_are_ordered_by_the_numbers_in_their_names(
    names: tuple[str, str], newest: str
) -> None:
    """Storage keeps a marker's time to the second: versions completed in the same second are
    told apart by name, read as people number versions (v10 after v9), not as text."""
    same = {name: 0 for name in names}
    for layout in (same, dict(reversed(list(same.items())))):
        chosen = choose(survey(layout), None)
        assert (chosen.version, chosen.chosen) == (newest, "the newest of 2 complete versions")
    with pytest.raises(DataVersionError, match=rf"{newest}, {names[0]} \(newest first\)"):
        choose(survey(same), "v7")


def test_a_named_version_is_chosen_whatever_is_newer() -> None:
    chosen = choose(survey({"v1": 0, "v2": 5}), "v1")
    assert (chosen.version, chosen.chosen) == ("v1", "named by the run")


@pytest.mark.parametrize(
    ("layout", "requested", "named"),
    [
        (survey({"v1": 0}, incomplete=("v2",)), "v2", "images/v2/_SUCCESS does not exist"),
        (survey({"v1": 0, "v2": 1}), "v7", "no data version v7 in training-data/images"),
        (survey({"v1": 0, "v2": 1}), "v7", "v2, v1 (newest first)"),
        (survey(splits=("test", "train")), "v1", "holds no versions"),
        (survey(incomplete=("v1",)), None, "no complete version"),
        (survey(), None, "is empty"),
    ],
)
def test_what_cannot_be_trained_is_refused_with_the_reason(
    layout: Survey, requested: str | None, named: str
) -> None:
    with pytest.raises(DataVersionError, match=named.replace("(", r"\(").replace(")", r"\)")):
        choose(layout, requested)


def test_a_root_without_versions_is_trained_whole() -> None:
    """Today's layouts: the splits directly below the prefix, its own marker ignored as data;
    a folder without a marker beside them does not make the root versioned."""
    flat = Survey(ROOT_, ["images/_SUCCESS"], ["test", "train"], [], ["extra"], "0xroot")
    chosen = choose(flat, None)
    assert (chosen.version, chosen.prefix, chosen.marker_etag) == (None, "images", "0xroot")
    assert chosen.label == "images (no versions)"
    assert chosen.describe() == "training-data/images, a data root without versions"


def test_loose_files_and_versions_together_are_refused_naming_both() -> None:
    mixed = survey({"v2": 0, "v3": 1}, splits=("test", "train"), files=("images/notes.txt",))
    with pytest.raises(DataVersionError) as raised:
        choose(mixed, None)
    message = str(raised.value)
    assert "loose files (test/, train/, images/notes.txt)" in message
    assert "data versions (v2, v3)" in message
    assert "move the loose files into a version" in message.lower()
    assert "images/v0/_SUCCESS" in message
    # The root's own marker is not a loose file: versions below it are trained as usual.
    assert choose(survey({"v2": 0}, files=("images/_SUCCESS",)), None).version == "v2"


@pytest.mark.parametrize(
    ("blob", "version"),
    [
        ("images/v2/_SUCCESS", "v2"),
        ("images/_SUCCESS", ""),
        ("images/v2/train/0/a.png", None),
        ("images/v2/sub/_SUCCESS", None),  # completes no version of this root
        ("images/train/_SUCCESS", None),  # a split folder is never a version
        ("other/v2/_SUCCESS", None),
        ("imagesx/v2/_SUCCESS", None),
    ],
)
def test_which_blob_completes_which_version(blob: str, version: str | None) -> None:
    assert ROOT_.version_of_marker(blob) == version


def test_a_root_of_the_whole_container() -> None:
    whole = DataRoot("c", "")
    assert whole.version_of_marker("v1/_SUCCESS") == "v1"
    assert whole.version_of_marker("_SUCCESS") == ""
    assert (whole.folder("v1"), whole.marker("v1"), whole.folder(None)) == ("v1", "v1/_SUCCESS", "")


@pytest.mark.parametrize("bad", ["a/b", "..", ".", "train", "_SUCCESS", "x\ty", "a\\b", "v" * 256])
def test_a_version_is_one_folder_name(bad: str) -> None:
    with pytest.raises(ValueError, match="not a version name"):
        check_version_name(bad)


def test_the_config_names_the_version_as_typed_and_refuses_a_path() -> None:
    config = load_config(ROOT / "configs" / "local.yaml", ["data.version=2024"])
    assert config.data.version == "2024" and config.data.dataset.prefix == "digits/2024"
    assert load_config(ROOT / "configs" / "local.yaml", ["data.version="]).data.version is None
    assert load_config(ROOT / "configs" / "local.yaml").data.dataset.prefix == "digits"
    with pytest.raises(ConfigError, match=r"data\.version: .*one folder name"):
        load_config(ROOT / "configs" / "local.yaml", ["data.version=v1/train"])
