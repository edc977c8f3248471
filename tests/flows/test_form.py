"""The run form as the Prefect UI receives it: the retrain flow's parameter schema."""

from __future__ import annotations

from typing import Any

from prefect.utilities.callables import parameter_schema

from flows.retrain import retrain


def _schema() -> dict[str, Any]:
    return parameter_schema(retrain).model_dump()


def test_the_help_names_no_config_file_the_deployment_may_not_run() -> None:
    """A deployment may run another config than the shipped one (make service --config): the
    form's help says where a value comes from, not what one file holds."""
    fields = _schema()["properties"]
    for name in ("epochs", "config_path"):
        assert "configs/local.yaml" not in fields[name]["description"], name
    assert "training.epochs" in fields["epochs"]["description"]


def test_the_advanced_section_keeps_each_fields_bounds_and_help() -> None:
    """The form's defaults are the shipped config's, and replacing them keeps what validates
    and describes each field (a bound, a description)."""
    definitions = _schema()["definitions"]
    pool = definitions["PoolConfig"]["properties"]
    assert pool["dedicated_nodes"]["minimum"] == 0
    assert (
        "champion" in definitions["TrainingConfig"]["properties"]["follow_champion"]["description"]
    )
    shipped = definitions["PipelineConfig"]["properties"]["training"]["default"]
    assert shipped["epochs"] == 4  # configs/local.yaml's, not the schema's 5
