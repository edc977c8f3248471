"""Getting the model out (``python -m cli.models``): the runs with their decisions, and the
champion's model downloaded whole, against Azurite, from records the promotion code itself
wrote."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import ContainerClient, ContentSettings

from cli.models import main
from core.config import PromotionConfig
from core.data_versions import DataRoot
from core.run import output_prefix
from registry.champion import Champion
from registry.promotion import Challenger, challenge

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"
DIGITS = DataRoot("training-data", "digits")  # configs/local.yaml's data root


def _no_rescore(champion: Champion) -> dict[str, float]:
    raise AssertionError("every run here scores on the same data version")


def score(accuracy: float, images: int = 200) -> dict[str, Any]:
    """A scorer's report of two classes with this accuracy (both classes equally right)."""
    right = round(accuracy * images / 2)
    wrong = images // 2 - right
    return {
        "num_images": images,
        "class_names": ["a", "b"],
        "confusion_matrix": [[right, wrong], [wrong, right]],
        "skipped_images": [],
    }


def _run(
    container: ContainerClient,
    base: str,
    run_id: str,
    accuracy: float,
    model: bytes,
    root: DataRoot = DIGITS,
) -> None:
    prefix = output_prefix(base, run_id)
    md5 = bytearray(hashlib.md5(model, usedforsecurity=False).digest())
    container.upload_blob(
        f"{prefix}/model.pt", model, content_settings=ContentSettings(content_md5=md5)
    )
    challenger = Challenger(run_id, f"{prefix}/model.pt", "v1", score(accuracy), root)
    challenge(
        container, base, challenger, PromotionConfig(), _no_rescore, f"{prefix}/promotion.json"
    )


@pytest.fixture
def outputs(azurite: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ContainerClient, list[str]]:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"models-{uuid.uuid4().hex[:8]}"
    container = ContainerClient.from_connection_string(azurite, name)
    container.create_container()
    return container, ["--set", f"output.container={name}", "--set", "output.prefix=team"]


