"""What a node of the pool costs per hour: the dated price table, or ``pool.hourly_price``.

The table (``core/prices/azure-retail-prices.json``) is kept in the Azure Retail Prices API's own
response format, so ``python -m cli.prices refresh`` writes what the API answers and this module
reads one format whatever its origin; the file beside it (``.source.json``) says where and when
the prices came from. A VM's Linux pay-as-you-go price is its ``Consumption`` item of unit
``1 Hour`` whose meter is neither ``Spot`` nor ``Low Priority`` and whose product is not a
Windows one; the Spot price is the same size's item whose meter ends in ``Spot``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from core.config import PipelineConfig

PRICES_DIR = Path(__file__).resolve().parent / "prices"
TABLE = PRICES_DIR / "azure-retail-prices.json"
REFRESH = "python -m cli.prices refresh"
MAX_TABLE_BYTES = 64 << 20  # a table of every VM in every region is about 50 MB
# <account>.<region>.batch.azure.com: the Batch account's region is the pool's.
_BATCH_HOST = re.compile(r"^[a-z0-9]+\.([a-z0-9]+)\.batch\.azure\.com$")


class PriceError(ValueError):
    """No price for the pool: the message names the size, the region, the table and the fix."""


@dataclass(frozen=True)
class NodePrices:
    """Per node-hour, in ``currency``; ``spot`` None where no Spot price is known."""

    dedicated: float
    spot: float | None
    currency: str
    source: str  # where the figures came from, for a person

    def for_nodes(self, dedicated: int, spot: int) -> float:
        """The pool's price per hour with that many nodes of each kind."""
        if spot and self.spot is None:
            raise PriceError(f"no Spot price is known ({self.source})")
        return dedicated * self.dedicated + spot * (self.spot or 0.0)


def table_source(table: Path = TABLE) -> dict[str, Any]:
    """The table's provenance record (``<table>.source.json``); empty when there is none."""
    side = table.with_suffix(".source.json")
    try:
        doc = json.loads(side.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def load_table(table: Path = TABLE) -> list[dict[str, Any]]:
    """The table's items; a file that is not a Retail Prices answer is named with why."""
    try:
        if table.stat().st_size > MAX_TABLE_BYTES:
            raise PriceError(f"{table} is over {MAX_TABLE_BYTES >> 20} MB: not a price table")
        doc = json.loads(table.read_text())
    except OSError as exc:
        raise PriceError(f"price table {table} cannot be read ({exc}); run `{REFRESH}`") from None
    except ValueError as exc:
        raise PriceError(f"price table {table} is not JSON ({exc}); run `{REFRESH}`") from None
    items = doc.get("Items") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise PriceError(f"price table {table} has no Items list (the Retail Prices API's format)")
    return items


def is_linux_hourly(item: dict[str, Any]) -> bool:
    """A pay-as-you-go hourly VM meter of a Linux product (Batch's pools run Linux here)."""
    return (
        item.get("serviceName") == "Virtual Machines"
        and item.get("type", item.get("priceType")) == "Consumption"
        and item.get("unitOfMeasure") == "1 Hour"
        and not str(item.get("productName", "")).endswith("Windows")
        and "Low Priority" not in str(item.get("meterName", ""))
        and isinstance(item.get("retailPrice"), int | float)
        and not isinstance(item.get("retailPrice"), bool)
        and item["retailPrice"] >= 0
    )


def _newest(items: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The item in effect most recently (items without a date count as the oldest)."""
    return max(items, key=lambda i: str(i.get("effectiveStartDate") or ""), default=None)


def lookup(
    items: list[dict[str, Any]], vm_size: str, region: str, table: Path = TABLE
) -> NodePrices:
    """The size's Linux price in ``region``, and its Spot price when the table has one."""
    size = [i for i in items if i.get("armSkuName") == vm_size and is_linux_hourly(i)]
    if not size:
        raise PriceError(
            f"the price table {table} has no price for VM size {vm_size}: run `{REFRESH} "
            f"--size {vm_size} --region {region}` (it reads Azure's public Retail Prices API), "
            "or set pool.hourly_price"
        )
    here = [i for i in size if i.get("armRegionName") == region]
    if not here:
        regions = ", ".join(sorted({str(i.get("armRegionName")) for i in size}))
        raise PriceError(
            f"the price table {table} has no price for {vm_size} in region {region} (it has "
            f"{regions}): run `{REFRESH} --size {vm_size} --region {region}`, or set "
            "pool.hourly_price"
        )
    spot = [i for i in here if str(i.get("meterName", "")).endswith(" Spot")]
    dedicated = _newest([i for i in here if i not in spot])
    if dedicated is None:
        raise PriceError(
            f"the price table {table} has only a Spot price for {vm_size} in {region}: run "
            f"`{REFRESH} --size {vm_size} --region {region}`, or set pool.hourly_price"
        )
    spot_item = _newest(spot)
    source = table_source(table)
    dated = f", retrieved {source['retrieved']}" if source.get("retrieved") else ""
    return NodePrices(
        float(dedicated["retailPrice"]),
        float(spot_item["retailPrice"]) if spot_item is not None else None,
        str(dedicated.get("currencyCode", "USD")),
        f"{table.name}{dated}: {vm_size} in {region}",
    )


def pool_region(config: PipelineConfig) -> str | None:
    """The pool's region: the Batch account's (``https://<account>.<region>.batch.azure.com``)."""
    url = config.azure.batch_account_url
    host = (urlsplit(url).hostname or "") if url else ""
    found = _BATCH_HOST.match(host.lower())
    return found.group(1) if found else None


def node_prices(config: PipelineConfig, table: Path = TABLE) -> NodePrices | None:
    """What a node costs: ``pool.hourly_price`` when set, else the table's price of the pool's
    size in its region, with ``pool.spot_hourly_price`` for Spot nodes when set; None for a
    pool that rents nothing (the local target with no price set). Raises :class:`PriceError`
    when Azure's price is not known."""
    pool = config.pool
    if pool.hourly_price > 0:
        spot = pool.spot_hourly_price or pool.hourly_price
        return NodePrices(
            pool.hourly_price,
            spot,
            "",
            f"pool.hourly_price ({pool.hourly_price:g})"
            + (f", pool.spot_hourly_price ({spot:g})" if pool.spot_hourly_price else ""),
        )
    if config.target != "azure":
        return None
    region = pool_region(config)
    if region is None:
        raise PriceError(
            f"the pool's region is not known: azure.batch_account_url "
            f"({config.azure.batch_account_url}) is not https://<account>.<region>.batch.azure.com;"
            " set pool.hourly_price"
        )
    prices = lookup(load_table(table), pool.vm_size, region, table)
    if pool.spot_hourly_price:  # the user's own Spot price over the table's
        return replace(
            prices,
            spot=pool.spot_hourly_price,
            source=f"{prices.source}; pool.spot_hourly_price ({pool.spot_hourly_price:g})",
        )
    return prices
