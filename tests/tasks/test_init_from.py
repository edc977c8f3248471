"""Resolving training.init_from before anything is provisioned (tasks/init_from.py), against a
real Azurite: the champion checked by its record, its metrics and its recorded MD5, blobs of the
configured containers, files on NFS; each bad case a named error, and nothing stored changed."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from backends.blob import container_client
from core.config import PipelineConfig
from registry.champion import Champion, champion_for, replace_champion
from registry.layout import champion_blob
from tasks.init_from import InitFromConfigError, resolve_start
from tests.pipeline_helpers import make_config

MODEL = b"the bytes of a model.pt" * 100


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def _with(config: PipelineConfig, value: str | None) -> PipelineConfig:
    return config.model_copy(update={"training": replace(config.training, init_from=value)})


def _crown(
    config: PipelineConfig,
    run_id: str = "20261101-000000-aaaaaaaa",
    model: str = "cnn",
    size: int = 32,
    recorded: str | None = "same",
    upload: bool = True,
) -> str:
    outputs = container_client(config.output, create=True)
    blob = f"runs/{run_id}/model.pt"
    if upload:
        outputs.upload_blob(blob, MODEL, overwrite=True)
    metrics = {"model": model, "input_size": size}
    if recorded is not None:
        metrics["model_md5"] = _md5(MODEL) if recorded == "same" else recorded
    outputs.upload_blob(f"runs/{run_id}/metrics.json", json.dumps(metrics), overwrite=True)
    root = config.data.root
    new = Champion(run_id, "accuracy", 0.9, blob, None, "2026-11-01T00:00:00Z", root=root)
    replace_champion(outputs, "", root, new, champion_for(outputs, "", root))
    return run_id


def test_no_champion_yet_trains_from_scratch(tmp_path: Path) -> None:
    config = _with(make_config(tmp_path), "champion")
    container_client(config.output, create=True)
    start = resolve_start(config)
    assert start.resolved is None and start.config.training.init_from is None
    assert "has no champion yet" in start.why and start.asked == "champion"


def test_the_champion_resolves_to_its_checked_model(tmp_path: Path) -> None:
    config = _with(make_config(tmp_path), "champion")
    run_id = _crown(config)
    start = resolve_start(config)
    assert start.resolved == f"output:runs/{run_id}/model.pt"
    assert start.config.training.init_from == start.resolved
    assert (start.run_id, start.md5) == (run_id, _md5(MODEL))
    assert "checked against its recorded MD5" in start.why


@pytest.mark.parametrize(
    ("crown", "named"),
    [
        ({"upload": False}, "names the model runs/.*/model.pt, which does not exist"),
        ({"recorded": _md5(b"other bytes")}, "do not match the MD5 the trainer recorded"),
        ({"recorded": None}, "no MD5 is recorded"),
        ({"model": "resnet18", "size": 64}, "is a resnet18 at 64 px; this run trains a cnn at 32"),
        ({"size": 48}, "is a cnn at 48 px; this run trains a cnn at 32 px"),
    ],
)
def test_a_champion_that_cannot_start_the_run_is_named(
    crown: dict[str, object], named: str, tmp_path: Path
) -> None:
    # The run states its input size: one left unset is fitted, and a warm start then takes the
    # champion's (tests/tasks/test_fit_to_data.py).
    config = _with(make_config(tmp_path, "training.image_size=32"), "champion")
    _crown(config, **crown)  # type: ignore[arg-type]
    outputs = container_client(config.output)
    before = {b.name: b.etag for b in outputs.list_blobs()}
    with pytest.raises(InitFromConfigError, match=named):
        resolve_start(config)
    assert {b.name: b.etag for b in outputs.list_blobs()} == before  # nothing stored changed


def test_a_damaged_champion_record_is_named(tmp_path: Path) -> None:
    config = _with(make_config(tmp_path), "champion")
    outputs = container_client(config.output, create=True)
    outputs.upload_blob(champion_blob("", config.data.root), b"{not json", overwrite=True)
    with pytest.raises(InitFromConfigError, match=r"champion record .* is damaged"):
        resolve_start(config)


def test_blobs_of_the_configured_containers(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    outputs = container_client(config.output, create=True)
    data = container_client(config.data, create=True)
    with pytest.raises(InitFromConfigError, match="no such blob in the output container"):
        resolve_start(_with(config, "output:weights/r50.pth"))
    outputs.upload_blob("weights/r50.pth", MODEL)
    start = resolve_start(_with(config, "output:weights/r50.pth"))
    assert start.resolved == "output:weights/r50.pth" and start.run_id is None
    with pytest.raises(InitFromConfigError, match="no such blob in the data container"):
        resolve_start(_with(config, "data:imagenet/r18.pth"))
    data.upload_blob("imagenet/r18.pth", MODEL)
    first = resolve_start(_with(config, "data:imagenet/r18.pth"))
    digest = hashlib.md5(MODEL, usedforsecurity=False).hexdigest()
    assert first.resolved == f"output:init-from/{digest}/r18.pth" and first.md5 == _md5(MODEL)
    copied = outputs.download_blob(f"init-from/{digest}/r18.pth").readall()
    assert copied == MODEL
    etag = outputs.get_blob_client(f"init-from/{digest}/r18.pth").get_blob_properties().etag
    again = resolve_start(_with(config, "data:imagenet/r18.pth"))  # the same content: not again
    assert again.resolved == first.resolved
    props = outputs.get_blob_client(f"init-from/{digest}/r18.pth").get_blob_properties()
    assert props.etag == etag


def test_a_file_on_nfs_must_exist_on_the_local_target(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with pytest.raises(InitFromConfigError, match=r"nfs/weights/r\.pth does not exist"):
        resolve_start(_with(config, "nfs:weights/r.pth"))
    (config.nfs.local_dir / "weights").mkdir(parents=True)
    (config.nfs.local_dir / "weights" / "r.pth").write_bytes(MODEL)
    assert resolve_start(_with(config, "nfs:weights/r.pth")).resolved == "nfs:weights/r.pth"


def test_a_new_champion_is_a_new_input(tmp_path: Path) -> None:
    """The resolved weights are part of the up-to-date fingerprint and the checkpoint key: a
    run from another champion's model neither counts as up to date nor resumes its checkpoints."""
    from tasks.train_and_score import training_key
    from tasks.up_to_date import differences, fingerprint

    config = make_config(tmp_path)
    a = _with(config, "output:runs/20261101-000000-aaaaaaaa/model.pt")
    b = _with(config, "output:runs/20261102-000000-bbbbbbbb/model.pt")
    changed = differences(fingerprint(a, "listing"), fingerprint(b, "listing"))
    assert changed == [
        "training.init_from 'output:runs/20261101-000000-aaaaaaaa/model.pt' -> "
        "'output:runs/20261102-000000-bbbbbbbb/model.pt'"
    ]
    assert training_key(a, "v", "code") != training_key(b, "v", "code")
    assert differences(fingerprint(config, "listing"), fingerprint(config, "listing")) == []


def test_a_retrain_of_the_champion_is_compared_without_its_start(tmp_path: Path) -> None:
    """Following the champion, the starting weights are not an input of the up-to-date check
    (the champion is the pipeline's own output: the version it was trained on stays up to
    date); the checkpoint key still names them, so no checkpoint of another start resumes."""
    from tasks.train_and_score import training_key
    from tasks.up_to_date import differences, fingerprint

    config = make_config(tmp_path, "training.follow_champion=true")
    a = _with(config, "output:runs/20261101-000000-aaaaaaaa/model.pt")
    b = _with(config, "output:runs/20261102-000000-bbbbbbbb/model.pt")
    assert differences(fingerprint(a, "listing"), fingerprint(b, "listing")) == []
    assert fingerprint(a, "listing") == fingerprint(_with(config, None), "listing")
    assert training_key(a, "v", "code") != training_key(b, "v", "code")
    # The switch itself shapes no weight: a run without it compares with the same settings.
    plain = make_config(tmp_path)
    assert fingerprint(plain, "listing")["training"] == fingerprint(a, "listing")["training"]
