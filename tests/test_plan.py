"""``--plan``: the request bodies of an Azure run, printed without calling anything, and the
Azure config rules that fail at load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flows.config import ConfigError, load_config
from tests.azure_helpers import ROOT

EXAMPLE = ROOT / "configs" / "azure.example.yaml"


def _plan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.retrain", "--plan", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        check=False,
    )


def test_plan_covers_every_batch_request_with_wire_names() -> None:
    proc = _plan("--config", str(EXAMPLE), "--set", "pool.vm_size=Standard_ND96asr_v4")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    steps = [(r["step"], r["method"], r["path"]) for r in plan["requests"]]
    assert steps[0] == ("ensure-pool", "POST", "/pools")
    assert steps[1] == ("ensure-pool", "POST", "/pools/retrain-gpu/resize")
    assert [s[0] for s in steps[2:8]] == ["stage", "stage", "train", "train", "score", "score"]
    assert steps[-1] == ("release-pool", "POST", "/pools/retrain-gpu/resize")
    pool = plan["requests"][0]["body"]
    assert pool["enableInterNodeCommunication"] is True and pool["taskSlotsPerNode"] == 1
    assert pool["virtualMachineConfiguration"]["containerConfiguration"]["type"] == (
        "dockerCompatible"
    )
    train = plan["requests"][5]["body"]
    assert train["multiInstanceSettings"]["numberOfInstances"] == 2
    assert train["constraints"]["maxTaskRetryCount"] == 2
    assert {o["filePattern"] for o in train["outputFiles"]} == {"outputs/**/*", "../std*.txt"}
    env = {e["name"]: e["value"] for e in train["environmentSettings"]}
    assert env["NCCL_IB_DISABLE"] == "0"  # ND96asr_v4 has InfiniBand
    assert "--device=/dev/infiniband" in train["containerSettings"]["containerRunOptions"]
    assert plan["resources"]["pool"]["infiniband"] is True
    assert plan["requests"][-1]["body"] == {
        "targetDedicatedNodes": 0,
        "targetLowPriorityNodes": 0,
        "nodeDeallocationOption": "requeue",
    }


def test_plan_holds_no_secret_and_says_where_each_comes_from() -> None:
    fake_key = "QUNDT1VOVC1LRVktVkFMVUUtRk9SLVRFU1Q="
    proc = _plan(
        "--config",
        str(EXAMPLE),
        "--set",
        "data.connection_string_env=RETRAIN_TEST_CONN",
        env={"RETRAIN_TEST_CONN": f"DefaultEndpointsProtocol=https;AccountKey={fake_key}"},
    )
    assert proc.returncode == 0, proc.stderr
    assert fake_key not in proc.stdout and "sig=" not in proc.stdout
    plan = json.loads(proc.stdout)
    pool = plan["requests"][0]["body"]
    share = pool["mountConfiguration"][1]["azureFileShareConfiguration"]
    assert share["accountKey"] == "<secret from Prefect Secret block 'retrain-files-key'>"
    stage = plan["requests"][3]["body"]
    env = {e["name"]: e["value"] for e in stage["environmentSettings"]}
    assert env["RETRAIN_DATA_URL"].endswith("?<SAS read,list; expires after 12 h>")


def test_plan_refuses_the_local_target() -> None:
    proc = _plan("--config", str(ROOT / "configs" / "local.yaml"))
    assert proc.returncode == 2 and "target local" in proc.stderr


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("azure.batch_account_url=null", "azure.batch_account_url"),
        ("nfs.source=null", "nfs.source"),
        ("share.account_key_secret=null", "share.account_key_secret"),
        ("image.registry=null", "image.registry"),
        ("azure.resource_group=null", "azure.resource_group"),
        ("image.registry_password_secret=null", "image.registry_password_secret"),
        ("pool.infiniband=maybe", "pool.infiniband"),
        ("azure.sas_hours=500", "azure.sas_hours"),
    ],
)
def test_incomplete_azure_config_fails_at_load_naming_the_field(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [override])
    assert named in str(err.value)
