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


def test_no_variable_reads_a_resource_at_run_time() -> None:
    """ARM resolves variables before it deploys anything, so ``reference()`` and the ``list*()``
    functions are refused there ("Variables in ARM templates"); the fake refuses them too."""
    import re

    from tests.fakes.arm_template import Scope, TemplateError, evaluate

    templates = [TEMPLATE, TEMPLATE["resources"][-1]["properties"]["template"]]
    for template in templates:
        text = json.dumps(template.get("variables", {}))
        assert not re.search(r"\b(reference|list\w*)\(", text, re.IGNORECASE), text[:200]
    scope = Scope(
        parameters={},
        variables={"keys": "[listKeys('/subscriptions/s/resourceGroups/g/providers/a/b/c', '1')]"},
        subscription_id="s",
        tenant_id="t",
        resource_group="g",
        location="westeurope",
        reference=lambda rid, api: {},
        list_keys=lambda rid: {},
    )
    with pytest.raises(TemplateError, match="'listKeys' is not expected in a variable"):
        evaluate("[variables('keys')]", scope)


def test_every_resource_type_is_checked_against_its_provider_spec_or_named() -> None:
    """The fake ARM endpoint checks each resource body it deploys against its provider's REST
    spec at the template's API version (tests/fakes/spec/arm/); a type without one is named
    with its reason, and each vendored file records where it comes from."""
    from tests.fakes.arm import PROVIDER_SPECS, UNCHECKED

    for resource in RESOURCES:
        kind = resource["type"].lower()
        if kind in ("microsoft.resources/deployments", "microsoft.authorization/roleassignments"):
            continue  # the Resources and Authorization specs (tests/fakes/spec/)
        if kind in PROVIDER_SPECS:
            api, schema, definition = PROVIDER_SPECS[kind]
            assert resource["apiVersion"] == api, kind
            assert definition in schema.definitions
            assert {"repository", "path", "commit"} <= set(schema.source)
        else:
            assert len(UNCHECKED[kind]) > 20, kind
    checked = {k.split("/")[0] for k in PROVIDER_SPECS}
    assert {
        "microsoft.batch",
        "microsoft.keyvault",
        "microsoft.app",
        "microsoft.storage",
        "microsoft.network",
        "microsoft.eventgrid",
        "microsoft.dbforpostgresql",
        "microsoft.containerregistry",
    } <= checked


