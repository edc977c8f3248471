"""ARM template expressions and resource expansion, as Azure Resource Manager evaluates them.

The fake ARM endpoint deploys ``infra/main.json`` the way the service does: parameters (with
their defaults and allowed values), variables, ``condition``, ``dependsOn`` (an unknown
resource is an error, and so is a cycle), nested deployments with inner scope, and the template
functions the file uses, each following Microsoft's "Template functions" reference (an unknown
function is refused, naming it). ``reference()`` and ``listKeys()`` read what the fake holds.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any


class TemplateError(ValueError):
    """The template is invalid (ARM's InvalidTemplate): the message names the expression."""


_TOKEN = re.compile(
    r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>-?\d+)|(?P<name>[A-Za-z_][\w]*)|(?P<sym>[(),.\[\]]))"
)


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise TemplateError(f"cannot parse the expression [{text}] at {text[pos:]!r}")
        pos = match.end()
        kind = match.lastgroup or ""
        value: Any = match.group(kind)
        if kind == "str":
            value = value[1:-1].replace("''", "'")
        elif kind == "num":
            value = int(value)
        out.append((kind, value))
    return out


@dataclass
class Scope:
    """What an expression can see: one template's parameters and variables, and the service."""

    parameters: dict[str, Any]
    variables: dict[str, Any]
    subscription_id: str
    tenant_id: str
    resource_group: str | None
    location: str
    reference: Callable[[str, str | None], Any]
    list_keys: Callable[[str], Any]
    deployer: dict[str, str] = field(default_factory=dict)  # deployer(): who deploys
    _resolved: dict[str, Any] = field(default_factory=dict)
    _in_variables: int = 0


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("[") and not value.startswith("[[")


def evaluate(value: Any, scope: Scope) -> Any:
    """Every expression in ``value`` evaluated (objects and arrays walked)."""
    if isinstance(value, dict):
        return {evaluate(k, scope): evaluate(v, scope) for k, v in value.items()}
    if isinstance(value, list):
        return [evaluate(v, scope) for v in value]
    if is_expression(value):
        if not value.endswith("]"):
            raise TemplateError(f"the expression {value!r} does not end with ]")
        parser = _Parser(_tokens(value[1:-1]), scope, value)
        result = parser.expression()
        if parser.pos != len(parser.tokens):
            raise TemplateError(f"unexpected text after the expression {value!r}")
        return result
    if isinstance(value, str) and value.startswith("[["):
        return value[1:]
    return value


class _Parser:
    def __init__(self, tokens: list[tuple[str, Any]], scope: Scope, text: str) -> None:
        self.tokens, self.scope, self.text, self.pos = tokens, scope, text, 0
        self.skipping = 0  # inside the branch of if() its condition did not choose

    def _peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, symbol: str | None = None) -> tuple[str, Any]:
        token = self._peek()
        if token is None or (symbol is not None and token != ("sym", symbol)):
            raise TemplateError(f"expected {symbol or 'more'} in {self.text}")
        self.pos += 1
        return token

    def expression(self) -> Any:
        kind, value = self._take()
        if kind in ("str", "num"):
            result = value
        elif kind == "name" and value.lower() == "if":
            # ARM evaluates only the branch the condition chooses ("Template functions -
            # logical", if): the other may reference what does not exist.
            self._take("(")
            condition = self.expression()
            self._take(",")
            chosen = []
            for branch in (True, False):
                self.skipping += branch != bool(condition)
                chosen.append(self.expression())
                self.skipping -= branch != bool(condition)
                if branch:
                    self._take(",")
            self._take(")")
            result = chosen[0] if condition else chosen[1]
        elif kind == "name":
            self._take("(")
            args: list[Any] = []
            if self._peek() != ("sym", ")"):
                args.append(self.expression())
                while self._peek() == ("sym", ","):
                    self._take(",")
                    args.append(self.expression())
            self._take(")")
            result = self._call(value, args)
        else:
            raise TemplateError(f"unexpected {value!r} in {self.text}")
        while self._peek() in (("sym", "."), ("sym", "[")):
            if self._take()[1] == ".":
                _, member = self._take()
                result = self._member(result, member)
            else:
                index = self.expression()
                self._take("]")
                result = self._member(result, index)
        return result

    def _member(self, value: Any, key: Any) -> Any:
        if self.skipping:
            return None
        if isinstance(value, dict):
            for k, v in value.items():  # ARM's property access ignores case
                if str(k).lower() == str(key).lower():
                    return v
            raise TemplateError(
                f"{self.text}: the object has no property {key!r} (has: {', '.join(value)})"
            )
        if isinstance(value, list) and isinstance(key, int):
            if not 0 <= key < len(value):
                raise TemplateError(f"{self.text}: index {key} is outside the array")
            return value[key]
        raise TemplateError(f"{self.text}: cannot read {key!r} of {type(value).__name__}")

    def _call(self, name: str, args: list[Any]) -> Any:
        if self.skipping:
            return None
        fn = _FUNCTIONS.get(name.lower())
        if fn is None:
            raise TemplateError(f"{self.text}: the template function '{name}' is not valid")
        return fn(self.scope, *args)


