"""A record nested too deep is refused before the JSON parser recurses into it."""

from __future__ import annotations

import json

import pytest

from registry.record_blob import MAX_NESTING, json_object


def test_a_deep_record_is_refused_before_the_parser_recurses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[bytes] = []
    loads = json.loads

    def recording(data: bytes) -> object:
        parsed.append(data)
        return loads(data)

    monkeypatch.setattr(json, "loads", recording)
    deep = b'{"a": ' * 1200 + b"1" + b"}" * 1200
    assert json_object(deep, 1 << 20) == "nested too deep to read"
    assert parsed == []  # a RecursionError deep in the stack breaks what runs there with it


def test_brackets_inside_strings_do_not_count_and_the_limit_is_exact() -> None:
    text = {"name": "[[[{{{" * 100 + '\\"]', "ok": [1, 2]}
    assert json_object(json.dumps(text).encode(), 1 << 20) == text
    at_limit = b"[" * MAX_NESTING + b"]" * MAX_NESTING
    assert json_object(b'{"x": ' + at_limit[1:-1] + b"}", 1 << 20) != "nested too deep to read"
    over = b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1)
    assert json_object(b'{"x": ' + over + b"}", 1 << 20) == "nested too deep to read"
