"""The README and the docs pages point at things that exist: every relative link's file and
heading, every `make` target, `python -m` module, option and project file they name. A page that
names a flag, a target or a page that is gone sends a reader nowhere, and nothing else would
notice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


# The project's commands as the pages write them: `python -m MODULE ...`, `torchrun ... -m MODULE
# ...` or `python scripts/X.py ...`, to the end of the line or of the shell command (a `|` stays:
# the pages write alternatives with it, `--model cnn|resnet18`, and pipe no command).
COMMAND = re.compile(
    r"(?:\bpython3?|\btorchrun\b[^`\n]*?) (?:-m ([A-Za-z_][\w.]*\w)|(scripts/\w+\.py))([^`;&#\n]*)"
)
OPTION = re.compile(r"--[a-z][\w-]*")
SUBCOMMANDS = {
    "cli.models": {"list", "download", "serve"},
    "cli.data": {"upload"},
    "cli.prices": {"refresh", "show"},
}
# Run in a process of its own: each command's --help as `python -m` would print it, without a
# process per command (importing torch and Prefect once).
HELP = """
import contextlib, io, json, runpy, sys, traceback
helps = {}
for key in json.loads(sys.argv[1]):
    module, script, sub = key.split("|")
    sys.argv = [module or script, *([sub] if sub else []), "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
        except Exception:
            traceback.print_exc()
    helps[key] = out.getvalue()
print(json.dumps(helps))
"""


def named_options() -> dict[str, set[str]]:
    """Each project command the pages name (``module|script|subcommand``), with every option
    given to it and where: ``--set training.extra_args=[--fp16-allreduce]`` gives ``--set``."""
    folders = {d.name for d in ROOT.iterdir() if d.is_dir()}
    named: dict[str, set[str]] = {}
    for page in LINKED:
        code = re.sub(r"\\\n\s*", " ", commands(page.read_text()))  # continued lines joined
        for module, script, rest in COMMAND.findall(code):
            if (module and module.split(".")[0] not in folders) or rest.startswith("."):
                continue  # another project's module, or a pattern (`python -m bench.<name>`)
            words = [w.lstrip("[(") for w in rest.split()]
            sub = next((w for w in words if w in SUBCOMMANDS.get(module, ())), "")
            options = {m.group() for w in words if (m := OPTION.match(w))}
            named.setdefault(f"{module}|{script}|{sub}", set()).update(
                f"{o} ({page.relative_to(ROOT)})" for o in options
            )
    return named


@pytest.mark.processes
def test_every_option_named_is_one_its_command_takes() -> None:
    named = named_options()
    keys = sorted(set(named) | {f"{k.split('|')[0]}|{k.split('|')[1]}|" for k in named})
    done = subprocess.run(
        [sys.executable, "-c", HELP, json.dumps(keys)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    helps = json.loads(done.stdout)
    missing = []
    for key, options in sorted(named.items()):
        # A subcommand's help leaves out the options given before it (`--config`).
        text = helps[key] + helps[f"{key.split('|')[0]}|{key.split('|')[1]}|"]
        assert "usage:" in text, f"{key}: no help: {text[-500:]}"
        for option in sorted(options):
            flag = option.split()[0]
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                missing.append(f"{key.strip('|').replace('|', ' ')}: {option}")
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
