"""Check a JSON body against vendored OpenAPI (Swagger 2.0) definitions, the way a strict service
does: unknown or read-only properties, missing required ones, wrong types, enum values (exact
spelling), patterns, formats (ISO 8601 durations, date-times, ARM ids), the subtype a
discriminator names, and the limits a spec states only in its descriptions
(``x-documented-limits`` in the vendored file, each with the sentence it comes from).

Generic on purpose: the fakes name a definition and this walks it, so a property the project
misspells is refused whichever request carries it. Problems carry Batch's error vocabulary
(``UnsupportedProperty``, ``MissingRequiredProperty``, ``InvalidPropertyValue``); other fakes map
them to their own service's error shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

SPEC_DIR = Path(__file__).parent / "spec"

_DURATION = re.compile(
    r"^P(?!$)(?:(?P<d>\d+)D)?(?:T(?=\d)(?:(?P<h>\d+)H)?(?:(?P<m>\d+)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$"
)
_INT32 = (-(2**31), 2**31 - 1)


def parse_duration(text: str) -> timedelta | None:
    """ISO 8601 days/hours/minutes/seconds, as Batch serializes them (``PT05M00S``, ``P2D``)."""
    match = _DURATION.match(text)
    if match is None:
        return None
    parts = {k: float(v) for k, v in match.groupdict().items() if v}
    return timedelta(
        days=parts.get("d", 0),
        hours=parts.get("h", 0),
        minutes=parts.get("m", 0),
        seconds=parts.get("s", 0),
    )


@dataclass(frozen=True)
class Problem:
    code: str  # UnsupportedProperty | MissingRequiredProperty | InvalidPropertyValue
    path: str  # dotted path in the body, e.g. outputFiles[0].uploadOptions.uploadCondition
    value: Any
    reason: str

    @property
    def name(self) -> str:
        """The property's own name (what Batch reports as PropertyName)."""
        leaf = self.path.rsplit(".", 1)[-1]
        return leaf.split("[", 1)[0]

    def __str__(self) -> str:
        return f"{self.code} at {self.path or '(body)'}: {self.reason}"


