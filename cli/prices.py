"""The VM price table the cost estimate reads: ``python -m cli.prices``.

    python -m cli.prices refresh [--size Standard_NC24ads_A100_v4 ...] [--region eastus ...]
    python -m cli.prices show --config configs/azure.yaml

``refresh`` asks Azure's public Retail Prices API (no sign-in) for the Linux pay-as-you-go and
Spot prices of the sizes in the regions given (default: those the table holds), follows its
``NextPageLink`` pages, and writes the answers into ``core/prices/azure-retail-prices.json`` in
the API's own format, replacing the items of those sizes and regions and keeping the others;
the file beside it records where and when. Nothing is written unless every page arrived and
every size has a price in every region asked for. ``show`` prints the prices a run of the
config would be estimated with, and where they came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common.atomic import atomic_write
from core.pricing import REFRESH, TABLE, PriceError, is_linux_hourly, load_table, node_prices

API = "https://prices.azure.com/api/retail/prices"
API_VERSION = "2023-01-01-preview"  # filter values are case-sensitive from this version on
MAX_PAGES = 200  # one VM size in every region is a few pages; more is an answer gone wrong
TIMEOUT = 60.0
_NAME = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class RefreshError(RuntimeError):
    """The API could not be read, or did not price what was asked; the table is unchanged."""


def odata_filter(size: str, regions: list[str]) -> str:
    """The API's ``$filter`` for one size's hourly prices in ``regions``."""
    for value in (size, *regions):
        if not value or not set(value) <= _NAME:  # nothing that could end the quoted value
            raise RefreshError(f"{value!r} is not a VM size or region name")
    where = " or ".join(f"armRegionName eq '{r}'" for r in regions)
    return (
        f"serviceName eq 'Virtual Machines' and priceType eq 'Consumption' and "
        f"armSkuName eq '{size}' and ({where})"
    )


def _same_origin(url: object, origin: Any) -> bool:
    if not isinstance(url, str):
        return False
    there = urlsplit(url)
    return there.scheme == origin.scheme and there.hostname == origin.hostname


def _pages(session: Any, api: str, query: dict[str, str]) -> list[dict[str, Any]]:
    """Every item of the answer, following ``NextPageLink`` (only to the API's own host: the
    API writes it with its port, ``https://prices.azure.com:443/...``)."""
    origin = urlsplit(api)
    url: str | None = api
    params: dict[str, str] | None = query
    items: list[dict[str, Any]] = []
    for _ in range(MAX_PAGES):
        if url is None:
            return items
        try:
            response = session.get(url, params=params, timeout=TIMEOUT)
        except Exception as exc:  # requests' errors: no route, DNS, TLS, timeout
            raise RefreshError(f"{api} cannot be reached ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise RefreshError(f"{api} answered {response.status_code}: {response.text[:300]!r}")
        try:
            page = response.json()
        except ValueError:
            raise RefreshError(f"{api} answered with a page that is not JSON") from None
        found = page.get("Items") if isinstance(page, dict) else None
        if not isinstance(found, list) or not all(isinstance(i, dict) for i in found):
            raise RefreshError(f"{api} answered a page without an Items list")
        items += found
        url, params = page.get("NextPageLink"), None  # the link carries the query itself
        if url is not None and not _same_origin(url, origin):
            raise RefreshError(f"{api} gave a NextPageLink off its own host: {url!r}")
    raise RefreshError(f"{api} gave more than {MAX_PAGES} pages for one size")


def refresh(
    wanted: dict[str, list[str]],
    table: Path = TABLE,
    session: Any = None,
    api: str = API,
) -> int:
    """Ask the API for each size's prices in its regions (``wanted``: size -> regions) and
    write them into ``table``; returns the number of items written. Raises
    :class:`RefreshError`, leaving the table as it was."""
    import requests

    session = session or requests.Session()
    try:
        kept = load_table(table) if table.exists() else []
    except PriceError as exc:
        raise RefreshError(str(exc)) from None
    fresh: list[dict[str, Any]] = []
    filters = []
    for size, regions in wanted.items():
        query = {"api-version": API_VERSION, "$filter": odata_filter(size, regions)}
        filters.append(query["$filter"])
        got = [i for i in _pages(session, api, query) if is_linux_hourly(i)]
        missing = [r for r in regions if not any(i.get("armRegionName") == r for i in got)]
        if missing:
            raise RefreshError(
                f"the API has no Linux hourly price for {size} in {', '.join(missing)} (is the "
                "size offered there?); the table is unchanged"
            )
        fresh += [
            i for i in got if i.get("armSkuName") == size and i.get("armRegionName") in regions
        ]
    asked = {(s, r) for s, regions in wanted.items() for r in regions}
    others = [i for i in kept if (i.get("armSkuName"), i.get("armRegionName")) not in asked]
    items = others + fresh
    doc = {
        "BillingCurrency": "USD",
        "CustomerEntityId": "Default",
        "CustomerEntityType": "Retail",
        "Items": items,
        "NextPageLink": None,
        "Count": len(items),
    }
    source = {
        "retrieved": f"{datetime.now(UTC):%Y-%m-%d}",
        "source": f"{api}?api-version={API_VERSION}",
        "filters": filters,
        "kept_from_before": len(others),
        "refresh": REFRESH,
    }
    atomic_write(table, lambda fh: fh.write(json.dumps(doc, indent=1).encode() + b"\n"))
    atomic_write(
        table.with_suffix(".source.json"),
        lambda fh: fh.write(json.dumps(source, indent=2).encode() + b"\n"),
    )
    return len(fresh)


def table_pairs(table: Path) -> dict[str, list[str]]:
    """Each size the table prices, with the regions it prices it in."""
    try:
        items = load_table(table)
    except PriceError:
        return {}
    pairs: dict[str, set[str]] = {}
    for i in items:
        if i.get("armSkuName") and i.get("armRegionName"):
            pairs.setdefault(str(i["armSkuName"]), set()).add(str(i["armRegionName"]))
    return {size: sorted(regions) for size, regions in sorted(pairs.items())}


def main(argv: list[str] | None = None) -> int:
    from flows.config_args import add_config_arguments, config_from

    p = argparse.ArgumentParser(
        prog="python -m cli.prices",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("refresh", help="read Azure's Retail Prices API into the table")
    r.add_argument("--size", action="append", default=[], help="a VM size (repeatable)")
    r.add_argument("--region", action="append", default=[], help="a region (repeatable)")
    r.add_argument("--table", type=Path, default=TABLE)
    r.add_argument("--api", default=API, help="the API's address")
    s = sub.add_parser("show", help="the prices a run of the config is estimated with")
    add_config_arguments(s)
    args = p.parse_args(argv)
    if args.command == "show":
        from core.config import ConfigError

        try:
            prices = node_prices(config_from(args))
        except (ConfigError, PriceError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if prices is None:
            print("the local target rents nothing: no price (set pool.hourly_price to price it)")
            return 0
        spot = f"{prices.spot:g}" if prices.spot is not None else "not known"
        unit = f" {prices.currency}" if prices.currency else ""
        print(f"per node-hour: dedicated {prices.dedicated:g}{unit}, Spot {spot}")
        print(f"from: {prices.source}")
        return 0
    if bool(args.size) != bool(args.region):
        print(
            "error: name both --size and --region, or neither (then: what the table holds)",
            file=sys.stderr,
        )
        return 2
    wanted = {size: args.region for size in args.size} or table_pairs(args.table)
    if not wanted:
        print(f"error: {args.table} holds no price: name a --size and a --region", file=sys.stderr)
        return 2
    try:
        written = refresh(wanted, args.table, api=args.api)
    except RefreshError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.table}: {written} prices of {len(wanted)} size(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
