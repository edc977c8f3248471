"""``python -m cli.prices refresh``: the user's command against a fake of the Retail Prices API
that pages and filters as the documented one does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

from cli.prices import API, RefreshError, odata_filter, refresh
from core.pricing import TABLE, load_table, lookup, table_source
from tests.fakes.retail_prices import FakeRetailPrices, parse_filter, vm_item
from tests.fakes.transport import FakeServiceAdapter

A100, ND = "Standard_NC24ads_A100_v4", "Standard_ND96asr_v4"


def _session(fake: FakeRetailPrices) -> requests.Session:
    session = requests.Session()
    session.mount("https://", FakeServiceAdapter({fake.host: fake}))
    return session


def _api_items() -> list[dict[str, object]]:
    items = []
    for region, price in (("eastus", 3.9), ("westeurope", 4.1), ("westus", 4.8)):
        items += [
            vm_item(A100, region, price),
            vm_item(A100, region, price / 8, " Spot"),
            vm_item(A100, region, price / 10, " Low Priority"),
            vm_item(A100, region, price * 2, productName="Virtual Machines Windows"),
        ]
    return [*items, vm_item(ND, "westeurope", 30.0), vm_item("Standard_D2s_v5", "eastus", 0.1)]


def test_refresh_follows_the_pages_and_replaces_only_what_it_asked_for(tmp_path: Path) -> None:
    table = tmp_path / "prices.json"
    shutil.copy(TABLE, table)
    before = load_table(table)
    fake = FakeRetailPrices(_api_items(), page_size=2)

    written = refresh({A100: ["eastus", "westeurope"]}, table, _session(fake))

    # One query per size, then every NextPageLink (with the service's :443) until none.
    pages = fake.requests.all()
    assert len(pages) > 2 and all(r.host == "prices.azure.com" for r in pages)
    assert pages[0].query["$filter"] == odata_filter(A100, ["eastus", "westeurope"])
    assert pages[0].query["api-version"] == "2023-01-01-preview"
    assert [int(r.query.get("$skip", 0)) for r in pages] == list(range(0, 2 * len(pages), 2))
    assert written == 4  # on demand and Spot in each region; no Windows, no Low Priority
    items = load_table(table)
    eu = lookup(items, A100, "westeurope", table)
    assert (eu.dedicated, eu.spot) == (4.1, pytest.approx(4.1 / 8))
    assert lookup(items, A100, "eastus", table).dedicated == 3.9  # replaced
    kept = [i for i in before if (i["armSkuName"], i["armRegionName"]) != (A100, "eastus")]
    assert [i for i in items if i not in kept and i["armRegionName"] != "westeurope"] != []
    assert all(i in items for i in kept)  # every other size and region is as it was
    source = table_source(table)
    assert source["source"].startswith(API) and source["filters"] == [
        odata_filter(A100, ["eastus", "westeurope"])
    ]


def test_an_unpriced_region_or_a_failing_api_leaves_the_table_as_it_was(tmp_path: Path) -> None:
    table = tmp_path / "prices.json"
    shutil.copy(TABLE, table)
    original = table.read_bytes()
    fake = FakeRetailPrices(_api_items(), page_size=3)
    with pytest.raises(RefreshError, match=f"no Linux hourly price for {ND} in eastus"):
        refresh({A100: ["eastus"], ND: ["eastus", "westeurope"]}, table, _session(fake))

    def broken(_request: object) -> object:
        from tests.fakes.transport import Response

        return Response(503, {"Error": {"Code": "ServiceUnavailable"}})

    session = requests.Session()
    session.mount("https://", FakeServiceAdapter({"prices.azure.com": broken}))
    with pytest.raises(RefreshError, match="answered 503"):
        refresh({A100: ["eastus"]}, table, session)
    assert table.read_bytes() == original
    with pytest.raises(RefreshError, match="not a VM size or region"):
        odata_filter(A100, ["eastus' or armRegionName eq 'x"])


def test_the_fake_refuses_what_the_service_refuses() -> None:
    """A field the API does not filter on is a 400, and values are case-sensitive in the
    preview version, as documented; the command's own filter parses."""
    fake = FakeRetailPrices(_api_items())
    session = _session(fake)
    bad = session.get(API, params={"$filter": "vmSize eq 'x'"})
    assert bad.status_code == 400
    keep = parse_filter(odata_filter(A100, ["eastus"]), case_sensitive=True)
    assert sum(map(keep, _api_items())) == 4
    lower = parse_filter("armSkuName eq 'standard_nc24ads_a100_v4'", case_sensitive=True)
    assert not any(map(lower, _api_items()))
    answer = session.get(API, params={"$filter": "serviceName eq 'Virtual Machines'"}).json()
    assert set(answer) == {
        "BillingCurrency",
        "CustomerEntityId",
        "CustomerEntityType",
        "Items",
        "NextPageLink",
        "Count",
    }
    assert json.dumps(answer)  # plain JSON, as the service answers
