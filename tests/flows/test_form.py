"""The run form as the Prefect UI receives it: the retrain flow's parameter schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.utilities.callables import parameter_schema

from flows.retrain import retrain
from tests.conftest import ROOT, child_env


def _schema() -> dict[str, Any]:
    return parameter_schema(retrain).model_dump()


def test_the_help_names_no_config_file_the_deployment_may_not_run() -> None:
    """A deployment may run another config than the shipped one (make service --config): the
    form's help says where a value comes from, not what one file holds."""
    fields = _schema()["properties"]
    for name, field in fields.items():
        description = field.get("description", "")
        assert "configs/local.yaml" not in description, name
        # The advanced section's defaults are the deployment's config file's (make service
        # --config deploys with RETRAIN_FORM_CONFIG), not necessarily the shipped one's.
        assert "shipped config" not in description, name
    assert "deployment was made with" in fields["config"]["description"]
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
    assert shipped["epochs"] is None  # configs/local.yaml leaves it to be fitted to the data


@pytest.mark.processes
def test_a_deployment_of_another_config_gets_its_values_and_no_other_files_name(
    tmp_path: Path,
) -> None:
    """`make service --config` deploys with RETRAIN_FORM_CONFIG naming that config: the form,
    as `prefect deploy` builds it in a process of its own, shows that file's values and names
    neither configs/local.yaml nor a shipped config anywhere."""
    spec = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    spec["data"]["prefix"] = "textures"
    spec["training"]["epochs"] = 7
    other = tmp_path / "textures.yaml"
    other.write_text(yaml.safe_dump(spec))
    script = (
        "import json\n"
        "from prefect.utilities.callables import parameter_schema\n"
        "from flows.retrain import retrain\n"
        "print(json.dumps(parameter_schema(retrain).model_dump()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**child_env(), "RETRAIN_FORM_CONFIG": str(other)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    schema = json.loads(result.stdout.splitlines()[-1])
    text = json.dumps(schema)
    assert "configs/local.yaml" not in text and "shipped config" not in text
    shipped = schema["definitions"]["PipelineConfig"]["properties"]["training"]["default"]
    assert shipped["epochs"] == 7
