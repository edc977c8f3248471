"""The owner of a PostgreSQL data folder that outlives its state folder (below the postgres
user's home): recorded, checked at every start, and the folder refused by name to another state
folder at the same path (a new checkout where an old one was), never silently reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.postgres import Cluster, PostgresError
from tests.reliability import report


def _in_home(tmp_path: Path) -> Cluster:
    """A data folder as one below ~postgres is: outside the state folder (nothing is run)."""
    return Cluster(tmp_path / "home" / "retrain" / "3f2a", Path("/nonexistent"), None, True)


def test_a_data_folder_is_refused_to_a_state_folder_that_did_not_make_it(tmp_path: Path) -> None:
    cluster = _in_home(tmp_path)
    state = tmp_path / "checkout" / ".service"
    assert cluster.claim(state, "first", adopt=False) is None  # a new folder: recorded
    cluster.data_dir.mkdir(parents=True)
    (cluster.data_dir / "PG_VERSION").write_text("15\n")  # initdb ran
    assert json.loads(cluster.owner_file.read_text())["service_id"] == "first"
    assert cluster.claim(state, "first", adopt=False) is None  # the same state: its own
    # The checkout removed and cloned again at the same path: a new state folder, a new id.
    with pytest.raises(PostgresError) as refused:
        cluster.claim(state, "second", adopt=False)
    said = str(refused.value)
    assert str(cluster.data_dir) in said and "(id first," in said and "not reused" in said
    assert f"--state {state} --clean" in said
    assert json.loads(cluster.owner_file.read_text())["service_id"] == "first"  # unchanged
    report.record(
        "orchestrator",
        "a new checkout's service at the path of a removed one whose PostgreSQL data stayed "
        "below ~postgres",
        "refused, naming the data folder, its owner and the --clean command that removes it",
        before_fix="the old database silently reused",
    )


def test_a_folder_older_than_the_records_is_adopted_only_by_a_used_state(tmp_path: Path) -> None:
    cluster = _in_home(tmp_path)
    state = tmp_path / ".service"
    cluster.data_dir.mkdir(parents=True)
    (cluster.data_dir / "PG_VERSION").write_text("15\n")
    with pytest.raises(PostgresError, match="no owner recorded"):
        cluster.claim(state, "fresh", adopt=False)
    assert cluster.claim(state, "used", adopt=True) == (
        f"data folder of an earlier start adopted ({cluster.owner_file.name})"
    )
    assert cluster.claim(state, "used", adopt=False) is None
    assert cluster.remove() == f"PostgreSQL data folder {cluster.data_dir} removed"
    assert not cluster.data_dir.exists() and not cluster.owner_file.exists()
    assert cluster.remove() is None


def test_a_data_folder_inside_the_state_folder_goes_with_it(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / ".service" / "postgres", Path("/nonexistent"), None, False)
    cluster.data_dir.mkdir(parents=True)
    (cluster.data_dir / "PG_VERSION").write_text("15\n")
    assert cluster.claim(tmp_path / ".service", "any", adopt=False) is None
    assert not cluster.owner_file.exists()
