"""The README and the docs pages point at things that exist: every relative link's file and
heading, every `make` target, `python -m` module and project file they name. A page that names
a flag, a target or a page that is gone sends a reader nowhere, and nothing else would notice."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# reliability.md (written by `make reliability`) quotes hostile Markdown as its tests wrote it.
LINKED = [p for p in PAGES if p.name != "reliability.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
MAKE = re.compile(r"(?<![\w-])make ([a-z][a-z-]*)")
INLINE_CODE = re.compile(r"`([^`]+)`")
MODULE = re.compile(r"python -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def commands(text: str) -> str:
    """The code of a page, where commands are: fenced blocks and inline code spans."""
    code, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):  # a fenced or an indented block
            code.append(line)
        else:
            prose.append(line)
    return "\n".join(code + INLINE_CODE.findall("\n".join(prose)))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no {os.path.relpath(linked, ROOT)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(linked, ROOT)}")
    return broken


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, flags=re.M))


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_relative_link_reaches_a_file_and_heading() -> None:
    broken = [f"{p.relative_to(ROOT)}: {b}" for p in LINKED for b in broken_links(p)]
    assert not broken, "\n".join(broken)


def test_every_make_target_named_exists() -> None:
    targets = make_targets()
    named = {(p.relative_to(ROOT), t) for p in PAGES for t in MAKE.findall(commands(p.read_text()))}
    missing = sorted(f"{page}: make {t}" for page, t in named if t not in targets)
    assert not missing, "\n".join(missing)


def test_every_python_module_named_exists() -> None:
    named = {
        (p.relative_to(ROOT), m) for p in PAGES for m in MODULE.findall(commands(p.read_text()))
    }
    missing = sorted(
        f"{page}: python -m {m}"
        for page, m in named
        if m.split(".")[0] in {d.name for d in ROOT.iterdir() if d.is_dir()}
        and not module_exists(m)
    )
    assert not missing, "\n".join(missing)


# Made by a command the pages name (`make azure-config`), not shipped.
CREATED = {"configs/azure.yaml"}


def test_every_file_named_in_code_exists() -> None:
    folders = sorted(d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith("."))
    path = re.compile(rf"(?<![\w./<-])((?:{'|'.join(folders)})/[\w./-]*\w)")
    missing = sorted(
        f"{p.relative_to(ROOT)}: {name}"
        for p in PAGES
        for name in set(path.findall(commands(p.read_text())))
        if name not in CREATED and not (ROOT / name).exists()
    )
    assert not missing, "\n".join(missing)


def test_the_readme_names_the_two_commands_and_fits_on_a_few_screens() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert len(readme.splitlines()) <= 300
