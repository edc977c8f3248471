"""PipelineConfig: YAML + overrides, and errors that name the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, PipelineConfig, load_config
from core.run_config import RunRequest, build_run_config
from registry.promotion import decide
from tests.conftest import ROOT, child_env

LOCAL = ROOT / "configs" / "local.yaml"


def test_shipped_configs_load() -> None:
    local = load_config(LOCAL)
    assert local.target == "local" and local.pool.processes_per_node == 2
    azure = load_config(ROOT / "configs" / "azure.example.yaml")
    assert azure.target == "azure" and azure.pool.nodes == 2
    assert azure.data.connection_string_env is None  # identity, not a key, by default


def test_overrides_are_typed() -> None:
    cfg = load_config(
        LOCAL,
        [
            "training.epochs=7",
            "training.lr=0.2",
            "training.timeline=false",
            "training.extra_args=[--fp16-allreduce]",
        ],
    )
    assert cfg.training.epochs == 7 and cfg.training.lr == 0.2 and cfg.training.timeline is False
    assert cfg.training.extra_args == ["--fp16-allreduce"]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("training.epochs=0", "training.epochs"),
        ("training.model=vgg", "training.model"),
        ("pool.processes_per_node=-1", "pool.processes_per_node"),
        ("pool.dedicated_nodes=0", "pool"),
        ("data.container=Bad_Name", "data.container"),
        ("data.prefix=a/../b", "data.prefix"),
        ("target=gcp", "target"),
        ("training.typo=1", "training.typo"),
        ("promotion.min_improvement=-0.1", "promotion.min_improvement"),
    ],
)
def test_invalid_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"(?m)^  {field}[:.]"):
        load_config(LOCAL, [override])


def test_file_problems_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("data: [unclosed")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match=r"expected section\.field=value"):
        load_config(LOCAL, ["training.epochs"])


def test_flow_accepts_a_model_or_a_path() -> None:
    cfg = load_config(LOCAL)
    assert build_run_config(RunRequest(config=cfg)).config is cfg
    from_path = build_run_config(
        RunRequest(config_path=str(LOCAL), overrides=("training.epochs=2",))
    ).config
    assert isinstance(from_path, PipelineConfig) and from_path.training.epochs == 2
    from_dict = build_run_config(
        RunRequest(config=cfg.model_dump(mode="json"), overrides=("pool.processes_per_node=1",))
    ).config
    assert from_dict.pool.processes_per_node == 1
    with pytest.raises(ConfigError, match="needs a config"):
        build_run_config(RunRequest())


@pytest.mark.processes
def test_cli_says_storage_does_not_answer_before_starting_anything(tmp_path: Path) -> None:
    """Azurite not running: a short error per location, no key in it, and no temporary Prefect
    server started (it took 20 s, then printed a 31-line failure)."""
    key = "c2VjcmV0LWtleS1mb3ItdGVzdHM="
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};"
        "BlobEndpoint=http://127.0.0.1:1/devstoreaccount1;"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flows.retrain", "--config", str(LOCAL)],
        cwd=ROOT,
        env={**child_env(), "AZURE_STORAGE_CONNECTION_STRING": conn},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"error: {field}: Blob storage at http://127.0.0.1:1/devstoreaccount1/{container} does not "
        "answer (ServiceRequestError); on the local target, start Azurite first (`make demo` "
        "starts its own)"
        for field, container in (("data", "training-data"), ("output", "retrain-outputs"))
    ]
    assert key not in proc.stdout + proc.stderr
    assert "temporary server" not in (proc.stdout + proc.stderr).lower()


@pytest.mark.processes
def test_cli_rejects_bad_config_with_the_field() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.retrain",
            "--config",
            str(LOCAL),
            "--set",
            "training.batch_size=0",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "training.batch_size" in proc.stderr


@pytest.mark.parametrize(
    ("challenger", "champion", "margin", "promoted"),
    [
        (0.90, None, 0.0, True),
        (0.91, 0.90, 0.0, True),
        (0.90, 0.90, 0.0, False),
        (0.85, 0.90, 0.0, False),
        (0.905, 0.90, 0.01, False),
        (0.92, 0.90, 0.01, True),
    ],
)
def test_promotion_decision(
    challenger: float, champion: float | None, margin: float, promoted: bool
) -> None:
    assert decide(challenger, champion, margin)[0] is promoted


def test_an_unknown_field_suggests_the_closest_one(tmp_path: Path) -> None:
    text = LOCAL.read_text().replace("training:\n", "training:\n  epoch: 4\n", 1)
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "typo.yaml")
    assert "training.epoch: Extra inputs are not permitted; did you mean training.epochs?" in str(
        err.value
    )
    assert str(err.value).startswith(f"invalid config {tmp_path / 'typo.yaml'}:")
    with pytest.raises(ConfigError, match=r"trainig: .*did you mean training\?"):
        load_config(LOCAL, ["trainig.epochs=3"])


def test_a_bad_set_is_blamed_on_the_set_not_the_file() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(LOCAL, ["training.epochs=abc"])
    first, detail = str(err.value).split("\n")
    assert first == f"invalid --set for {LOCAL} (the file itself is not at fault):"
    assert detail.startswith("  training.epochs: ")
    assert detail.endswith("(from --set training.epochs=abc)")


def test_show_config_prints_the_effective_config(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from flows.retrain import main

    assert main(["--config", str(LOCAL), "--set", "training.epochs=2", "--show-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_config(LOCAL, ["training.epochs=2"]).model_dump(mode="json")
    assert shown["training"]["epochs"] == 2


def test_promotion_reasons_read_as_a_person_would_write_them() -> None:
    assert (
        decide(0.95, 0.93, 0.0)[1]
        == "accuracy 0.9500 against the champion's 0.9300: better by 0.0200"
    )
    assert decide(0.91, 0.93, 0.0)[1].endswith("worse, so it does not beat it")
    assert decide(0.931, 0.93, 0.002)[1].endswith(
        "better by only 0.0010, not more than the 0.002 required"
    )
    for case in [(0.95, 0.93, 0.0), (0.93, 0.93, 0.0), (0.91, 0.93, 0.0)]:
        assert "0.0000" not in decide(*case)[1]


def test_a_run_config_is_frozen_and_says_where_its_values_came_from() -> None:
    """Every step reads the config the run was started with: a section cannot be changed in
    place, only copied with a new value."""
    from pydantic import ValidationError

    built = build_run_config(
        RunRequest(config_path=str(LOCAL), overrides=("training.lr=0.01",), data_version="v2")
    )
    with pytest.raises(ValidationError, match="frozen"):
        built.config.data.prefix = "elsewhere"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        built.config.output = built.config.output  # type: ignore[misc]
    assert built.config.data.pinned("v3").version == "v3" and built.config.data.version == "v2"
    assert built.source.endswith("--set training.lr=0.01; data.version=v2")
