"""``--plan``: the request bodies of an Azure run, printed without calling anything, and the
Azure config rules that fail at load."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from core.config import ConfigError, load_config
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


@pytest.mark.processes
def test_plan_covers_every_batch_request_with_wire_names() -> None:
    proc = _plan("--config", str(EXAMPLE), "--set", "pool.vm_size=Standard_ND96asr_v4")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    steps = [(r["step"], r["method"], r["path"]) for r in plan["requests"]]
    assert steps[0] == ("ensure-pool", "POST", "/pools")
    assert steps[1] == ("ensure-pool", "POST", "/pools/retrain-gpu/resize")
    assert [s[0] for s in steps[2:11]] == ["stage"] * 3 + ["train"] * 3 + ["score"] * 3
    # Each job is created with noaction and told to end with its task once the task exists.
    assert [s[1] for s in steps[2:5]] == ["POST", "POST", "PATCH"]
    assert plan["requests"][2]["body"]["onAllTasksComplete"] == "noaction"
    assert plan["requests"][4]["body"] == {"onAllTasksComplete": "terminatejob"}
    assert steps[-1] == ("release-pool", "POST", "/pools/retrain-gpu/resize")
    pool = plan["requests"][0]["body"]
    assert pool["enableInterNodeCommunication"] is True and pool["taskSlotsPerNode"] == 1
    assert pool["virtualMachineConfiguration"]["containerConfiguration"]["type"] == (
        "dockerCompatible"
    )
    train = plan["requests"][6]["body"]
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


@pytest.mark.processes
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
    # Staging: 4 attempts x 4 h + the 30-minute start timeout (+ 5 minutes of clock skew).
    assert env["RETRAIN_DATA_URL"].endswith("?<SAS read,list; expires 16.6 h after submission>")


@pytest.mark.processes
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
        # The scripts on Blob are mounted as the nodes' identity: none given, none to use.
        ("share.account_url=https://acct.blob.core.windows.net", "azure.identity_resource_id"),
        ("azure.sas_hours=500", "azure.sas_hours"),
    ],
)
def test_incomplete_azure_config_fails_at_load_naming_the_field(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [override])
    assert named in str(err.value)


# Placeholders the plan prints where a run has values: made concrete so ids and URLs can be
# checked like the ones a run sends.
_CONCRETE = [
    (re.compile(r"\{run_id\}"), "20261122-000000-0a1b2c3d"),
    (re.compile(r"\{training_key\}"), "0123456789abcdef"),
    (re.compile(r"<SAS [^>]*>"), "sv=2025-01-05&sp=rl&sig=REDACTED"),
    (re.compile(r"<secret [^>]*>"), "c2VjcmV0LXZhbHVl"),
    (re.compile(r"<([a-z-]+)>"), r"\1"),  # the example's own <storage-account> names
]


def _concrete(value: Any) -> Any:
    if isinstance(value, str):
        for pattern, replacement in _CONCRETE:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, dict):
        return {k: _concrete(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_concrete(v) for v in value]
    return value


IDENTITY = (
    "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/g/providers/"
    "Microsoft.ManagedIdentity/userAssignedIdentities/retrain"
)


@pytest.mark.parametrize(
    "overrides",
    [
        ["pool.vm_size=Standard_ND96isr_H100_v5", "pool.dedicated_nodes=4"],
        ["pool.autoscale_formula=$TargetDedicatedNodes = 2;", "pool.release=delete"],
        ["pool.dedicated_nodes=0", "pool.low_priority_nodes=3", "pool.os_disk_gb=256"],
        [
            f"azure.identity_resource_id={IDENTITY}",
            "azure.identity_client_id=11111111-2222-3333-4444-555555555555",
            "image.registry_username=null",
            "image.registry_password_secret=null",
        ],
        ["pool.dedicated_nodes=8", "pool.vm_size=Standard_NC24ads_A100_v4", "pool.subnet_id=null"],
        [  # the scripts in a Blob container the nodes mount as their identity: no key at all
            f"azure.identity_resource_id={IDENTITY}",
            "azure.identity_client_id=11111111-2222-3333-4444-555555555555",
            "image.registry_username=null",
            "image.registry_password_secret=null",
            "share.account_url=https://acct.blob.core.windows.net",
            "share.account_key_secret=null",
        ],
    ],
    ids=["infiniband", "autoscale", "spot", "identity", "several-nodes", "blob-scripts"],
)
def test_plan_bodies_pass_the_batch_spec(overrides: list[str]) -> None:
    """Every body --plan prints is what the service accepts (the fake's own validator)."""
    from backends.azure.plan import build_plan
    from tests.fakes.batch import SPEC, body_definition

    plan = build_plan(load_config(EXAMPLE, overrides), ROOT)
    checked = 0
    for request in plan["requests"]:
        body = request.get("body", request.get("pool_settings"))
        if body is None:
            continue
        path = _concrete(request.get("path", "/pools"))
        definition = body_definition(request.get("method", "POST"), path)
        problems = SPEC.check(_concrete(body), definition)
        assert problems == [], f"{request['step']} {path}: {[str(p) for p in problems]}"
        checked += 1
    assert checked >= 11  # pool, resize, 3 x (job, task, job update), release
    if "share.account_key_secret=null" in overrides:
        pool = plan["requests"][0]["pool_settings"]
        assert "accountKey" not in json.dumps(pool) and "secret" not in json.dumps(pool)
        (mount,) = [
            m for m in pool["mountConfiguration"] if "azureBlobFileSystemConfiguration" in m
        ]
        blob = mount["azureBlobFileSystemConfiguration"]
        assert blob["identityReference"] == {"resourceId": IDENTITY}
        assert (blob["accountName"], blob["containerName"]) == ("acct", "retrain-scripts")


def test_a_task_that_could_outlive_the_token_cap_is_refused_before_submission() -> None:
    from backends.azure.access import AccessError, AccessIssuer
    from backends.taskspec import training_task

    config = load_config(EXAMPLE, ["azure.sas_hours=12"])  # training: 3 x 6 h + 30 min
    spec = training_task(config, "train-r", "k", "runs/r")
    with pytest.raises(AccessError, match=r"azure\.sas_hours=12"):
        AccessIssuer(config).lifetime(spec)
    assert AccessIssuer(load_config(EXAMPLE)).lifetime(spec).total_seconds() / 3600 > 18.5


def test_the_example_sizes_the_os_disk_for_the_image_and_the_plan_sends_it() -> None:
    """Docker keeps the pulled image on the OS disk: the example asks for a disk sized for it,
    and the pool body carries it as the spec names it (the fake's validator checks the type)."""
    from backends.azure.plan import build_plan
    from tests.fakes.batch import SPEC, body_definition

    plan = build_plan(load_config(EXAMPLE), ROOT)
    body = plan["requests"][0]["body"]
    assert body["virtualMachineConfiguration"]["osDisk"] == {"diskSizeGB": 128}
    assert SPEC.check(body, body_definition("POST", "/pools")) == []
    assert plan["resources"]["pool"]["os_disk_gb"] == 128


def test_the_example_nfs_server_sits_in_the_subnet_the_docs_give_it() -> None:
    """docs/azure.md creates a batch subnet for the nodes and an nfs subnet for the server;
    the example's nfs.source must be an address of the latter (the nodes reach it across
    subnets), and the docs' example address the same one."""
    import ipaddress

    docs = (ROOT / "docs" / "azure.md").read_text()
    batch = re.search(r"--subnet-name batch --subnet-prefixes (\S+)", docs)
    nfs = re.search(r"-n nfs \\\s*--address-prefixes (\S+)", docs)
    assert batch and nfs, "docs/azure.md no longer creates the batch and nfs subnets"
    source = str(load_config(EXAMPLE).nfs.source)
    host = ipaddress.ip_address(source.split(":", 1)[0])
    assert host in ipaddress.ip_network(nfs.group(1))
    assert host not in ipaddress.ip_network(batch.group(1))
    assert f"`{source}`" in docs
