"""What the up-to-date check trusts, under writers and code changes that fooled it.

The check compares a fingerprint: the gate's listing (each blob's name, size, ETag and
Content-MD5), the code the nodes run and the training task it is started with, the image, the
settings that shape the model and the world size. A blob rewritten with its old Content-MD5 kept
(Put Block List stores whatever MD5 its writer sends) made a run "up to date", and staging,
which skipped by MD5, trained the old bytes even when forced; a change in backends/taskspec.py
that changed the trainer's arguments was not in the fingerprint; toggling the timeline, which
changes no weight, retrained an identical model; two runs of one new version, the second waiting
for the first's pool, trained it twice (the first released the pool before its record)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from azure.storage.blob import BlobBlock, ContainerClient, ContentSettings

from core.config import load_config
from staging.blob import list_pinned
from staging.listing import listing_version
from staging.sync import sync_to_directory
from staging.transfer import IntegrityError
from tests.conftest import ROOT, child_env
from tests.pipeline_helpers import new_container
from tests.reliability import report

BLOB = "images/v1/train/0/a.png"


def _md5(data: bytes) -> bytearray:
    return bytearray(hashlib.md5(data, usedforsecurity=False).digest())


def _rewrite_keeping_md5(container: ContainerClient, name: str, data: bytes, md5: bytes) -> None:
    """What a copy tool or a script that sets properties does: the new bytes in blocks, then
    Put Block List with the old Content-MD5 (stored as sent, never checked by the service)."""
    blob = container.get_blob_client(name)
    blob.stage_block("b0", data)
    blob.commit_block_list(
        [BlobBlock("b0")], content_settings=ContentSettings(content_md5=bytearray(md5))
    )


def test_a_blob_rewritten_with_its_old_md5_is_new_data_and_is_not_skipped(
    azurite: str, tmp_path: Path
) -> None:
    container = new_container(azurite, "rewrite")
    old, new = b"\x89PNG old picture ...", b"\x89PNG new picture ..."
    assert len(old) == len(new)
    container.upload_blob(BLOB, old)
    before = list_pinned(container, "images/v1")
    dest = tmp_path / "nfs" / "data"
    sync_to_directory(container, "images/v1", dest, listing=before)
    assert (dest / "train/0/a.png").read_bytes() == old

    _rewrite_keeping_md5(container, BLOB, new, _md5(old))
    after = list_pinned(container, "images/v1")
    assert [b.md5 for b in after] == [b.md5 for b in before]  # the MD5 says "unchanged"
    assert [b.etag for b in after] != [b.etag for b in before]  # every write has a new ETag
    # The gate's data version: a new one, so the run trains instead of ending up to date.
    assert listing_version(after) != listing_version(before)

    # Staging fetches it again (its ETag changed) and finds that its bytes do not match the MD5
    # stored for them: the run fails naming the blob, instead of training the old bytes.
    with pytest.raises(IntegrityError, match=BLOB):
        sync_to_directory(container, "images/v1", dest, listing=after)
    report.record(
        "adversarial",
        "a training image rewritten with its old Content-MD5 kept (Put Block List)",
        "a new data version (its ETag is in the gate's listing digest); staging downloads it "
        "again and fails naming the blob whose bytes do not match its stored MD5",
    )


def test_a_blob_written_again_with_its_own_md5_is_staged_again(
    azurite: str, tmp_path: Path
) -> None:
    """The honest rewrite: new bytes, their own MD5. Staging replaces the file."""
    container = new_container(azurite, "rewrite")
    container.upload_blob(BLOB, b"first version")
    dest = tmp_path / "data"
    sync_to_directory(container, "images/v1", dest, listing=list_pinned(container, "images/v1"))
    container.upload_blob(BLOB, b"other version", overwrite=True)
    report_ = sync_to_directory(
        container, "images/v1", dest, listing=list_pinned(container, "images/v1")
    )
    assert report_.downloaded == [BLOB]
    assert (dest / "train/0/a.png").read_bytes() == b"other version"


FINGERPRINT = """
import json
from core.config import load_config
from tasks.train_and_score import training_key
from tasks.up_to_date import fingerprint

