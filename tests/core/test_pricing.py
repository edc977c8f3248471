"""The price table: the shipped one, lookups by size and region, and what is not in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import load_config
from core.pricing import TABLE, PriceError, load_table, lookup, node_prices, table_source
from tests.conftest import ROOT
from tests.fakes.retail_prices import vm_item

A100 = "Standard_NC24ads_A100_v4"


def _azure(*overrides: str) -> object:
    return load_config(
        ROOT / "configs" / "azure.example.yaml",
        ["azure.batch_account_url=https://acct.eastus.batch.azure.com", *overrides],
    )


def test_the_shipped_table_prices_every_size_the_docs_name_and_says_where_from() -> None:
    docs = (ROOT / "docs" / "azure.md").read_text()
    sizes = {i["armSkuName"] for i in load_table()}
    named = {s for s in sizes if f"| {s} |" in docs}
    assert named == {A100, "Standard_ND96asr_v4", "Standard_ND96isr_H100_v5"}
    source = table_source()
    assert source["retrieved"] and "skypilot-catalog" in source["source"]
    assert "python -m cli.prices refresh" in source["refresh"]
    # Published list prices (issue 53): NC24ads A100 v4 in eastus, on demand and Spot.
    prices = lookup(load_table(), A100, "eastus")
    assert prices.dedicated == pytest.approx(3.673) and prices.spot == pytest.approx(0.444433)
    assert prices.currency == "USD" and "retrieved" in prices.source


def test_a_config_is_priced_by_its_batch_accounts_region_or_its_override() -> None:
    prices = node_prices(_azure())
    assert prices is not None and prices.dedicated == pytest.approx(3.673)
    assert prices.for_nodes(2, 1) == pytest.approx(2 * 3.673 + 0.444433)
    override = node_prices(_azure("pool.hourly_price=2.5"))
    assert override is not None and override.dedicated == override.spot == 2.5
    local = load_config(ROOT / "configs" / "local.yaml")
    assert node_prices(local) is None  # the local target rents nothing


def test_a_spot_price_set_in_the_pool_prices_its_spot_nodes() -> None:
    both = node_prices(_azure("pool.hourly_price=2.5", "pool.spot_hourly_price=0.4"))
    assert both is not None and (both.dedicated, both.spot) == (2.5, 0.4)
    assert "pool.spot_hourly_price (0.4)" in both.source
    table = node_prices(_azure("pool.spot_hourly_price=0.3"))
    assert table is not None and table.dedicated == pytest.approx(3.673) and table.spot == 0.3
    assert table.currency == "USD"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["pool.vm_size=Standard_NC6"], "has no price for VM size Standard_NC6"),
        (
            ["azure.batch_account_url=https://acct.westeurope.batch.azure.com"],
            f"no price for {A100} in region westeurope (it has centralus, eastus",
        ),
    ],
)
def test_a_size_or_region_the_table_lacks_is_named_with_the_command_that_refreshes_it(
    overrides: list[str], named: str
) -> None:
    with pytest.raises(PriceError) as caught:
        node_prices(_azure(*overrides))
    message = str(caught.value)
    assert named in message and str(TABLE) in message
    assert "python -m cli.prices refresh --size" in message and "pool.hourly_price" in message


def test_windows_low_priority_reservations_and_spot_only_are_not_a_linux_price(
    tmp_path: Path,
) -> None:
    table = tmp_path / "prices.json"
    items = [
        vm_item(A100, "eastus", 9.0, productName="Virtual Machines NCads A100 v4 Series Windows"),
        vm_item(A100, "eastus", 0.3, " Low Priority"),
        vm_item(A100, "eastus", 20000.0, type="Reservation", reservationTerm="1 Year"),
        vm_item(A100, "eastus", 0.5, " Spot"),
        vm_item(A100, "eastus", 3.0, effectiveStartDate="2025-01-01T00:00:00Z"),
        vm_item(A100, "eastus", 3.5, effectiveStartDate="2026-06-01T00:00:00Z"),  # newest
    ]
    table.write_text(json.dumps({"Items": items}))
    prices = lookup(load_table(table), A100, "eastus", table)
    assert (prices.dedicated, prices.spot) == (3.5, 0.5)
    table.write_text(json.dumps({"Items": [vm_item(A100, "eastus", 0.5, " Spot")]}))
    with pytest.raises(PriceError, match="only a Spot price"):
        lookup(load_table(table), A100, "eastus", table)
    for broken in ("not json", json.dumps({"Items": "x"})):
        table.write_text(broken)
        with pytest.raises(PriceError, match=str(table)):
            load_table(table)