class Schema:
    """The definitions of one vendored spec file."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.definitions: dict[str, Any] = doc["definitions"]
        self.omitted = set(doc.get("x-omitted", []))
        limits = doc.get("x-documented-limits", {})
        self.duration_limits: dict[str, dict[str, str]] = limits.get("durations", {})
        ids = limits.get("ids", {})
        self.id_pattern = re.compile(ids["pattern"]) if ids else None
        self.id_definitions = set(ids.get("definitions", []))
        self.source = doc.get("x-vendored-from", {})

    @classmethod
    def load(cls, name: str) -> Schema:
        return cls(json.loads((SPEC_DIR / name).read_text()))

    def check(self, body: Any, definition: str, *, request: bool = True) -> list[Problem]:
        """Every problem in ``body`` as an instance of ``definition``; empty when it conforms.

        ``request`` refuses read-only properties (a client may not send them); responses may
        carry them."""
        problems: list[Problem] = []
        self._walk(body, {"$ref": f"#/definitions/{definition}"}, "", request, problems)
        return problems

    # -- the walk ---------------------------------------------------------------------------------
    def _resolve(self, schema: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
        ref = schema.get("$ref")
        if ref is None:
            return None, schema
        name = ref.rsplit("/", 1)[-1]
        return name, self.definitions.get(name)

    def _merged(self, name: str | None, schema: dict[str, Any]) -> dict[str, Any]:
        """A definition with its ``allOf`` parents folded in (properties and required)."""
        properties = dict(schema.get("properties", {}))
        required = list(schema.get("required", []))
        for parent in schema.get("allOf", []):
            pname, pschema = self._resolve(parent)
            if pschema is None:
                continue
            merged = self._merged(pname, pschema)
            properties = {**merged.get("properties", {}), **properties}
            required += merged.get("required", [])
        return {**schema, "properties": properties, "required": required}

    def _walk(
        self, value: Any, schema: dict[str, Any], path: str, request: bool, out: list[Problem]
    ) -> None:
        name, resolved = self._resolve(schema)
        if resolved is None:
            reason = (
                f"{name} is not modelled by this fake (x-omitted in the vendored spec)"
                if name in self.omitted
                else f"{name} is not a definition of the vendored spec"
            )
            out.append(Problem("UnsupportedProperty", path, value, reason))
            return
        if value is None:
            out.append(Problem("InvalidPropertyValue", path, value, "null is not a value"))
            return
        name, resolved = self._subtype(name, resolved, value)
        kind = resolved.get("type", "object" if "properties" in resolved else None)
        if kind == "object":
            self._object(value, name, resolved, path, request, out)
        elif kind == "array":
            if not isinstance(value, list):
                out.append(Problem("InvalidPropertyValue", path, value, "expected an array"))
                return
            for i, item in enumerate(value):
                self._walk(item, resolved["items"], f"{path}[{i}]", request, out)
        else:
            self._scalar(value, kind, resolved, path, out)

    def _subtype(
        self, name: str | None, schema: dict[str, Any], value: Any
    ) -> tuple[str | None, dict[str, Any]]:
        """A polymorphic definition (``discriminator``) is checked as the vendored subtype whose
        ``x-ms-discriminator-value`` the body names, as the service reads it; with none vendored,
        as the base, so a subtype's own properties are refused."""
        prop = schema.get("discriminator")
        if prop is None or not isinstance(value, dict):
            return name, schema
        for sub, subschema in self.definitions.items():
            parents = {p.get("$ref", "").rsplit("/", 1)[-1] for p in subschema.get("allOf", [])}
            if name in parents and subschema.get("x-ms-discriminator-value") == value.get(prop):
                return sub, subschema
        return name, schema

    def _discriminator(self, schema: dict[str, Any]) -> str:
        """The property a subtype's ``x-ms-discriminator-value`` is read from: its parent's
        ``discriminator`` (``type`` where the parent is not vendored or names none)."""
        for parent in schema.get("allOf", []):
            _, pschema = self._resolve(parent)
            if pschema is not None and "discriminator" in pschema:
                return str(pschema["discriminator"])
        return "type"

    def _object(
        self,
        value: Any,
        name: str | None,
        schema: dict[str, Any],
        path: str,
        request: bool,
        out: list[Problem],
    ) -> None:
        if not isinstance(value, dict):
            out.append(Problem("InvalidPropertyValue", path, value, "expected an object"))
            return
        schema = self._merged(name, schema)
        properties: dict[str, Any] = schema["properties"]
        extra = schema.get("additionalProperties")
        prefix = f"{path}." if path else ""
        for key in schema["required"]:
            secret = properties.get(key, {}).get("format") == "password"
            if key not in value and (request or not secret):  # secrets are never read back
                out.append(
                    Problem("MissingRequiredProperty", prefix + key, None, f"{key} is required")
                )
        discriminator = schema.get("x-ms-discriminator-value")
        field = self._discriminator(schema)
        if discriminator is not None and value.get(field) != discriminator:
            out.append(
                Problem(
                    "InvalidPropertyValue",
                    prefix + field,
                    value.get(field),
                    f"{field} must be {discriminator!r} for {name}",
                )
            )
        for key, item in value.items():
            child = prefix + key
            if key in properties:
                prop = properties[key]
                if request and prop.get("readOnly"):
                    out.append(Problem("UnsupportedProperty", child, item, f"{key} is read-only"))
                    continue
                self._walk(item, prop, child, request, out)
                self._documented_limits(name, key, item, child, out)
            elif isinstance(extra, dict):
                self._walk(item, extra, child, request, out)
            else:
                known = ", ".join(sorted(properties)) or "none"
                out.append(
                    Problem(
                        "UnsupportedProperty",
                        child,
                        item,
                        f"{name} has no property {key!r} (known: {known})",
                    )
                )
        given_id = value.get("id")
        checked = self.id_pattern is not None and name in self.id_definitions
        if checked and isinstance(given_id, str) and not self.id_pattern.match(given_id):  # type: ignore[union-attr]
            out.append(
                Problem(
                    "InvalidPropertyValue",
                    prefix + "id",
                    given_id,
                    "ids are 1-64 letters, digits, hyphens or underscores",
                )
            )

    def _documented_limits(
        self, name: str | None, key: str, value: Any, path: str, out: list[Problem]
    ) -> None:
        limits = self.duration_limits.get(f"{name}.{key}")
        if not limits or not isinstance(value, str):
            return
        given = parse_duration(value)
        if given is None:
            return  # already reported as a malformed duration
        low = parse_duration(limits.get("minimum", "PT0S"))
        high = parse_duration(limits["maximum"]) if "maximum" in limits else None
        if (low is not None and given < low) or (high is not None and given > high):
            bounds = f"at least {limits.get('minimum')}" + (
                f" and at most {limits['maximum']}" if high is not None else ""
            )
            out.append(
                Problem("InvalidPropertyValue", path, value, f"{key} must be {bounds}: {value}")
            )

    @staticmethod
    def _scalar(
        value: Any, kind: str | None, schema: dict[str, Any], path: str, out: list[Problem]
    ) -> None:
        def bad(reason: str) -> None:
            out.append(Problem("InvalidPropertyValue", path, value, reason))

        fmt = schema.get("format")
        if kind == "string":
            if not isinstance(value, str):
                bad("expected a string")
                return
            enum = schema.get("enum")
            pattern = schema.get("pattern")
            if enum is not None and value not in enum:
                bad(f"{value!r} is not one of {enum}")
            elif pattern is not None and re.search(pattern, value) is None:
                bad(f"{value!r} does not match {pattern}")
            elif fmt == "duration" and parse_duration(value) is None:
                bad(f"{value!r} is not an ISO 8601 duration")
            elif fmt == "date-time":
                try:
                    datetime.fromisoformat(value.replace("Z", "+00:00"))
                except ValueError:
                    bad(f"{value!r} is not an ISO 8601 date-time")
            elif fmt == "arm-id" and not value.lower().startswith("/subscriptions/"):
                bad(f"{value!r} is not an Azure Resource Manager id")
            elif fmt == "uri" and (not value or any(c.isspace() for c in value)):
                bad(f"{value!r} is not a URL")
            elif fmt == "int64" and not re.fullmatch(r"-?\d+", value):
                bad(f"{value!r} is not an int64 string")
        elif kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                bad("expected an integer")
                return
            low, high = _INT32 if fmt == "int32" else (None, None)
            low = schema.get("minimum", low)
            high = schema.get("maximum", high)
            if (low is not None and value < low) or (high is not None and value > high):
                bad(f"{value} is outside [{low}, {high}]")
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad("expected a number")
        elif kind == "boolean" and not isinstance(value, bool):
            bad("expected true or false")
