"""infra/main.json, the file `make azure-up` deploys, against Azure's published ARM resource
schemas (infra/schemas/), as written and as the fake ARM endpoint evaluates it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.infra.arm_schemas import problems

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = json.loads((ROOT / "infra" / "main.json").read_text())


def _resources(template: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for resource in template["resources"]:
        found.append(resource)
        props = resource.get("properties")
        if isinstance(props, dict) and "$schema" in (props.get("template") or {}):
            found += _resources(props["template"])
    return found


RESOURCES = _resources(TEMPLATE)


@pytest.mark.parametrize(
    "resource",
    RESOURCES,
    ids=[f"{i}-{r['type'].split('/', 1)[1]}" for i, r in enumerate(RESOURCES)],
)
def test_every_resource_as_written_fits_its_schema(resource: dict[str, Any]) -> None:
    assert problems(resource) == []


def test_every_resource_as_deployed_fits_its_schema(tmp_path: Path) -> None:
    """The values ARM computes (names, ids, the pool from backends/azure, the config) checked
    too: the template's expressions hide them from the check above."""
    from tests.fakes.arm import FakeArm
    from tests.infra.test_azure_up import SUB, _run

    arm = FakeArm(SUB)
    arm.providers_regions["Microsoft.App/managedEnvironments"] = ["West Europe"]
    assert _run(arm, tmp_path, "up")[0] == 0
    api = {r["type"].lower(): r["apiVersion"] for r in RESOURCES}
    seen = set()
    for stored in arm.resources.values():
        kind = stored["type"]
        if kind == "Microsoft.Resources/deployments":
            continue
        body = {k: v for k, v in stored.items() if not k.startswith("_") and k != "id"}
        body["apiVersion"] = api[kind.lower()]
        # A child declared at the top level is named "parent/child"; some schemas check the
        # whole name, others the child's own: one of the two must pass.
        path = stored["id"].rsplit("/providers/", 1)[-1]
        segments = path.split("/")[2::2] if "/providers/" in stored["id"] else [stored["name"]]
        found = [problems({**body, "name": name}) for name in ("/".join(segments), segments[-1])]
        assert [] in found, (stored["id"], found)
        seen.add(kind)
    declared = {r["type"] for r in RESOURCES if r["type"] != "Microsoft.Resources/deployments"}
    # Deployed with no service image yet: the event subscription waits for the relay's image.
    assert declared - seen == {"Microsoft.EventGrid/systemTopics/eventSubscriptions"}


def test_a_misspelt_property_is_caught() -> None:
    """The check can fail: a typo the generated schemas alone would let through."""
    pool = next(r for r in RESOURCES if r["type"] == "Microsoft.Batch/batchAccounts")
    broken = json.loads(json.dumps(pool))
    broken["properties"]["poolAlocationMode"] = "UserSubscription"
    assert any("poolAlocationMode" in p for p in problems(broken))
    broken = json.loads(json.dumps(pool))
    broken["properties"]["poolAllocationMode"] = "UserSubscriptions"
    assert any("poolAllocationMode" in p for p in problems(broken))