def _parameter(scope: Scope, name: str) -> Any:
    if name not in scope.parameters:
        raise TemplateError(f"the template parameter '{name}' is not found")
    return scope.parameters[name]


def _variable(scope: Scope, name: str) -> Any:
    if name not in scope.variables:
        raise TemplateError(f"the template variable '{name}' is not found")
    if name not in scope._resolved:
        scope._in_variables += 1
        try:
            scope._resolved[name] = evaluate(scope.variables[name], scope)
        finally:
            scope._in_variables -= 1
    return scope._resolved[name]


def _runtime_state(name: str, read: Callable[..., Any]) -> Callable[..., Any]:
    """``reference()`` and the ``list*()`` functions: a resource's runtime state, which ARM
    refuses in a variable ("Variables in ARM templates": variables are resolved before the
    deployment starts)."""

    def call(scope: Scope, *args: Any) -> Any:
        if scope._in_variables:
            raise TemplateError(
                f"the template function '{name}' is not expected in a variable: it reads a "
                "resource's runtime state, and variables are resolved before deployment"
            )
        return read(scope, *args)

    return call


def _resource_id(scope: Scope, *parts: str) -> str:
    """resourceId([subscriptionId], [resourceGroupName], type, name1, name2...)."""
    parts = tuple(str(p) for p in parts)
    index = next((i for i, p in enumerate(parts) if "/" in p and "." in p.split("/")[0]), None)
    if index is None:
        raise TemplateError(f"resourceId: no resource type among {parts}")
    prefix, kind, names = parts[:index], parts[index], parts[index + 1 :]
    subscription, group = scope.subscription_id, scope.resource_group
    if len(prefix) == 1:
        group = prefix[0]
    elif len(prefix) == 2:
        subscription, group = prefix
    namespace, *types = kind.split("/")
    if len(types) != len(names):
        raise TemplateError(f"resourceId: {kind} needs {len(types)} names, given {len(names)}")
    path = "/".join(f"{t}/{n}" for t, n in zip(types, names, strict=True))
    if group is None:
        raise TemplateError("resourceId of a resource group's resource needs the group's name")
    return f"/subscriptions/{subscription}/resourceGroups/{group}/providers/{namespace}/{path}"


def _subscription_resource_id(scope: Scope, *parts: str) -> str:
    kind_at = next(i for i, p in enumerate(parts) if "/" in p)
    subscription = parts[0] if kind_at == 1 else scope.subscription_id
    namespace, *types = parts[kind_at].split("/")
    names = parts[kind_at + 1 :]
    if parts[kind_at].lower() == "microsoft.resources/resourcegroups":  # ARM's special case
        return f"/subscriptions/{subscription}/resourceGroups/{names[0]}"
    path = "/".join(f"{t}/{n}" for t, n in zip(types, names, strict=True))
    return f"/subscriptions/{subscription}/providers/{namespace}/{path}"


def _extension_resource_id(scope: Scope, base: str, kind: str, *names: str) -> str:
    namespace, *types = kind.split("/")
    path = "/".join(f"{t}/{n}" for t, n in zip(types, names, strict=True))
    return f"{base}/providers/{namespace}/{path}"


