"""A fake of Azure's public Retail Prices API (``GET https://prices.azure.com/api/retail/prices``).

It follows the documented response format and rules (learn.microsoft.com, "Azure Retail Prices
overview"): an answer is ``{BillingCurrency, CustomerEntityId, CustomerEntityType, Items,
NextPageLink, Count}``, a page holds at most ``page_size`` items and names the next one in
``NextPageLink`` (with the host's port, as the service writes it, and the query carried over,
``$skip`` moved on), ``$filter`` is OData's ``eq`` over the documented fields joined with
``and``/``or`` and parentheses (``priceType`` filters the items' ``type``), and with
api-version ``2023-01-01-preview`` its values are case-sensitive. A filter on any other field, or
one it cannot parse, is answered 400, as the service does.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

from tests.fakes.transport import Recorder, Request, Response

HOST = "prices.azure.com"
PATH = "/api/retail/prices"
# The documented filter fields; priceType is the items' "type".
FIELDS = {
    "armRegionName": "armRegionName",
    "location": "location",
    "meterId": "meterId",
    "meterName": "meterName",
    "productId": "productId",
    "skuId": "skuId",
    "productName": "productName",
    "skuName": "skuName",
    "serviceName": "serviceName",
    "serviceId": "serviceId",
    "serviceFamily": "serviceFamily",
    "priceType": "type",
    "armSkuName": "armSkuName",
}
VERSIONS = ("2021-10-01-preview", "2023-01-01-preview")
_TOKEN = re.compile(r"\s*(?:(\()|(\))|'((?:[^']|'')*)'|([A-Za-z_][A-Za-z0-9_]*))")


class FilterError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text.rstrip()):
        m = _TOKEN.match(text, at)
        if m is None:
            raise FilterError(f"cannot parse the filter at {text[at : at + 20]!r}")
        at = m.end()
        if m.group(1):
            out.append(("(", "("))
        elif m.group(2):
            out.append((")", ")"))
        elif m.group(3) is not None:
            out.append(("str", m.group(3).replace("''", "'")))
        else:
            out.append(("word", m.group(4)))
    return out


def parse_filter(text: str, case_sensitive: bool) -> Any:
    """A predicate over items for an OData filter of ``field eq 'value'`` terms."""
    tokens = _tokens(text)
    pos = 0

    def peek() -> tuple[str, str] | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal pos
        if pos >= len(tokens):
            raise FilterError("the filter ends early")
        pos += 1
        return tokens[pos - 1]

    def same(a: object, b: str) -> bool:
        if not isinstance(a, str):
            return False
        return a == b if case_sensitive else a.casefold() == b.casefold()

    def term() -> Any:
        kind, value = take()
        if kind == "(":
            inner = either()
            if take()[0] != ")":
                raise FilterError("a parenthesis is not closed")
            return inner
        if kind != "word" or value not in FIELDS:
            raise FilterError(f"{value!r} is not a field the API filters on")
        op = take()
        if op != ("word", "eq"):
            raise FilterError(f"operator {op[1]!r} is not supported")
        kind, literal = take()
        if kind != "str":
            raise FilterError("a value must be a quoted string")
        key = FIELDS[value]
        return lambda item: same(item.get(key), literal)

    def both() -> Any:
        left = term()
        while peek() == ("word", "and"):
            take()
            right, first = term(), left
            left = lambda item, a=first, b=right: a(item) and b(item)  # noqa: E731
        return left

    def either() -> Any:
        left = both()
        while peek() == ("word", "or"):
            take()
            right, first = both(), left
            left = lambda item, a=first, b=right: a(item) or b(item)  # noqa: E731
        return left

    predicate = either()
    if pos != len(tokens):
        raise FilterError(f"unexpected {tokens[pos][1]!r}")
    return predicate


class FakeRetailPrices:
    host = HOST

    def __init__(self, items: list[dict[str, Any]], page_size: int = 100) -> None:
        self.items, self.page_size = items, page_size
        self.requests = Recorder()

    def __call__(self, req: Request) -> Response:
        self.requests.add(req)
        if req.method != "GET" or req.path != PATH:
            return Response(404, {"Error": {"Code": "NotFound", "Message": req.path}})
        version = req.query.get("api-version")
        if version is not None and version not in VERSIONS:
            return Response(400, {"Error": {"Code": "InvalidApiVersion", "Message": version}})
        try:
            skip = int(req.query.get("$skip", "0"))
            text = req.query.get("$filter")
            keep = parse_filter(text, version == "2023-01-01-preview") if text else None
        except (ValueError, FilterError) as exc:
            return Response(400, {"Error": {"Code": "InvalidFilter", "Message": str(exc)}})
        chosen = [i for i in self.items if keep is None or keep(i)]
        page = chosen[skip : skip + self.page_size]
        more = skip + self.page_size < len(chosen)
        query = {k: v for k, v in req.query.items() if k != "$skip"}
        link = (
            f"https://{HOST}:443{PATH}?{urlencode({**query, '$skip': skip + self.page_size})}"
            if more
            else None
        )
        return Response(
            200,
            {
                "BillingCurrency": "USD",
                "CustomerEntityId": "Default",
                "CustomerEntityType": "Retail",
                "Items": page,
                "NextPageLink": link,
                "Count": len(page),
            },
        )


def vm_item(
    size: str, region: str, price: float, meter_suffix: str = "", **extra: Any
) -> dict[str, Any]:
    """One VM price item as the API writes it (``meter_suffix``: " Spot", " Low Priority")."""
    meter = size.removeprefix("Standard_").replace("_", " ") + meter_suffix
    return {
        "currencyCode": "USD",
        "tierMinimumUnits": 0.0,
        "retailPrice": price,
        "unitPrice": price,
        "armRegionName": region,
        "location": region,
        "effectiveStartDate": "2026-01-01T00:00:00Z",
        "meterId": f"meter-{size}-{region}{meter_suffix.replace(' ', '-')}",
        "meterName": meter,
        "productId": "DZH318Z0TEST",
        "skuId": "DZH318Z0TEST/0001",
        "productName": "Virtual Machines Test Series",
        "skuName": meter,
        "serviceName": "Virtual Machines",
        "serviceId": "DZH313Z7MMC8",
        "serviceFamily": "Compute",
        "unitOfMeasure": "1 Hour",
        "type": "Consumption",
        "isPrimaryMeterRegion": True,
        "armSkuName": size,
        **extra,
    }
