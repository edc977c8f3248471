"""The first demo's time line (bench/demo.py), read from the demo's own log lines, and its
section of docs/performance.md."""

from __future__ import annotations

from bench.demo import timeline
from bench.report import demo

LOG = """\
seeded 1797 new or changed images into training-data/digits/v1 (data version v1)
23:59:50.000 | INFO    | Flow run 'fast-owl' - Beginning flow run 'fast-owl' for flow 'retrain'
23:59:58.500 | INFO    | Task run 'validate-data-1a2' - Finished in state Completed()
00:01:00.250 | INFO    | Task run 'run-training-3b4' - [0]<stdout>:PROGRESS {"epoch": 1}
00:01:10.000 | INFO    | Task run 'run-training-3b4' - Finished in state Completed()
00:01:30.000 | INFO    | Task run 'collect-and-score-5c6' - Finished in state Completed()
00:01:31.000 | INFO    | Task run 'promote-7d8' - Finished in state Completed()
00:09:50.000 | INFO    | Task run 'build-image-9e0' - Finished in state Completed()
00:09:55.000 | INFO    | Task run 'report-f01' - Finished in state Completed()
00:09:56.000 | INFO    | Flow run 'fast-owl' - Finished in state Completed()
demo finished in 640s; Azurite stopped
"""


def test_the_time_line_places_each_step_against_the_flow_runs_start() -> None:
    """Past midnight included: each end is seconds after 'Beginning flow run'."""
    assert timeline(LOG) == {
        "training_end": 80.0,
        "scored": 100.0,
        "promoted": 101.0,
        "image_end": 600.0,
        "report_end": 605.0,
        "flow_end": 606.0,
        "total": 640.0,
    }


def test_the_section_shows_each_run_and_what_waited_for_the_build() -> None:
    run = {"exit_code": 0, **timeline(LOG)}
    before = {**run, "scored": 620.0, "promoted": 621.0, "report_end": 625.0, "flow_end": 626.0}
    section = "\n".join(
        demo(
            {
                "method": "m",
                "load_average": 2.0,
                "runs": {"baseline abc": before, "this checkout": run},
            }
        )
    )
    assert "| promotion ended | 621 | 101 |" in section
    assert "baseline abc: the model was promoted 541 s after training ended" in section
    assert "this checkout: the model was promoted 21 s after training ended" in section
    assert "the flow run 6 s after the build" in section
