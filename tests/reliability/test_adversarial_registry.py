"""Stored records that crashed the registry instead of being named, and `models list` and
`download` under hostile records and arguments.

Records are text anyone with write access to the output container may have edited: an empty
champion record, an accuracy written as a 400-digit integer, a model named "", a promotion
record of megabytes or with terminal escapes in it. Each is a damaged record, named; nothing
crashes, prints raw escapes or reads a whole oversized blob. A model downloaded is checked
whatever its size."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from cli.models import main
from core.data_versions import DataRoot
from core.run import output_prefix
from registry.champion import champion_for
from registry.last_run import read_last_run
from registry.layout import LAST_RUN, champion_blob, last_run_blob
from registry.store import list_runs
from tests.conftest import ROOT, run_trainer
from tests.reliability import report

LOCAL = ROOT / "configs" / "local.yaml"
HUGE = "1" + "0" * 400  # 1e400 written as an integer: JSON has no bound on them
RUN = "20261101-020000-aaaaaaaa"
DIGITS = DataRoot("training-data", "digits")  # configs/local.yaml's data root


@pytest.fixture
def outputs(azurite: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ContainerClient, list[str]]:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"registry-{uuid.uuid4().hex[:8]}"
    container = ContainerClient.from_connection_string(azurite, name)
    container.create_container()
    return container, ["--config", str(LOCAL), "--set", f"output.container={name}"]


def _record(run_id: str, **fields: Any) -> bytes:
    return json.dumps({"run_id": run_id, "promoted": True, "reason": "better", **fields}).encode()


# ---------------------------------------------------------------- damaged champion records

CHAMPIONS = {
    "empty (0 bytes)": (b"", "empty (0 bytes)"),
    "accuracy 1e400 written as an integer": (
        f'{{"run_id": "r", "accuracy": {HUGE}, "model": "runs/r/model.pt"}}'.encode(),
        "accuracy is an integer of about 401 digits, not a finite number in [0, 1]",
    ),
    "a model name with a terminal escape": (
        b'{"run_id": "r", "accuracy": 0.5, "model": "runs/r/\\u001b[2Jmodel.pt"}',
        "model is 'runs/r/\\x1b[2Jmodel.pt', not a model blob name",
    ),
}


@pytest.mark.parametrize("case", list(CHAMPIONS))
def test_a_damaged_champion_record_is_named_by_list_and_download(
    case: str,
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: an empty models/champion.json (a ranged read of it answers 416) crashed list and
    download with HttpResponseError; an accuracy of 1e400 as an integer with OverflowError."""
    container, where = outputs
    raw, why = CHAMPIONS[case]
    container.upload_blob(f"{output_prefix('', RUN)}/promotion.json", _record(RUN, accuracy=0.9))
    container.upload_blob(champion_blob("", DIGITS), raw)
    read = champion_for(container, "", DIGITS)
    assert (read.state, read.damaged, read.raw) == ("damaged", why, raw)
    assert read.etag  # a promotion replaces it under this ETag, keeping its bytes first

    assert main([*where, "list"]) == 0
    listed = capsys.readouterr().out
    assert RUN in listed and "<- champion" not in listed
    assert main([*where, "download", "--to", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"the champion record of data root training-data/digits ({read.blob}) is damaged" in err
    assert f"is damaged ({why})" in err and "Traceback" not in err
    report.record(
        "adversarial",
        f"models list / download: champion.json is {case}",
        f"list shows the runs; download exits 2: damaged ({why})",
    )


# ---------------------------------------------------------------- damaged last-run records

LAST_RUNS = {
    "accuracy 1e400 written as an integer": (
        {"accuracy": HUGE},
        "accuracy is an integer of about 401 digits, not a finite number in [0, 1]",
    ),
    'model ""': ({"model": ""}, "model is '', not a model blob name"),
    "empty (0 bytes)": (None, "empty"),
}


@pytest.mark.parametrize("case", list(LAST_RUNS))
def test_a_damaged_last_run_record_makes_the_run_train_and_say_why(
    case: str, prefect_api: None, azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: last-run.json with accuracy 1e400 (an integer) or model "" failed every run's
    up-to-date check (OverflowError formatting the accuracy; a blob client for ""). The check
    itself, as the flow runs it, now trains and names the damage."""
    from prefect import flow

    from backends.blob import container_client
    from core.data_versions import DataVersion
    from tasks.up_to_date import check_up_to_date, fingerprint
    from tasks.validate import Validated
    from tests.pipeline_helpers import make_config

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    outputs = container_client(config.output, create=True)
    fields, why = LAST_RUNS[case]
    # The record of a run that trained exactly this run's inputs, whose model exists: the run
    # would be up to date, and its summary would name that run and its accuracy.
    outputs.upload_blob(f"{output_prefix('', RUN)}/model.pt", b"weights")
    record = {
        "run_id": RUN,
        "fingerprint": fingerprint(config, "abc"),
        "model": f"{output_prefix('', RUN)}/model.pt",
        "outputs": output_prefix("", RUN),
        "accuracy": 0.9,
        "finished_at": "2026-11-01T02:00:00+00:00",
        **(fields or {}),
    }
    # The integer as digits in the JSON text (json.dumps of a str would quote it).
    body = json.dumps(record).replace(f'"{HUGE}"', HUGE).encode() if fields is not None else b""
    outputs.upload_blob(last_run_blob("", config.data.root), body)
    container = config.data.container
    version = DataVersion(container, "digits", "v1", "0x1", None, "named by the run")

    @flow
    def check() -> Any:
        return check_up_to_date(config, Validated(version, "abc"), False).value

    result = check()
    assert result.fresh is False and f"{LAST_RUN} is unusable ({why})" in result.why
    assert read_last_run(outputs, "", config.data.root)[0] is None
    report.record(
        "adversarial",
        f"up-to-date check: last-run.json is {case}",
        f"the run trains; its check says the record is unusable ({why})",
    )


# ---------------------------------------------------------------- models list


def test_list_reads_no_more_of_a_promotion_record_than_a_record_holds(
    outputs: tuple[ContainerClient, list[str]], azurite: str
) -> None:
    """Before: list downloaded a whole promotion.json, then checked its size (a 400 MB one
    took the command to 517 MB of memory). The bytes the client receives are counted."""
    container, _ = outputs
    received: list[int] = []

    def count(pipeline: Any) -> None:
        response = pipeline.http_response
        if response.request.method == "GET" and "promotion.json" in response.request.url:
            received.append(int(response.headers.get("Content-Length") or 0))

    huge = b'{"reason": "' + b"x" * (16 << 20) + b'"}'
    container.upload_blob(f"{output_prefix('', RUN)}/promotion.json", huge)
    watched = ContainerClient.from_connection_string(
        azurite, container.container_name, raw_response_hook=count
    )
    (entry,) = list_runs(watched, "", [DIGITS])
    assert "is unusable (larger than 1048576 bytes)" in entry.reason
    assert 0 < sum(received) <= (1 << 20) + 1, received
    report.record(
        "adversarial",
        "models list: a 16 MB promotion.json",
        "named unusable; at most 1 MB + 1 byte of it read",
        bytes_read=sum(received),
    )


def test_list_prints_no_terminal_escapes_from_a_record(
    outputs: tuple[ContainerClient, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A reason with escape sequences, a carriage return and a newline forged a line of the
    table (another run shown as the champion) on a terminal."""
    container, where = outputs
    forged = "worse\x1b[2K\r20991231-000000-ffffffff  1.0000  promoted <- champion\n\x1b]0;x\x07"
    body = _record(RUN, accuracy=0.5, promoted=False, reason=forged)
    container.upload_blob(f"{output_prefix('', RUN)}/promotion.json", body)
    assert main([*where, "list"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\r\x07"), repr(out)
    rows = out.strip().splitlines()
    assert len(rows) == 2 and rows[1].startswith(RUN) and "\\x1b[2K\\r" in rows[1]
    report.record(
        "adversarial",
        "models list: a promotion.json reason with terminal escapes and a newline",
        "printed escaped, on its own row",
    )


# ---------------------------------------------------------------- download


def test_download_refuses_a_run_that_is_not_a_run_id(
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: --run .. ended in a traceback."""
    _, where = outputs
    for run in ("..", ".", "a/b", "x\x1b[2J"):
        assert main([*where, "download", "--run", run, "--to", str(tmp_path)]) == 2, run
        err = capsys.readouterr().err
        assert "is not a run id" in err and "Traceback" not in err and "\x1b" not in err
    assert list(tmp_path.iterdir()) == []
    report.record("adversarial", "models download --run .. (and ., a/b)", "exit 2: not a run id")


def test_download_to_a_new_folder_with_a_slash_writes_into_it(
    outputs: tuple[ContainerClient, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: --to new/dir/ wrote a file named dir."""
    container, where = outputs
    container.upload_blob(f"{output_prefix('', RUN)}/model.pt", b"weights")
    to = tmp_path / "new" / "dir"
    assert main([*where, "download", "--run", RUN, "--to", f"{to}/"]) == 0
    assert (to / "model.pt").read_bytes() == b"weights"
    assert f"-> {to / 'model.pt'}" in capsys.readouterr().out
    report.record("adversarial", "models download --to new/dir/", "new/dir/model.pt written")


@pytest.mark.processes
def test_a_model_uploaded_in_blocks_is_checked_against_the_trainers_md5(
    outputs: tuple[ContainerClient, list[str]],
    azurite: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Blob storage stores no MD5 for a blob uploaded in blocks (over 64 MB with the SDK's
    defaults, always with Batch's output files): before, such a model downloaded unchecked,
    whatever its bytes. The trainer records the model's MD5 in metrics.json (itself small
    enough for the service's own MD5), and download checks the model against it."""
    container, where = outputs
    out = tmp_path / "out"
    result = run_trainer(1, "synthetic:96", out, "--epochs", "1", "--batch-size", "16")
    assert result.returncode == 0, result.output[-3000:]
    model = (out / "model.pt").read_bytes()
    expected = base64.b64encode(hashlib.md5(model, usedforsecurity=False).digest()).decode()
    assert result.metrics["model_md5"] == expected

    # Uploaded as a large model is: in blocks, so the service stores no MD5 for it.
    blocks = ContainerClient.from_connection_string(
        azurite, container.container_name, max_single_put_size=4096, max_block_size=4096
    )
    prefix = output_prefix("", RUN)
    blocks.upload_blob(f"{prefix}/model.pt", model)
    container.upload_blob(f"{prefix}/metrics.json", (out / "metrics.json").read_bytes())
    stored = container.get_blob_client(f"{prefix}/model.pt").get_blob_properties()
    assert not stored.content_settings.content_md5  # what made the download check nothing

    good = tmp_path / "good.pt"
    assert main([*where, "download", "--run", RUN, "--to", str(good)]) == 0
    assert good.read_bytes() == model
    assert "checked against the MD5 the trainer recorded" in capsys.readouterr().out

    damaged = bytearray(model)
    damaged[len(damaged) // 2] ^= 0xFF
    blocks.upload_blob(f"{prefix}/model.pt", bytes(damaged), overwrite=True)
    bad = tmp_path / "bad.pt"
    assert main([*where, "download", "--run", RUN, "--to", str(bad)]) == 2
    assert "do not match the MD5 the trainer recorded" in capsys.readouterr().err
    assert not bad.exists() and [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    report.record(
        "adversarial",
        "models download: a model stored in blocks (no service MD5), then a byte changed",
        "checked against the trainer's MD5 in metrics.json: the intact one downloads, the "
        "changed one exits 2 and leaves no file",
    )