def _guid(scope: Scope, *parts: str) -> str:
    """Deterministic, as ARM's: the same arguments give the same GUID (a name-based UUID)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "-".join(str(p) for p in parts)))


def _unique_string(scope: Scope, *parts: str) -> str:
    digest = hashlib.sha256("-".join(parts).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:13]


def _format(scope: Scope, text: str, *args: Any) -> str:
    def show(value: Any) -> str:
        return ("True" if value else "False") if isinstance(value, bool) else str(value)

    return re.sub(r"\{(\d+)\}", lambda m: show(args[int(m.group(1))]), text)


def _union(scope: Scope, *items: Any) -> Any:
    """Objects merge deeply (a nested object's properties are merged too); arrays join without
    duplicates."""
    if all(isinstance(i, dict) for i in items):
        merged: dict[str, Any] = {}
        for item in items:
            for key, value in item.items():
                if isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key] = _union(scope, merged[key], value)
                else:
                    merged[key] = value
        return merged
    if all(isinstance(i, list) for i in items):
        out: list[Any] = []
        for item in items:
            out += [v for v in item if v not in out]
        return out
    raise TemplateError("union takes objects or arrays, all of one kind")


def _cidr_subnet(scope: Scope, network: str, bits: int, index: int) -> str:
    subnets = ipaddress.ip_network(network).subnets(new_prefix=bits)
    for i, subnet in enumerate(subnets):
        if i == index:
            return str(subnet)
    raise TemplateError(f"cidrSubnet: {network} has no subnet {index} of /{bits}")


def _empty(scope: Scope, value: Any) -> bool:
    return value in (None, "", [], {})


def _environment(scope: Scope) -> dict[str, Any]:
    return {
        "name": "AzureCloud",
        "suffixes": {"storage": "core.windows.net", "keyvaultDns": ".vault.azure.net"},
        "resourceManager": "https://management.azure.com/",
    }


def _date_add(scope: Scope, base: str, duration: str) -> str:
    match = re.fullmatch(r"P(?:(\d+)Y)?(?:(\d+)D)?", duration)
    if match is None:
        raise TemplateError(f"dateTimeAdd: unsupported duration {duration}")
    years, days = int(match.group(1) or 0), int(match.group(2) or 0)
    moment = datetime.fromisoformat(base.replace("Z", "+00:00"))
    moment = moment.replace(year=moment.year + years) + timedelta(days=days)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(scope: Scope, value: str) -> int:
    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp())


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "parameters": _parameter,
    "variables": _variable,
    "resourceid": _resource_id,
    "subscriptionresourceid": _subscription_resource_id,
    "extensionresourceid": _extension_resource_id,
    "reference": _runtime_state("reference", lambda s, rid, api=None, *_: s.reference(rid, api)),
    "listkeys": _runtime_state("listKeys", lambda s, rid, api=None: s.list_keys(rid)),
    "deployer": lambda s: dict(s.deployer),
    "guid": _guid,
    "uniquestring": _unique_string,
    "format": _format,
    "concat": lambda s, *a: (
        [x for i in a for x in i] if a and isinstance(a[0], list) else "".join(map(str, a))
    ),
    "tolower": lambda s, v: str(v).lower(),
    "union": _union,
    "createobject": lambda s, *a: {a[i]: a[i + 1] for i in range(0, len(a), 2)},
    "createarray": lambda s, *a: list(a),
    "first": lambda s, v: v[0],
    "last": lambda s, v: v[-1],
    "equals": lambda s, a, b: a == b,
    "not": lambda s, v: not v,
    "and": lambda s, *a: all(a),
    "or": lambda s, *a: any(a),
    "empty": _empty,
    "json": lambda s, v: json.loads(v),
    "string": lambda s, v: v if isinstance(v, str) else json.dumps(v, separators=(",", ":")),
    "uricomponent": lambda s, v: __import__("urllib.parse").parse.quote(str(v), safe=""),
    "cidrsubnet": _cidr_subnet,
    "environment": _environment,
    "subscription": lambda s: {
        "id": f"/subscriptions/{s.subscription_id}",
        "subscriptionId": s.subscription_id,
        "tenantId": s.tenant_id,
    },
    "resourcegroup": lambda s: {
        "id": f"/subscriptions/{s.subscription_id}/resourceGroups/{s.resource_group}",
        "name": s.resource_group,
        "location": s.location,
    },
    "utcnow": lambda s, fmt=None: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "datetimeadd": _date_add,
    "datetimetoepoch": _epoch,
}


def bind_parameters(template: dict[str, Any], given: dict[str, Any], scope: Scope) -> None:
    """The template's parameters from ``given`` (``{"name": {"value": ...}}``), defaults and
    allowed values applied, as ARM does before anything is deployed."""
    declared = template.get("parameters", {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise TemplateError(f"the parameters {', '.join(unknown)} are not declared in the template")
    types = {"string": str, "securestring": str, "int": int, "bool": bool, "object": dict}
    types |= {"secureobject": dict, "array": list}
    for name, spec in declared.items():
        if name in given:
            value = given[name]["value"]
        elif "defaultValue" in spec:
            value = evaluate(spec["defaultValue"], scope)
        else:
            raise TemplateError(f"the template parameter '{name}' has no value")
        kind = types[spec["type"].lower()]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TemplateError(f"the parameter '{name}' must be {spec['type']}, not {value!r}")
        allowed = spec.get("allowedValues")
        if allowed is not None and value not in allowed:
            raise TemplateError(f"the parameter '{name}' is {value!r}, not one of {allowed}")
        if "minValue" in spec and value < spec["minValue"]:
            raise TemplateError(f"the parameter '{name}' is below {spec['minValue']}")
        scope.parameters[name] = value
