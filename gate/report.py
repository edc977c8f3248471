"""What the gate says: a Markdown report of the failed expectations, naming the files behind
each, and the error that stops the run."""

from __future__ import annotations

from typing import Any

from core.text import markdown_text
from gate.manifest import class_counts


class DataValidationError(RuntimeError):
    """The data gate failed; the message lists each failed expectation with its counts."""


def examples(rows: list[dict[str, Any]], record: dict[str, Any]) -> list[str]:
    """File names behind a failed column expectation, so the report points at the data."""
    column = record["column"]
    if record["table"] == "classes" and column.endswith("_images") and record["examples"]:
        # A count alone ("e.g. 0") names nothing: the classes with that count do.
        bad, split = set(record["examples"]), column.removesuffix("_images")
        return [
            f"{c['label']} ({c[column]} {split} images)"
            for c in class_counts(rows)
            if str(c[column]) in bad
        ][:5]
    if record["table"] != "images" or not column or not record["examples"]:
        return record["examples"]
    if column == "problem":  # the sentence itself names the shard or the split
        return [f"{r['path']}: {r['problem']}" for r in rows if r.get("problem")][:5]
    bad = set(record["examples"])
    return [r["path"] for r in rows if _shown(r.get(column)) & bad][:5]


def _shown(value: Any) -> set[str]:
    """How Great Expectations may write ``value`` among a result's examples: a number of a
    column that also holds None is a float there (13000 is "13000.0")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {str(value), str(float(value))}
    return {str(value)}


def gate_markdown(
    success: bool,
    rows: list[dict[str, Any]],
    records: list[dict[str, Any]],
    where: str,
    docs_url: str,
    reused: bool = False,
) -> str:
    """The ``data-gate`` artifact: the verdict, the counts, and a row per failed expectation."""
    failed = [r for r in records if not r["success"]]
    lines = [
        f"# Data gate: {'passed' if success else 'FAILED'}",
        "",
        f"{len(rows)} images under {markdown_text(where)}; "
        f"{len(records) - len(failed)} of {len(records)} expectations met. "
        f"[Open the Data Docs]({docs_url}): every expectation and its result.",
        "",
    ]
    if reused:
        lines += [
            "The same manifest under the same rules was judged before: this is that verdict, "
            "and the Data Docs are that gate's (their run time is its own).",
            "",
        ]
    if not failed:  # an empty table renders as a stray dot: a passed gate says so in words
        return "\n".join([*lines, "Every expectation was met."])
    lines += [
        "| table | expectation | column | unexpected | examples |",
        "|---|---|---|---|---|",
    ]
    for r in failed:
        # File names are the storage's, written by anyone who can upload: shown as written,
        # never as links, images or table cells of their own.
        cells = [r["table"], r["expectation"], r["column"], r["unexpected"]]
        named = ", ".join(markdown_text(e) for e in examples(rows, r))
        lines.append(f"| {' | '.join(markdown_text(c) for c in cells)} | {named} |")
    return "\n".join(lines)


def failure(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> DataValidationError:
    """The error a failed gate raises: each failed expectation, its count, example files."""
    summary = "; ".join(
        f"{r['expectation']}({r['column'] or r['table']}): "
        f"{r['unexpected'] if r['unexpected'] is not None else 'failed'} "
        f"unexpected, e.g. {', '.join(examples(rows, r)) or '-'}"
        for r in records
        if not r["success"]
    )
    return DataValidationError(f"data gate failed, nothing was provisioned: {summary}")