def test_list_shows_each_run_its_decision_and_the_champion(
    outputs: tuple[ContainerClient, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    container, where = outputs
    assert main(["--config", str(LOCAL), *where, "list"]) == 0
    assert capsys.readouterr().out.strip() == "no runs yet"
    _run(container, "team", "20261101-020000-aaaaaaaa", 0.91, b"first")
    _run(container, "team", "20261102-020000-bbbbbbbb", 0.95, b"second")
    _run(container, "team", "20261103-020000-cccccccc", 0.93, b"third")
    # A run that stopped before its decision: it has outputs but no promotion record.
    container.upload_blob(f"{output_prefix('team', '20261104-020000-dddddddd')}/log.txt", b"x")

    assert main(["--config", str(LOCAL), *where, "list"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [r.split()[0] for r in rows] == [
        "20261101-020000-aaaaaaaa",
        "20261102-020000-bbbbbbbb",
        "20261103-020000-cccccccc",
        "20261104-020000-dddddddd",
    ]
    assert "0.9100  promoted: no champion of training-data/digits yet" in rows[0]
    assert "<- champion" not in rows[0]
    assert "0.9500  promoted" in rows[1] and rows[1].endswith("<- champion")
    assert "0.9300  not promoted" in rows[2] and "worse" in rows[2]
    assert "-  unfinished: did not reach its promotion decision" in rows[3]


def test_download_gets_the_champion_whole_or_a_named_run(
    outputs: tuple[ContainerClient, list[str]], tmp_path: Path
) -> None:
    container, where = outputs
    assert main(["--config", str(LOCAL), *where, "download", "--to", str(tmp_path)]) == 2
    _run(container, "team", "20261101-020000-aaaaaaaa", 0.91, b"first model")
    _run(container, "team", "20261102-020000-bbbbbbbb", 0.95, b"second model")
    assert main(["--config", str(LOCAL), *where, "download", "--to", str(tmp_path)]) == 0
    assert (tmp_path / "model.pt").read_bytes() == b"second model"
    one = tmp_path / "first.pt"
    run = ["--run", "20261101-020000-aaaaaaaa", "--to", str(one)]
    assert main(["--config", str(LOCAL), *where, "download", *run]) == 0
    assert one.read_bytes() == b"first model"
    score = tmp_path / "promotion.json"
    run += ["--file", "promotion.json"]
    run[run.index(str(one))] = str(score)
    assert main(["--config", str(LOCAL), *where, "download", *run]) == 0
    assert '"promoted": true' in score.read_text()
    escape = ["--run", "20261101-020000-aaaaaaaa", "--file", "../../models/champion.json"]
    assert main(["--config", str(LOCAL), *where, "download", *escape, "--to", str(tmp_path)]) == 2


def test_a_download_that_does_not_match_its_md5_leaves_no_file(
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    container, where = outputs
    _run(container, "team", "20261101-020000-aaaaaaaa", 0.91, b"good model")
    blob = f"{output_prefix('team', '20261101-020000-aaaaaaaa')}/model.pt"
    wrong = bytearray(hashlib.md5(b"other bytes", usedforsecurity=False).digest())
    container.get_blob_client(blob).set_http_headers(ContentSettings(content_md5=wrong))
    target = tmp_path / "model.pt"
    assert main(["--config", str(LOCAL), *where, "download", "--to", str(target)]) == 2
    assert "do not match the stored MD5" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no file, and no temporary one left behind
    missing = ["--run", "20261109-000000-none", "--to", str(target)]
    assert main(["--config", str(LOCAL), *where, "download", *missing]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_two_prefixes_in_one_container_have_their_own_champion_and_last_run(
    outputs: tuple[ContainerClient, list[str]], tmp_path: Path
) -> None:
    """Two pipelines writing one output container under different prefixes: each run is
    judged against its own pipeline's champion, each download gets its own model, and one
    pipeline's last run never makes the other's look up to date."""
    from registry.last_run import LastRun, read_last_run, write_last_run

    container, _ = outputs
    _run(container, "team-a", "20261101-020000-aaaaaaaa", 0.97, b"model of a")
    _run(container, "team-b", "20261101-030000-bbbbbbbb", 0.60, b"model of b")
    decision = json.loads(
        container.download_blob(
            f"{output_prefix('team-b', '20261101-030000-bbbbbbbb')}/promotion.json"
        ).readall()
    )
    assert decision["promoted"] is True and decision["champion_before"] is None
    for team, model in (("team-a", b"model of a"), ("team-b", b"model of b")):
        where = ["--set", f"output.container={container.container_name}"]
        where += ["--set", f"output.prefix={team}"]
        to = tmp_path / f"{team}.pt"
        assert main(["--config", str(LOCAL), *where, "download", "--to", str(to)]) == 0
        assert to.read_bytes() == model
    record = LastRun("r", {"data_version": "v"}, "team-a/runs/r/model.pt", "team-a/runs/r", 0.9, "")
    write_last_run(container, "team-a", DIGITS, record)
    assert read_last_run(container, "team-a", DIGITS) == (record, None)
    assert read_last_run(container, "team-b", DIGITS) == (None, None)
    assert read_last_run(container, "team-a", DataRoot("training-data", "faces")) == (None, None)


def _record(container: ContainerClient, run_id: str, **fields: Any) -> None:
    from registry.run_record import RunRecord, write_run_record

    record = RunRecord(run_id, fields.pop("outcome"), "2026-11-25T02:00:00+00:00", **fields)
    write_run_record(container, output_prefix("team", run_id), record)


def test_list_tells_up_to_date_failed_and_unfinished_runs_apart_and_names_the_data(
    outputs: tuple[ContainerClient, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run's record (run.json) says which data it trained and how it ended; an up-to-date
    run and a failed one used to both read 'unfinished: did not reach its promotion decision'."""
    from core.data_versions import DataVersion

    container, where = outputs
    v1 = DataVersion("training-data", "images", "v1", "0x1", None, "the only complete version")
    flat = DataVersion("training-data", "digits", None, None, None, "a data root without versions")
    _record(
        container,
        "20261101-020000-aaaaaaaa",
        outcome="promoted",
        data=v1.as_record(),
        accuracy=0.91,
        reason="no champion yet: accuracy 0.9100 becomes the first",
    )
    _record(
        container,
        "20261102-020000-bbbbbbbb",
        outcome="up to date",
        data=v1.as_record(),
        reason="data version v1 ... are those of run 20261101-020000-aaaaaaaa",
        matched_run="20261101-020000-aaaaaaaa",
    )
    _record(
        container,
        "20261103-020000-cccccccc",
        outcome="failed",
        data={"container": "training-data", "root": "images", "version": None},
        reason="DataVersionError: data root training-data/images holds both loose files",
        failed_step="validate-data",
    )
    _record(
        container,
        "20261104-020000-dddddddd",
        outcome="running",
        data={"container": "training-data", "root": "images", "version": "v7"},
    )
    _record(
        container,
        "20261105-020000-eeeeeeee",
        outcome="not promoted",
        data=flat.as_record(),
        accuracy=0.5,
        reason="worse, so it does not beat it",
    )
    broken = f"{output_prefix('team', '20261106-020000-ffffffff')}/run.json"
    container.upload_blob(broken, b'{"run_id": "x", "outcome": "won"}')
    _run(container, "team", "20261107-020000-gggggggg", 0.95, b"a run from before run.json")

    assert main(["--config", str(LOCAL), *where, "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "data", "root", "version", "accuracy", "decision"]
    rows = {line.split()[0]: line for line in out[1:]}
    assert rows["20261101-020000-aaaaaaaa"].split()[1:3] == ["training-data/images", "v1"]
    assert "0.9100  promoted: no champion yet" in rows["20261101-020000-aaaaaaaa"]
    assert rows["20261102-020000-bbbbbbbb"].split()[1:5] == [
        "training-data/images",
        "v1",
        "-",
        "up",
    ]
    assert (
        "up to date: nothing trained: the data, code and settings of run "
        "20261101-020000-aaaaaaaa" in (rows["20261102-020000-bbbbbbbb"])
    )
    assert "newest (not chosen)" in rows["20261103-020000-cccccccc"]
    assert (
        "failed at validate-data: DataVersionError: data root" in rows["20261103-020000-cccccccc"]
    )
    assert rows["20261104-020000-dddddddd"].split()[1:3] == ["training-data/images", "v7"]
    assert "unfinished: no outcome recorded" in rows["20261104-020000-dddddddd"]
    assert rows["20261105-020000-eeeeeeee"].split()[1] == "training-data/digits"
    assert "digits (no versions)" in rows["20261105-020000-eeeeeeee"]
    assert "0.5000  not promoted: worse" in rows["20261105-020000-eeeeeeee"]
    assert "run.json is unusable (no run_id, or an outcome" in rows["20261106-020000-ffffffff"]
    # A run from before run records names no data root; it is the config's root's champion.
    assert rows["20261107-020000-gggggggg"].split()[1:3] == ["-", "-"]
    assert "0.9500  promoted" in rows["20261107-020000-gggggggg"]
    assert rows["20261107-020000-gggggggg"].endswith("<- champion")


def test_a_failure_is_recorded_without_secrets() -> None:
    from registry.run_record import error_summary

    exc = RuntimeError(
        "GET https://a.blob.core.windows.net/c/b?sv=2025&sig=c2VjcmV0%3D failed;\n"
        "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=a2V5a2V5;EndpointSuffix=x"
    )
    line = error_summary(exc)
    assert line.startswith("RuntimeError: GET https://a.blob.core.windows.net/c/b?sv=2025&sig=")
    assert "c2VjcmV0" not in line and "a2V5a2V5" not in line and "\n" not in line
    keyed = error_summary(ValueError("AccountKey=a2V5a2V5;AccountName=a " + "x" * 400))
    assert "a2V5a2V5" not in keyed and len(keyed) <= 300


def test_model_onnx_downloads_for_the_champion_and_any_run_checked_against_the_trainer(
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`download --file model.onnx`: the champion's (no --run needed) or a named run's, checked
    against the MD5 the trainer recorded for it in metrics.json (onnx_md5)."""
    import base64

    container, where = outputs
    for run_id, accuracy, data in (
        ("20261101-020000-aaaaaaaa", 0.91, b"first onnx"),
        ("20261102-020000-bbbbbbbb", 0.95, b"second onnx"),
    ):
        _run(container, "team", run_id, accuracy, b"model.pt bytes")
        prefix = output_prefix("team", run_id)
        digest = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        container.upload_blob(f"{prefix}/model.onnx", data)
        container.upload_blob(f"{prefix}/metrics.json", json.dumps({"onnx_md5": digest}))
    download = ["--config", str(LOCAL), *where, "download", "--file", "model.onnx"]
    assert main([*download, "--to", str(tmp_path)]) == 0
    assert (tmp_path / "model.onnx").read_bytes() == b"second onnx"
    assert "the MD5 the trainer recorded)" in capsys.readouterr().out
    first = tmp_path / "first.onnx"
    assert main([*download, "--run", "20261101-020000-aaaaaaaa", "--to", str(first)]) == 0
    assert first.read_bytes() == b"first onnx"
    # A file changed after the trainer wrote it is refused, and nothing is left behind.
    prefix = output_prefix("team", "20261102-020000-bbbbbbbb")
    container.upload_blob(f"{prefix}/model.onnx", b"other onnx", overwrite=True)
    changed = tmp_path / "changed"
    changed.mkdir()
    assert main([*download, "--to", str(changed)]) == 2
    assert "do not match the MD5 the trainer recorded" in capsys.readouterr().err
    assert list(changed.iterdir()) == []
