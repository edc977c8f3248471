"""The retrain flow's steps, declared once: their names, order, what each waits for and when a
step runs only on some runs.

``flows/retrain.py`` runs them in this order (a run's summary lists its step records in it);
``bench/pipeline.py`` reads the graph for its critical path; the README's listing and
docs/pipeline.md's sections are checked against it (tests/flows/test_steps.py). The tasks name
themselves (``@step("stage-data")``, ``tasks/``), and the same test checks every task's name is
a step here and every step a task's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlowStep:
    name: str
    after: tuple[str, ...]  # the steps it waits for, on the local target
    when: str = ""  # the config field that makes the step run; empty: every run that gets there


STEPS: tuple[FlowStep, ...] = (
    FlowStep("validate-data", ()),
    FlowStep("follow-champion", ("validate-data",), when="training.follow_champion"),
    # Unset epochs, input size and patience, fitted to the gate's image counts and sizes.
    FlowStep("fit-to-data", ("follow-champion",)),
    FlowStep("resolve-init-from", ("fit-to-data",), when="training.init_from"),
    FlowStep("check-up-to-date", ("resolve-init-from",)),
    FlowStep("upload-scripts", ("check-up-to-date",)),
    # On Azure staging is a Batch task on the pool: it also waits for the pool and the scripts.
    FlowStep("stage-data", ("check-up-to-date",)),
    FlowStep("build-image", ("check-up-to-date",)),
    FlowStep("ensure-pool", ("check-up-to-date",)),
    # The local cluster trains on this machine's files: training does not wait for the image,
    # whose build ends before the report; Batch runs the task in it.
    FlowStep("run-training", ("upload-scripts", "stage-data", "ensure-pool")),
    FlowStep("collect-and-score", ("run-training",)),
    FlowStep("promote", ("collect-and-score",)),
    FlowStep("release-pool", ("promote",)),  # in a finally, and in the crash and cancel hooks
    FlowStep("report", ("release-pool", "build-image")),
)
NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)
# The steps of every run that trains (the others run when their config field asks).
ALWAYS: tuple[str, ...] = tuple(s.name for s in STEPS if not s.when)
# They run side by side once the run is known to train.
CONCURRENT: tuple[str, ...] = ("upload-scripts", "stage-data", "build-image", "ensure-pool")


def graph(ran: set[str] | None = None) -> dict[str, list[str]]:
    """Each step that ran and the steps that ran that it waited for, in the steps' order: a
    step that did not run (one of those ``when`` decides) passes its wait on to the steps it
    waited for. ``ran`` None: every step."""
    by_name = {s.name: s for s in STEPS}
    kept = set(NAMES) if ran is None else ran

    def waits(name: str) -> list[str]:
        found: list[str] = []
        for before in by_name[name].after:
            for step in [before] if before in kept else waits(before):
                if step not in found:
                    found.append(step)
        return found

    return {s.name: waits(s.name) for s in STEPS if s.name in kept}