config = load_config("configs/local.yaml")
current = fingerprint(config, "listing")
print(json.dumps({"fingerprint": current, "key": training_key(config, "staged", "code")}))
"""


def _fingerprint(tree: Path) -> dict[str, object]:
    import json

    env = {**child_env(), "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", FINGERPRINT],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_a_change_in_what_the_nodes_run_is_a_new_fingerprint(tmp_path: Path) -> None:
    """A copy of the project, fingerprinted before and after an edit of backends/taskspec.py
    that gives the trainer one more argument, as a code change would."""
    tree = tmp_path / "project"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, files.split("\0")):
        source = ROOT / rel
        if source.is_file() and not source.is_symlink():
            target = tree / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            os.chmod(target, source.stat().st_mode & 0o777)
    before = _fingerprint(tree)
    spec = tree / "backends" / "taskspec.py"
    text = spec.read_text()
    owned = '        "--prune-checkpoint-folders",\n'
    added = '        "--backward-passes-per-step",\n        "2",\n'
    edited = text.replace(owned, added + owned, 1)
    assert edited != text
    spec.write_text(edited)
    after = _fingerprint(tree)

    old, new = before["fingerprint"], after["fingerprint"]
    assert isinstance(old, dict) and isinstance(new, dict)
    assert [name for name in old if old[name] != new.get(name)] == ["task"]
    assert before["key"] != after["key"]  # no checkpoint of the other command line is resumed
    report.record(
        "adversarial",
        "backends/taskspec.py edited to give the trainer one more argument",
        "a new fingerprint (its training task) and checkpoint key: the run trains",
    )


def test_toggling_the_timeline_trains_nothing_new() -> None:
    from tasks.up_to_date import differences, fingerprint

    on = load_config(ROOT / "configs" / "local.yaml", ["training.timeline=true"])
    off = load_config(ROOT / "configs" / "local.yaml", ["training.timeline=false"])
    assert fingerprint(on, "listing") == fingerprint(off, "listing")
    other = load_config(ROOT / "configs" / "local.yaml", ["training.epochs=2"])
    changed = differences(fingerprint(on, "listing"), fingerprint(other, "listing"))
    assert changed == ["training.epochs None -> 2"]  # the task's command line is named by it
    report.record(
        "adversarial",
        "training.timeline toggled, nothing else changed",
        "up to date (a timeline changes no weight); a changed setting is named alone",
    )


def _flow_process(config_file: Path, azurite: str) -> subprocess.Popen[str]:
    """``python -m flows.retrain`` against the session's Prefect server, as a nightly or a
    trigger's worker starts a run."""
    from tests.conftest import prefect_api_env

    env = {**child_env(), **prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    return subprocess.Popen(
        [sys.executable, "-m", "flows.retrain", "--config", str(config_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.usefixtures("prefect_api", "horovodrun")
def test_two_runs_of_one_new_version_train_it_once(
    tmp_path: Path, azurite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nightly and the trigger for one new version, seconds apart: B waits for A's pool.
    Before, A released the pool's lock before writing its last-run record, so B's up-to-date
    check compared with the run before A and trained the same data again."""
    from backends.blob import container_client
    from imagedata.make_images import write_digits
    from registry.store import list_runs
    from tests.pipeline_helpers import make_config, seed

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path, "training.epochs=1")
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.3, seed=0, per_class=20)
    seed(config, source)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    lock = config.work_dir / "pools" / f"{config.pool.id}.lock"

    first = _flow_process(config_file, azurite)
    deadline = time.monotonic() + 300
    while not (lock.exists() and lock.read_text().strip()):  # A holds the pool
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.2)
    second = _flow_process(config_file, azurite)
    out_a, _ = first.communicate(timeout=900)
    out_b, _ = second.communicate(timeout=900)
    assert first.returncode == 0, out_a[-3000:]
    assert second.returncode == 0, out_b[-3000:]
    assert "is in use by" in out_b and "waiting for it" in out_b  # B waited for A

    entries = list_runs(container_client(config.output), "", [config.data.root])
    assert [e.outcome for e in entries] == ["promoted", "up to date"], [e.reason for e in entries]
    assert entries[1].reason == (
        f"nothing trained: the data, code and settings of run {entries[0].run_id}"
    )
    assert entries[1].root == config.data.root.where
    report.record(
        "adversarial",
        "two runs of one new version, the second waiting for the first's pool",
        "one trains; the other, deciding once the first's record is written, is up to date",
    )
