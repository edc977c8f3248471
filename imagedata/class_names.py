"""Class names as every reader takes them: a class folder's name, a shard's ``.cls`` text, a
blob's folder in the gate's listing.

One rule for all, so loose files and shards of one dataset give the same classes, and two
classes never show one name:
- a name is compared and kept in Unicode's composed form (NFC): ``café`` typed on one machine
  and ``café`` (``e`` plus a combining accent) from another are one class;
- white space at either end, and invisible or control characters (Unicode categories Cf and
  Cc: a zero-width space, a direction mark, a byte-order mark, a tab), are refused by name,
  never stripped: ``cat``, ``cat `` and ``cat\\u200b`` would otherwise be three classes that
  read the same, or silently one;
- two folders of a split whose names are one name in two forms are refused, naming both.

Torch-free: the data gate imports it in the orchestrator.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

_HIDDEN = ("Cc", "Cf")


def shown(name: str) -> str:
    """A name as messages print it: every invisible or combining character escaped, so two
    names that read the same print differently."""
    return ascii(name)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a class name (to follow the name in a sentence), or None."""
    if not name:
        return "is empty"
    if name != name.strip():
        return "has white space at an end (never stripped: it would read like another class)"
    hidden = sorted({f"U+{ord(c):04X}" for c in name if unicodedata.category(c) in _HIDDEN})
    if hidden:
        return (
            f"holds invisible or control characters ({', '.join(hidden)}): it would read like "
            "another class"
        )
    return None


def normal(name: str) -> str:
    """The class a name stands for: its NFC form."""
    return unicodedata.normalize("NFC", name)


def folders_problem(names: Iterable[str]) -> str | None:
    """Why a split's class folders (their names) cannot be its classes, or None: a name
    :func:`name_problem` refuses, or two names that are one class (:func:`normal`)."""
    first: dict[str, str] = {}
    for name in names:
        why = name_problem(name)
        if why:
            return f"class folder {shown(name)} {why}"
        other = first.setdefault(normal(name), name)
        if other != name:
            return (
                f"class folders {shown(other)} and {shown(name)} are one name in two Unicode "
                "forms: rename or merge them"
            )
    return None
