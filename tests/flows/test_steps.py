"""The flow's steps have one source, flows/steps.py: the tasks' names, the README's listing and
docs/pipeline.md's sections are checked against it (the e2e flow test checks a real run's
order: tests/flows/test_retrain_local.py)."""

from __future__ import annotations

import ast
import re

from flows.steps import ALWAYS, CONCURRENT, NAMES, STEPS, graph
from tests.conftest import ROOT

OTHER_TASKS = ["label-images"]  # the labelling flow's task (flows/label.py)


def _task_names() -> list[str]:
    """The names of tasks/'s steps (``@step("...")``) and tasks named the same way
    (``@task(name="...")``), read from the source."""
    names: list[str] = []
    for path in sorted((ROOT / "tasks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if not isinstance(deco, ast.Call) or not isinstance(deco.func, ast.Name):
                    continue
                if deco.func.id == "step" and deco.args:
                    names.append(ast.literal_eval(deco.args[0]))
                for keyword in deco.keywords if deco.func.id == "task" else ():
                    if keyword.arg == "name":
                        names.append(ast.literal_eval(keyword.value))
    return names


def test_every_step_is_a_task_and_every_task_step_is_declared() -> None:
    names = _task_names()
    assert set(NAMES) <= set(names)
    # Nothing else in tasks/ is named like a step but is none.
    assert sorted(set(names) - set(NAMES)) == OTHER_TASKS
    assert len(NAMES) == len(set(NAMES))
    for step in STEPS:  # each waits only for steps declared before it
        assert all(NAMES.index(b) < NAMES.index(step.name) for b in step.after), step


def test_the_readme_lists_the_steps_in_order_twice() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("One flow run:\n\n```\n", 1)[1].split("```", 1)[0]
    drawn = [
        m[1]
        for m in (
            re.match(r"^(?:finally: |\s+[├└]─ )?([a-z][a-z-]*) ", x) for x in block.splitlines()
        )
        if m
    ]
    assert drawn == list(NAMES)
    numbered = re.findall(r"^(\d+)\. \*\*([a-z-]+)\*\*", readme, re.MULTILINE)
    assert numbered == [(str(i), name) for i, name in enumerate(NAMES, 1)]
    first, last = (NAMES.index(n) + 1 for n in (CONCURRENT[0], CONCURRENT[-1]))
    assert f"Steps {first} to {last} run concurrently" in readme
    assert list(CONCURRENT) == list(NAMES[first - 1 : last])


def test_docs_pipeline_has_a_section_per_step_numbered_in_order() -> None:
    page = (ROOT / "docs" / "pipeline.md").read_text()
    found: list[tuple[int, str]] = []
    for m in re.finditer(r"^## (\d+)(?:-(\d+))?\. (.+?)(?: \(concurrently\))?$", page, re.M):
        names = m[3].split(", ")
        assert int(m[2] or m[1]) - int(m[1]) + 1 == len(names), m[0]
        found += [(int(m[1]) + i, name) for i, name in enumerate(names)]
    assert found == list(enumerate(NAMES, 1))


def test_a_step_that_did_not_run_passes_its_wait_on() -> None:
    every = graph()
    assert every["check-up-to-date"] == ["resolve-init-from"]
    trained = graph(set(ALWAYS))
    assert list(trained) == list(ALWAYS)
    assert trained["check-up-to-date"] == ["fit-to-data"]
    assert trained["fit-to-data"] == ["validate-data"]
    assert trained["report"] == ["release-pool", "build-image"]
    followed = graph({*ALWAYS, "follow-champion"})
    assert followed["fit-to-data"] == ["follow-champion"]
    started = graph({*ALWAYS, "resolve-init-from"})
    assert started["check-up-to-date"] == ["resolve-init-from"]
    assert started["resolve-init-from"] == ["fit-to-data"]
