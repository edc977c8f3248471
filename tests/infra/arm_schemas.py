"""infra/main.json's resources checked against Azure's published ARM resource schemas (vendored
in infra/schemas/ at a recorded commit), with jsonschema, plus what the schemas leave open: a
property the schema does not declare is reported (the generated schemas do not set
``additionalProperties: false``, but the resource providers ignore or refuse such a property:
either way it is a mistake in the template)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft4Validator, validators
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "infra" / "schemas"
BASE = "https://schema.management.azure.com/schemas/"


@cache
def registry() -> Registry:
    resources = []
    for path in SCHEMAS.rglob("*.json"):
        doc = json.loads(path.read_text())
        uri = BASE + path.relative_to(SCHEMAS).as_posix()
        resources.append((uri, Resource.from_contents(doc, default_specification=DRAFT4)))
    return Registry().with_resources(resources)


@cache
def schema_for(kind: str, api: str) -> tuple[str, dict[str, Any]]:
    """The URI and body of the resource definition of ``kind`` at ``api``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vendor", SCHEMAS / "vendor.py")
    assert spec and spec.loader
    vendor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor)
    relative = vendor.schema_file(kind, api).removeprefix("schemas/")
    doc = json.loads((SCHEMAS / relative).read_text())
    for key, defs in doc.items():
        if not key.endswith("resourceDefinitions"):
            continue
        for name, body in defs.items():
            if kind in body.get("properties", {}).get("type", {}).get("enum", []):
                return f"{BASE}{relative}#/{key}/{name}", body
    raise AssertionError(f"no schema for {kind} {api} in {relative}")


def _resolve(schema: dict[str, Any], base: str) -> tuple[dict[str, Any], str]:
    while "$ref" in schema:
        ref = schema["$ref"]
        uri = ref if ref.startswith("http") else base.split("#")[0] + ref
        resolved = registry().resolver().lookup(uri)
        schema, base = resolved.contents, uri
    return schema, base


def undeclared(value: Any, schema: dict[str, Any], base: str, path: str = "") -> list[str]:
    """Property paths of ``value`` that no branch of ``schema`` declares."""
    schema, base = _resolve(schema, base)
    if isinstance(value, str) and value.startswith("["):
        return []  # an expression: its value is checked once evaluated
    branches = schema.get("oneOf") or schema.get("anyOf")
    if branches:
        results = [undeclared(value, b, base, path) for b in branches]
        fitting = [r for r, b in zip(results, branches, strict=True) if _fits(value, b, base)]
        return min(fitting or results, key=len)
    if isinstance(value, dict):
        props = dict(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            resolved, _ = _resolve(part, base)
            props.update(resolved.get("properties", {}))
        extra = schema.get("additionalProperties")
        out = []
        for key, item in value.items():
            if key in props:
                out += undeclared(item, props[key], base, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += undeclared(item, extra, base, f"{path}.{key}")
            elif schema.get("type") == "object" and (props or extra is False):
                out.append(f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            p
            for i, v in enumerate(value)
            for p in undeclared(v, schema["items"], base, f"{path}[{i}]")
        ]
    return []


def _fits(value: Any, schema: dict[str, Any], base: str) -> bool:
    schema, _ = _resolve(schema, base)
    kind = schema.get("type")
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    return True


# What a template may say of any resource besides what its provider's schema declares
# ("Resource declaration in ARM templates": condition, dependsOn, scope, copy, comments, and the
# resource group or subscription a nested deployment targets).
TEMPLATE_KEYS = (
    "condition",
    "dependsOn",
    "scope",
    "copy",
    "comments",
    "resourceGroup",
    "subscriptionId",
)


def _one_of(validator: Any, branches: Any, instance: Any, schema: Any) -> Any:
    """Draft 4's oneOf, except that an expression fits: the generated schemas offer an
    expression beside every value, and some of those values are "any" (``{}``), which an
    expression fits too; ARM evaluates it first, so it is one value, not two."""
    if (
        isinstance(instance, str)
        and instance.startswith("[")
        and any(str(b.get("$ref", "")).endswith("/definitions/expression") for b in branches)
    ):
        return
    yield from _DRAFT4_ONE_OF(validator, branches, instance, schema)


_DRAFT4_ONE_OF = Draft4Validator.VALIDATORS["oneOf"]
Validator = validators.extend(Draft4Validator, {"oneOf": _one_of})


def _deepest(error: Any) -> Any:
    """The error inside a choice of branches that says what is wrong (jsonschema's best
    match, followed down)."""
    while error.context:
        branches = [e for e in error.context if not _expression_branch(e)] or list(error.context)
        error = max(branches, key=lambda e: (len(e.absolute_path), e.validator != "type"))
    return error


def _expression_branch(error: Any) -> bool:
    """An error of the "or an expression" branch every generated property has."""
    return (error.validator == "pattern" and str(error.validator_value).startswith("^\\[")) or (
        error.validator == "type"
        and error.validator_value == "string"
        and not isinstance(error.instance, str)
    )


# Where the generated schema is narrower than the service, each with its source. Nothing else is
# excused.
SCHEMA_GAPS = (
    (
        "Microsoft.App/containerApps",
        re.compile(
            r"^properties\.template\.containers\.\d+\.resources\.cpu: "
            r"[0-9.]+ is not of type 'integer'$"
        ),
        "ContainerResources.cpu is a double in the REST API (the SDKs take 0.5); the schema says "
        "integer, and Microsoft's Bicep reference for Microsoft.App/containerApps says: 'Required "
        "CPU in cores, e.g. 0.5 To specify a decimal value, use the json() function'",
    ),
)


def problems(resource: dict[str, Any]) -> list[str]:
    """Every schema error and undeclared property of one template resource."""
    uri, _ = schema_for(resource["type"], resource["apiVersion"])
    body = {k: v for k, v in resource.items() if k not in TEMPLATE_KEYS}
    validator = Validator({"$ref": uri}, registry=registry())
    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '(resource)'}: {e.message[-300:]}"
        for e in map(_deepest, validator.iter_errors(body))
        if not (isinstance(e.instance, str) and e.instance.startswith("["))
    ]
    found += [f"{p}: not declared by the schema" for p in undeclared(body, {"$ref": uri}, uri)]
    return [
        p
        for p in found
        if not any(kind == resource["type"] and rule.match(p) for kind, rule, _ in SCHEMA_GAPS)
    ]
