"""What runs leave in the NFS folder's checkpoints/: one folder per training key and per forced
run was never removed (about 0.6 GB each for a ResNet-50). The policy is in
training/checkpoint.py; the unit cases in tests/training/test_checkpoint.py. Recorded for
docs/reliability.md ("Adversarial inputs")."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.retrain import retrain
from imagedata.make_images import write_digits
from tests.pipeline_helpers import make_config, seed
from tests.reliability import report
from training.checkpoint import FINISHED

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


# tests/flows/test_retrain_local.py's end-to-end runs check the same in `make test` (its last
# runs are a training and a forced one); here in two runs of its own, for docs/reliability.md.
@pytest.mark.slow
def test_a_run_and_a_forced_run_leave_one_checkpoint_folder(tmp_path: Path) -> None:
    """A run, then a forced run (a key of its own: it never resumes another's checkpoints):
    the first one's folder, whose training finished, goes when the second trains; what the
    second trained stays until the next training (a re-run after a failure resumes it)."""
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=14)
    config = make_config(tmp_path, "training.epochs=1", "pool.processes_per_node=1")
    seed(config, source)
    checkpoints = config.nfs.local_dir / "checkpoints"
    keys = []
    for force in (False, True):
        state = retrain(config=config, force=force, return_state=True)
        assert state.is_completed(), state.message
        training = next(s for s in state.result()["steps"] if s["step"] == "run-training")
        keys.append(training["details"]["checkpoint_key"])
    left = sorted(p.name for p in checkpoints.iterdir())
    assert left == [keys[1]], f"checkpoint folders left: {left} (keys trained: {keys})"
    assert (checkpoints / keys[1] / FINISHED).is_file()
    report.record(
        "adversarial",
        "checkpoint folders after a run and a forced run on one NFS folder",
        "1 left (the last training's); the finished one removed by the next training; "
        "unfinished ones kept nfs.checkpoint_days (7) for a re-run to resume",
        folders_before_fix=2,
    )
