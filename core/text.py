"""Stored text shown to people: blob names, data prefixes, class names, what a record says.

Such text is written by whoever can write to the storage account, not by the pipeline, so where
it is shown it must read as the characters it holds: on a terminal (no escape sequence moves the
cursor or forges a line) and in a Markdown artifact (no link, image, table cell or heading made
of a blob's name: ``![x](https://tracker/p.png)`` uploaded as a file name made the Prefect UI
fetch an image from another host each time the run's gate report was opened).
"""

from __future__ import annotations

# Characters that can open or close Markdown's emphasis, code, links, images, raw HTML, entities,
# table cells, strikethrough or math wherever they stand (CommonMark lets any ASCII punctuation
# be escaped with a backslash). ``_`` does so only at a word's edge, and ``#``, ``+``, ``-``,
# ``.`` only at a line's start, where escaped text never stands; autolinks are broken apart.
_MARKDOWN_SPECIAL = frozenset("\\`*[]<>!|~$&")


def printable(text: str) -> str:
    """``text`` with its control characters (escape, carriage return, newline, NUL...) written
    as Python escapes (``\\x1b``, ``\\r``, ``\\n``)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def markdown_text(text: object) -> str:
    """``text`` as inline Markdown that shows exactly these characters: control characters
    escaped as in :func:`printable` (a newline would end a table row), then each character
    Markdown would read as syntax backslash-escaped, and ``://`` and ``www.`` broken so that no
    address in a name becomes a link."""
    shown = printable(str(text))
    out = []
    for i, c in enumerate(shown):
        before = shown[i - 1] if i else " "
        after = shown[i + 1] if i + 1 < len(shown) else " "
        edge = c == "_" and not (before.isalnum() and after.isalnum())
        link = (c == ":" and shown.startswith("//", i + 1)) or (
            c == "." and shown[max(0, i - 3) : i].lower() == "www"
        )
        out.append(f"\\{c}" if c in _MARKDOWN_SPECIAL or edge or link else c)
    return "".join(out)


def code_fence(text: str, info: str = "") -> list[str]:
    """``text`` as a fenced code block whose fence no line of it can close: one backtick more
    than the longest run of backticks in it (three at least)."""
    longest, run = 0, 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{info}", text, fence]
