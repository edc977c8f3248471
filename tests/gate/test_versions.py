"""The data gate validates exactly the data version the run trains (core/data_versions.py):
the newest complete one, the one named, or a root without versions whole; a root that mixes
loose files with versions stops the gate with both named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client, upload_directory
from core.config import PipelineConfig
from core.data_versions import DataVersionError
from core.run import Run
from staging.listing import listing_blob
from tests.pipeline_helpers import make_config

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture
def config(azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineConfig:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    return make_config(tmp_path, "data.prefix=images")


def _version(config: PipelineConfig, source: Path, name: str) -> int:
    """Upload ``source`` as version ``name`` of the config's data root, its marker last."""
    container = container_client(config.data, create=True)
    count = upload_directory(container, source, f"{config.data.prefix}/{name}")
    container.upload_blob(f"{config.data.prefix}/{name}/_SUCCESS", b"", overwrite=True)
    return count


def _gate(config: PipelineConfig, tmp_path: Path, run_id: str) -> Any:
    from prefect import flow

    from tasks.validate import validate_data

    @flow
    def gate() -> Any:
        return validate_data(config, Run(run_id, f"runs/{run_id}", tmp_path / run_id))

    return gate(return_state=True)


def _pinned(config: PipelineConfig, run_id: str) -> dict[str, Any]:
    outputs = container_client(config.output)
    return json.loads(outputs.download_blob(listing_blob(f"runs/{run_id}")).readall())


def test_the_gate_validates_the_newest_version_only(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    """Two complete versions under the root: the gate passes on the newest, and its listing
    holds that version's files and no marker (each version's _SUCCESS failed the gate as an
    unreadable image of the root)."""
    images = _version(config, small_folders, "v1")
    _version(config, small_folders, "v2")
    state = _gate(config, tmp_path, "r-newest")
    assert state.is_completed(), state.message
    validated = state.result().value
    assert validated.version.version == "v2" and validated.version.chosen.startswith("the newest")
    listing = _pinned(config, "r-newest")
    assert listing["prefix"] == "images/v2"
    names = [b["name"] for b in listing["blobs"]]
    assert len(names) == images and all(n.startswith("images/v2/") for n in names)
    assert not any(n.endswith("_SUCCESS") for n in names)


def test_a_named_version_is_the_one_validated(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    _version(config, small_folders, "v1")
    _version(config, small_folders, "v2")
    named = config.model_copy(update={"data": config.data.pinned("v1")})
    state = _gate(named, tmp_path, "r-named")
    assert state.is_completed(), state.message
    assert state.result().value.version.version == "v1"
    assert _pinned(config, "r-named")["prefix"] == "images/v1"


def test_an_incomplete_version_is_not_trained(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    """A version still arriving (no marker yet) is passed over by a run that names none, and
    refused, with its marker named, to a run that names it."""
    _version(config, small_folders, "v1")
    upload_directory(container_client(config.data), small_folders, "images/v2")  # no marker
    state = _gate(config, tmp_path, "r-incomplete")
    assert state.is_completed(), state.message
    assert state.result().value.version.version == "v1"
    named = config.model_copy(update={"data": config.data.pinned("v2")})
    refused = _gate(named, tmp_path, "r-incomplete-named")
    assert refused.is_failed()
    with pytest.raises(DataVersionError, match=r"images/v2/_SUCCESS does not exist"):
        refused.result()


def test_loose_files_beside_versions_are_refused_naming_both(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    """What the documented path left behind before versions were one concept: the seeded data
    loose under the root, a new version beside it. The gate failed on v2's marker as an
    unreadable image of one dataset of both; now it says which files and versions are mixed,
    and how to move the loose ones into a version."""
    upload_directory(container_client(config.data, create=True), small_folders, "images")
    _version(config, small_folders, "v2")
    state = _gate(config, tmp_path, "r-mixed")
    assert state.is_failed()
    with pytest.raises(DataVersionError) as raised:
        state.result()
    message = str(raised.value)
    assert "loose files (test/, train/)" in message and "data versions (v2)" in message
    assert "images/v0/train/" in message and "images/v0/_SUCCESS" in message


def test_a_root_without_versions_is_validated_whole(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    """A config written before versions: its prefix holds the splits (and maybe its own
    marker); the gate validates it as it did."""
    container = container_client(config.data, create=True)
    images = upload_directory(container, small_folders, "images")
    container.upload_blob("images/_SUCCESS", b"")
    state = _gate(config, tmp_path, "r-flat")
    assert state.is_completed(), state.message
    version = state.result().value.version
    assert version.version is None and version.marker_etag
    listing = _pinned(config, "r-flat")
    assert listing["prefix"] == "images" and len(listing["blobs"]) == images


def test_versions_completed_in_one_second_are_ordered_by_their_numbers(
    config: PipelineConfig, small_folders: Path, tmp_path: Path
) -> None:
    """Storage keeps a marker's time to the second: v9 and v10 completed in one second were
    ordered as text, and the run trained v9, calling it the newest."""
    from tests.reliability import report

    container = container_client(config.data, create=True)
    for name in ("v9", "v10"):
        upload_directory(container, small_folders, f"images/{name}")
    for _ in range(5):  # both markers in one second (a retry when a second boundary fell between)
        times = {
            container.upload_blob(f"images/{name}/_SUCCESS", b"", overwrite=True)
            .get_blob_properties()
            .last_modified
            for name in ("v10", "v9")
        }
        if len(times) == 1:
            break
    assert len(times) == 1, times
    state = _gate(config, tmp_path, "r-same-second")
    assert state.is_completed(), state.message
    version = state.result().value.version
    assert (version.version, version.chosen) == ("v10", "the newest of 2 complete versions")
    assert _pinned(config, "r-same-second")["prefix"] == "images/v10"
    report.record(
        "adversarial",
        "data versions v9 and v10 whose _SUCCESS markers share a second",
        "v10 chosen, the newest (numbers in names compared as numbers)",
        before_fix="v9 chosen and called the newest (names compared as text)",
        versions="v9, v10",
    )