@pytest.mark.parametrize(
    ("kind", "body", "named"),
    [
        (  # a misspelt property of the scripts mount
            "microsoft.batch/batchaccounts/pools",
            {
                "properties": {
                    "vmSize": "x",
                    "mountConfiguration": [
                        {
                            "azureBlobFileSystemConfiguration": {
                                "accountName": "a",
                                "containerName": "c",
                                "relativeMountPath": "s",
                                "identityRefrence": {},
                            }
                        }
                    ],
                }
            },
            "identityRefrence",
        ),
        (  # an enum value in the wrong case
            "microsoft.batch/batchaccounts",
            {"location": "westeurope", "properties": {"allowedAuthenticationModes": ["aad"]}},
            "allowedAuthenticationModes",
        ),
        (  # a read-only property set by the template
            "microsoft.app/containerapps",
            {"location": "westeurope", "properties": {"configuration": {"ingress": {"fqdn": "x"}}}},
            "fqdn",
        ),
        (  # a required property left out
            "microsoft.keyvault/vaults/secrets",
            {"tags": {}},
            "properties",
        ),
        (  # the NFS share's protocol in the wrong case
            "microsoft.storage/storageaccounts/fileservices/shares",
            {"properties": {"enabledProtocols": "nfs", "shareQuota": 100}},
            "enabledProtocols",
        ),
        (  # a storage account without its kind
            "microsoft.storage/storageaccounts",
            {"location": "westeurope", "sku": {"name": "Standard_LRS"}},
            "kind",
        ),
        (  # a soft-delete retention past the spec's maximum
            "microsoft.storage/storageaccounts/blobservices",
            {"properties": {"deleteRetentionPolicy": {"enabled": True, "days": 400}}},
            "deleteRetentionPolicy.days",
        ),
        (  # an NSG rule without its direction
            "microsoft.network/networksecuritygroups",
            {
                "location": "westeurope",
                "properties": {
                    "securityRules": [
                        {
                            "name": "r",
                            "properties": {"priority": 100, "access": "Allow", "protocol": "*"},
                        }
                    ]
                },
            },
            "direction",
        ),
        (  # a subnet property misspelt
            "microsoft.network/virtualnetworks",
            {
                "location": "westeurope",
                "properties": {"subnets": [{"name": "s", "properties": {"adressPrefix": "x"}}]},
            },
            "adressPrefix",
        ),
        (  # a system topic without its location
            "microsoft.eventgrid/systemtopics",
            {"properties": {"source": "/subscriptions/s", "topicType": "x"}},
            "location",
        ),
        (  # a destination whose endpointType is not one the spec lists
            "microsoft.eventgrid/systemtopics/eventsubscriptions",
            {"properties": {"destination": {"endpointType": "Webhook"}}},
            "endpointType",
        ),
        (  # a webhook property misspelt: checked as the WebHook subtype, not the base
            "microsoft.eventgrid/systemtopics/eventsubscriptions",
            {
                "properties": {
                    "destination": {
                        "endpointType": "WebHook",
                        "properties": {"endpointUrl": "https://x", "maxEventPerBatch": 1},
                    }
                }
            },
            "maxEventPerBatch",
        ),
        (  # a retry policy's attempts as a string
            "microsoft.eventgrid/systemtopics/eventsubscriptions",
            {"properties": {"retryPolicy": {"maxDeliveryAttempts": "30"}}},
            "maxDeliveryAttempts",
        ),
        (  # a server SKU without its tier
            "microsoft.dbforpostgresql/flexibleservers",
            {"location": "westeurope", "sku": {"name": "Standard_B1ms"}},
            "tier",
        ),
        (  # a PostgreSQL major version the API does not offer
            "microsoft.dbforpostgresql/flexibleservers",
            {"location": "westeurope", "properties": {"version": "17"}},
            "version",
        ),
        (  # a read-only property sent
            "microsoft.dbforpostgresql/flexibleservers",
            {"location": "westeurope", "properties": {"fullyQualifiedDomainName": "x"}},
            "read-only",
        ),
        (  # a database collation outside the spec's pattern
            "microsoft.dbforpostgresql/flexibleservers/databases",
            {"properties": {"charset": "UTF8", "collation": "en_US;drop"}},
            "collation",
        ),
        (  # a registry without its SKU
            "microsoft.containerregistry/registries",
            {"location": "westeurope", "properties": {"adminUserEnabled": False}},
            "sku",
        ),
        (  # a SKU name in the wrong case
            "microsoft.containerregistry/registries",
            {"location": "westeurope", "sku": {"name": "standard"}},
            "sku.name",
        ),
        (  # the read-only login server sent
            "microsoft.containerregistry/registries",
            {
                "location": "westeurope",
                "sku": {"name": "Standard"},
                "properties": {"loginServer": "x.azurecr.io"},
            },
            "read-only",
        ),
        (  # a workload profile without its type
            "microsoft.app/managedenvironments",
            {"location": "westeurope", "properties": {"workloadProfiles": [{"name": "c"}]}},
            "workloadProfileType",
        ),
        (  # the subnet id under a misspelt name
            "microsoft.app/managedenvironments",
            {
                "location": "westeurope",
                "properties": {"vnetConfiguration": {"infrastructureSubnetID": "x"}},
            },
            "infrastructureSubnetID",
        ),
        (  # a DNS zone property the zone only reports
            "microsoft.network/privatednszones",
            {"location": "global", "properties": {"numberOfRecordSets": 1}},
            "read-only",
        ),
        (  # auto-registration as a string
            "microsoft.network/privatednszones/virtualnetworklinks",
            {
                "location": "global",
                "properties": {"registrationEnabled": "false", "virtualNetwork": {"id": "x"}},
            },
            "registrationEnabled",
        ),
        (  # a private link connection's target misspelt
            "microsoft.network/privateendpoints",
            {
                "location": "westeurope",
                "properties": {
                    "subnet": {"id": "x"},
                    "privateLinkServiceConnections": [
                        {"name": "file", "properties": {"privateLinkServiceID": "x"}}
                    ],
                },
            },
            "privateLinkServiceID",
        ),
        (  # the network interfaces the endpoint only reports
            "microsoft.network/privateendpoints",
            {"location": "westeurope", "properties": {"networkInterfaces": []}},
            "read-only",
        ),
        (  # a DNS zone config's zone id at the wrong level
            "microsoft.network/privateendpoints/privatednszonegroups",
            {"properties": {"privateDnsZoneConfigs": [{"name": "file", "privateDnsZoneId": "x"}]}},
            "privateDnsZoneId",
        ),
    ],
)
def test_a_body_outside_the_provider_spec_is_refused(
    kind: str, body: dict[str, Any], named: str
) -> None:
    from tests.fakes.arm import PROVIDER_SPECS

    _, schema, definition = PROVIDER_SPECS[kind]
    problems = schema.check(body, definition)
    assert problems and named in str(problems[0]), problems
