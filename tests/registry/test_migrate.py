"""Records of one champion per output prefix (the layout before data roots had folders of their
own) read and copied once into their data roots' folders, through `python -m cli.models` and
the flow's up-to-date check; the old blobs are left byte for byte."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from cli.models import main
from core.data_versions import DataRoot, DataVersion
from core.run import output_prefix
from registry.champion import champion_for
from registry.last_run import read_last_run
from registry.layout import champion_blob, history_blob, last_run_blob, trained_blob
from registry.run_record import RunRecord, write_run_record

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"
DIGITS = DataRoot("training-data", "digits")  # configs/local.yaml's data root
FACES = DataRoot("training-data", "faces")
OLD, NEW, ANCIENT = "20261101-020000-aaaaaaaa", "20261102-020000-bbbbbbbb", "20261001-020000-cccc"


def _old_champion(run_id: str, accuracy: float, data: str | None) -> bytes:
    """A champion record as the code before data roots wrote it."""
    record: dict[str, Any] = {
        "run_id": run_id,
        "accuracy": accuracy,
        "model": f"team/runs/{run_id}/model.pt",
        "data_version": "staged-1",
        "promoted_at": "2026-11-01T02:10:00+00:00",
    }
    if data is not None:
        record["data"] = data
    return json.dumps(record, indent=2).encode()


def _old_last_run(run_id: str, data: dict[str, Any] | None, fingerprint: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "run_id": run_id,
            "fingerprint": fingerprint,
            "model": f"team/runs/{run_id}/model.pt",
            "outputs": f"team/runs/{run_id}",
            "accuracy": 0.9,
            "finished_at": "2026-11-02T02:10:00+00:00",
            "data": data,
        }
    ).encode()


@pytest.fixture
def outputs(azurite: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ContainerClient, list[str]]:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"migrate-{uuid.uuid4().hex[:8]}"
    container = ContainerClient.from_connection_string(azurite, name)
    container.create_container()
    where = ["--config", str(LOCAL), "--set", f"output.container={name}"]
    return container, [*where, "--set", "output.prefix=team"]


def _seed_old_layout(container: ContainerClient) -> dict[str, bytes]:
    """The faces run took the champion of the whole prefix (the bug); the digits champion it
    replaced is in the history; the last run trained faces. Each run has its run.json."""
    faces = DataVersion("training-data", "faces", "v1", "0x1", None, "the newest of 1")
    digits = DataVersion("training-data", "digits", "v1", "0x2", None, "the newest of 1")
    for run_id, version in ((OLD, digits), (NEW, faces)):
        write_run_record(
            container,
            output_prefix("team", run_id),
            RunRecord(run_id, "promoted", "2026-11-01T02:00:00+00:00", version.as_record()),
        )
        container.upload_blob(f"team/runs/{run_id}/model.pt", f"model of {run_id}".encode())
    blobs = {
        "team/models/champion.json": _old_champion(NEW, 0.7, "training-data/faces/v1"),
        f"team/models/history/{OLD}.json": _old_champion(OLD, 0.9, "training-data/digits/v1"),
        f"team/models/history/{NEW}.json": _old_champion(NEW, 0.7, "training-data/faces/v1"),
        # Before run records and the data field: no data root is recorded anywhere.
        f"team/models/history/{ANCIENT}.json": _old_champion(ANCIENT, 0.8, None),
        "team/models/history/damaged-20261101T000000000000Z.json": b"{not json",
        "team/models/last-run.json": _old_last_run(NEW, faces.as_record(), {"data_version": "f"}),
        "team/models/trained/0123abcd.json": _old_last_run(
            OLD, digits.as_record(), {"data_version": "d"}
        ),
    }
    for name, data in blobs.items():
        container.upload_blob(name, data)
    return blobs


def test_old_records_are_copied_once_into_their_data_roots_and_kept(
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    container, where = outputs
    blobs = _seed_old_layout(container)

    # The digits pipeline asks for its champion: none now (faces took it before the change).
    assert main([*where, "download", "--to", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "registry: 7 records below team/models/ were kept for the whole output prefix" in err
    assert f"team/models/champion.json -> {champion_blob('team', FACES)}" in err
    assert f"from run {NEW}'s record" in err
    assert f"-> {history_blob('team', DIGITS, OLD)}: data root training-data/digits" in err
    assert (
        f"no data root recorded for run {ANCIENT}: taken as training-data/digits, the data root "
        "of the config that read it first"
    ) in err
    assert "damaged-20261101T000000000000Z.json -> (not copied): left in place" in err
    assert "there is no champion of data root training-data/digits yet" in err

    # The faces dataset's champion is where its pipeline looks for it, named as such.
    faces = ["--set", "data.prefix=faces"]
    assert main([*where, *faces, "download", "--to", str(tmp_path / "faces.pt")]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # migrated once: nothing is copied again
    assert f"the champion of data root training-data/faces: run {NEW}" in out
    assert (tmp_path / "faces.pt").read_bytes() == f"model of {NEW}".encode()
    champion = champion_for(container, "team", FACES).champion
    assert champion is not None and champion.run_id == NEW
    last, _ = read_last_run(container, "team", FACES)
    assert last is not None and last.run_id == NEW
    assert read_last_run(container, "team", DIGITS) == (None, None)
    assert (
        container.download_blob(trained_blob("team", DIGITS, "0123abcd")).readall()
        == (blobs["team/models/trained/0123abcd.json"])
    )
    # Nothing stored is lost: every old blob holds its bytes, and the log of it is kept.
    for name, data in blobs.items():
        assert container.download_blob(name).readall() == data, name
    migrated = json.loads(container.download_blob("team/models/migrated.json").readall())
    assert {r["source"] for r in migrated["records"]} == set(blobs)
    assert last_run_blob("team", FACES) in {r["target"] for r in migrated["records"]}

    # `list` shows each run's data root and version; each root's champion is marked.
    assert main([*where, "list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[NEW].split()[1:3] == ["training-data/faces", "v1"]
    assert rows[NEW].endswith("<- champion")
    assert rows[OLD].split()[1:3] == ["training-data/digits", "v1"]
    assert not rows[OLD].endswith("<- champion")


def test_a_record_of_another_root_copied_by_hand_is_not_that_roots_champion(
    outputs: tuple[ContainerClient, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A champion record names its data root: one copied into another root's folder would
    serve one dataset with another's classes, so it is a damaged record there, named."""
    container, where = outputs
    record = json.loads(_old_champion(NEW, 0.7, "training-data/faces/v1"))
    record["data_root"] = {"container": "training-data", "prefix": "faces"}
    container.upload_blob(champion_blob("team", DIGITS), json.dumps(record))
    read = champion_for(container, "team", DIGITS)
    assert read.state == "damaged" and read.damaged == (
        "it is the champion of data root training-data/faces, not of training-data/digits"
    )
    assert main([*where, "download"]) == 2
    assert "it is the champion of data root training-data/faces" in capsys.readouterr().err


def test_the_up_to_date_check_reads_an_old_last_run_record(
    prefect_api: None, azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run after the change, with the inputs of the last run before it: up to date with it
    (its record copied into the data root's folder first), not trained again."""
    from prefect import flow

    from backends.blob import container_client
    from tasks.up_to_date import check_up_to_date, fingerprint
    from tasks.validate import Validated
    from tests.pipeline_helpers import make_config

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    outputs = container_client(config.output, create=True)
    root = config.data.root
    version = DataVersion(root.container, root.prefix, None, None, None, "no versions")
    outputs.upload_blob(f"runs/{OLD}/model.pt", b"weights")
    old = json.loads(_old_last_run(OLD, version.as_record(), fingerprint(config, "abc")))
    old.update(model=f"runs/{OLD}/model.pt", outputs=f"runs/{OLD}")
    outputs.upload_blob("models/last-run.json", json.dumps(old))

    @flow
    def check() -> Any:
        return check_up_to_date(config, Validated(version, "abc"), False).value

    result = check()
    assert result.fresh is True and f"those of run {OLD}" in result.why
    assert outputs.download_blob(last_run_blob("", root)).readall() == json.dumps(old).encode()
