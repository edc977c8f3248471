"""Two processes on one folder: Azurite's data folder, and the NFS folder of pipelines that
share it. Whatever the second one is (another Azurite, another pipeline with a pool of its
own), it waits or is refused, naming the holder, and nothing the first one stored is lost; a
holder that died never blocks. Recorded for docs/reliability.md ("Adversarial inputs").
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from azure.storage.blob import ContainerClient

from backends.local.azurite import FolderInUseError, running_azurite
from backends.local.ports import free_port
from staging.blob import API_VERSION
from tests.conftest import ROOT, child_env
from tests.reliability import report

# ---------------------------------------------------------------------------- Azurite


def _container(connection_string: str) -> ContainerClient:
    return ContainerClient.from_connection_string(
        connection_string, "kept", api_version=API_VERSION
    )


HOLD_AZURITE = """
import sys, time
from pathlib import Path
from backends.local.azurite import running_azurite
with running_azurite(Path(sys.argv[1])):
    print("serving", flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def _azurite_in_another_process(location: Path) -> Iterator[subprocess.Popen[str]]:
    """A process of its own (and session: its Azurite child goes with a group kill) running
    Azurite on ``location`` until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_AZURITE, str(location)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
        yield proc
    finally:
        # The whole session: an Azurite whose starter was killed is still in it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.processes
def test_a_second_azurite_on_one_data_folder_is_refused_and_no_blob_is_lost(
    tmp_path: Path,
) -> None:
    """``make azurite`` runs; ``make demo`` (or a second ``make azurite`` on another port)
    starts on the same folder. It must be refused, naming the folder and the running one: two
    Azurites on one folder overwrite each other's blob index, and the blobs written through the
    first were gone once both had stopped."""
    location = tmp_path / "demo" / "azurite"
    with running_azurite(location) as first:
        container = _container(first)
        container.create_container()
        container.upload_blob("images/0.png", b"written through the first Azurite")
        spelled = tmp_path / "demo" / ".." / "demo" / "azurite"  # another spelling, one folder
        with pytest.raises(FolderInUseError) as refused, running_azurite(spelled):
            pass
        message = str(refused.value)
        assert str(location) in message and f"started by pid {os.getpid()}" in message
        # The user's spelling of it: `make azurite` (scripts/demo.py --serve-storage) on the
        # folder, another port.
        cli = subprocess.run(
            [
                sys.executable,
                "scripts/demo.py",
                "--serve-storage",
                "--dir",
                str(tmp_path / "demo"),
                "--port",
                str(free_port()),
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli.returncode == 2, cli.stdout + cli.stderr
        assert f"Azurite's data folder {location} is in use by Azurite (pid" in cli.stderr
        assert "Traceback" not in cli.stderr and "seeded" not in cli.stdout
    with running_azurite(location) as again:  # the folder is free once the first has stopped
        kept = _container(again).download_blob("images/0.png").readall()
    assert kept == b"written through the first Azurite"
    report.record(
        "adversarial",
        "a second Azurite on one data folder (make azurite, then make demo)",
        "refused, naming the folder and the running Azurite; the first one's blobs kept",
        message=message,
    )


@pytest.mark.processes
def test_an_azurite_outliving_its_starter_keeps_the_folder_and_a_dead_one_frees_it(
    tmp_path: Path,
) -> None:
    """The lock lives as long as Azurite does, not only its starter: a starter killed with its
    Azurite left running still holds the folder (that Azurite still writes there); once both
    are gone, nothing stale blocks the next start."""
    location = tmp_path / "azurite"
    with _azurite_in_another_process(location) as starter:
        azurite_pid = int(
            subprocess.run(
                ["pgrep", "-P", str(starter.pid)], capture_output=True, text=True, check=True
            ).stdout.split()[0]
        )
        os.kill(starter.pid, signal.SIGKILL)  # the starter only: its Azurite runs on
        starter.wait()
        held = f"Azurite \\(pid {azurite_pid}\\)"
        with pytest.raises(FolderInUseError, match=held), running_azurite(location):
            pass
        os.kill(azurite_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{azurite_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # an orphan is reaped by init, not by us
    with running_azurite(location) as conn:  # the dead holders' lock file is still there
        assert _container(conn).create_container()
    report.record(
        "adversarial",
        "Azurite's starter killed, Azurite left running; then both killed",
        "the folder stays locked while that Azurite runs; free once it is gone (no stale lock)",
    )


# ---------------------------------------------------------------------------- the NFS folder

HOLD_POOL = """
import sys
from core.config import load_config
from flows.pool_lock import hold_pool
config = load_config(sys.argv[1])
with hold_pool(config, "pipeline a's run", shared=False):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def _pipeline(tmp_path: Path, name: str, nfs: Path, *overrides: str) -> Any:
    """A pipeline of its own (pool, data prefix, work dir, containers) on the NFS folder."""
    from tests.pipeline_helpers import make_config

    return make_config(
        tmp_path / name,
        f"pool.id=pool-{name}",
        f"data.prefix=images-{name}",
        f"nfs.local_dir={nfs}",
        *overrides,
    )


@pytest.mark.processes
def test_pipelines_sharing_an_nfs_folder_take_turns_across_processes(tmp_path: Path) -> None:
    """Two configs with pools, data prefixes and work dirs of their own, one NFS folder (the
    default nfs.local_dir, spelled here once through a symlink): staging makes the folder's
    data/ one pipeline's data, so run together one deleted the other's files between its
    training and its scoring. The second run waits for the folder, naming who holds it; a
    pipeline with its own NFS folder does not wait."""
    from flows.pool_lock import hold_pool

    nfs = tmp_path / "nfs"
    nfs.mkdir()
    (tmp_path / "nfs-link").symlink_to(nfs, target_is_directory=True)
    a = _pipeline(tmp_path, "a", nfs)
    b = _pipeline(tmp_path, "b", tmp_path / "nfs-link")
    alone = _pipeline(tmp_path, "c", tmp_path / "nfs-of-its-own")
    config_a = tmp_path / "a.yaml"
    config_a.write_text(yaml.safe_dump(a.model_dump(mode="json")))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_POOL, str(config_a)],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    said: list[str] = []
    entered = threading.Event()

    def pipeline_b() -> None:
        with hold_pool(b, "pipeline b's run", shared=False, say=said.append):
            entered.set()

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with hold_pool(alone, "pipeline c's run", shared=False):
            pass  # another NFS folder: not held up
        thread = threading.Thread(target=pipeline_b)
        thread.start()
        assert not entered.wait(5), "pipeline b got the NFS folder while pipeline a held it"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    thread.join(timeout=60)
    assert entered.is_set()
    assert len(said) == 1 and said[0].startswith(f"NFS folder {nfs.resolve()} is in use by ")
    assert "pipeline a's run" in said[0] and "pool-a" in said[0]
    report.record(
        "adversarial",
        "two pipelines (own pools, data prefixes, work dirs) on one nfs.local_dir, two processes",
        "the second waits for the NFS folder, naming the run and pool that hold it",
        message=said[0],
    )


@pytest.mark.usefixtures("prefect_api")
def test_pipelines_sharing_an_nfs_export_take_turns_across_machines(tmp_path: Path) -> None:
    """Azure: two pipelines with Batch pools of their own whose pools mount one NFS export,
    run from two machines (work dirs of their own: no file lock in common). The export's
    global concurrency limit lets one run at a time use it; another export is not held up."""
    from prefect.client.orchestration import get_client

    from core.pool_slot import nfs_slot, pool_slot
    from flows.pool_lock import hold_pool
    from tests.azure_helpers import azure_config

    first = azure_config(tmp_path / "machine-a", "nfs.source=10.0.0.4:/export/retrain")
    second = azure_config(tmp_path / "machine-b", "nfs.source=10.0.0.4:/export/retrain/")
    elsewhere = azure_config(tmp_path / "machine-c", "nfs.source=10.0.0.5:/export/retrain")
    assert first.pool.id != second.pool.id
    events: list[str] = []
    entered = threading.Event()

    def other_machine() -> None:
        with hold_pool(second, "run on machine b", shared=True):
            events.append("b holds")
            entered.set()

    with hold_pool(first, "run on machine a", shared=True):
        events.append("a holds")
        with hold_pool(elsewhere, "run on machine c", shared=True):
            events.append("c holds")
        thread = threading.Thread(target=other_machine)
        thread.start()
        assert not entered.wait(5), "the second pipeline got the NFS export while the first held it"
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(
                nfs_slot("10.0.0.4:/export/retrain")
            )
        assert (limit.limit, limit.active_slots) == (1, 1)
        events.append("a releases")
    thread.join(timeout=300)
    assert events == ["a holds", "c holds", "a releases", "b holds"]
    with get_client(sync_client=True) as client:  # b's own pool slot, taken with the export's
        assert client.read_global_concurrency_limit_by_name(pool_slot(second.pool.id)).limit == 1
    report.record(
        "adversarial",
        "two Azure pipelines (own Batch pools) on one nfs.source, from two machines",
        "the export's global concurrency limit: the second waits; another export does not",
    )


@pytest.fixture
def storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


@pytest.mark.slow
@pytest.mark.usefixtures("storage", "prefect_api", "horovodrun")
def test_two_pipelines_on_one_nfs_folder_run_at_once_from_the_cli(tmp_path: Path) -> None:
    """The case as found: two `python -m flows.retrain` of two pipelines (pools, containers,
    data of their own) on the default NFS folder, started together. Before, the second's
    staging deleted the first's images between its training and its scoring (the first failed
    in 2 of 2 trials); now the second waits for the folder and both complete, each trained and
    scored on its own data."""
    from imagedata.make_images import write_digits
    from tests.conftest import prefect_api_env
    from tests.pipeline_helpers import seed

    nfs = tmp_path / "nfs"
    paths, test_splits = [], []
    for name, per_class in (("a", 16), ("b", 20)):
        source = tmp_path / f"digits-{name}"
        write_digits(source, test_fraction=0.25, seed=0, per_class=per_class)
        test_splits.append(sum(1 for _ in (source / "test").rglob("*.png")))
        config = _pipeline(tmp_path, name, nfs, "training.epochs=1", "pool.processes_per_node=1")
        seed(config, source)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        paths.append(path)
    env = {**prefect_api_env(), "PYTHONUNBUFFERED": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.retrain", "--config", str(path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for path in paths
    ]
    outputs = [proc.communicate(timeout=1200)[0] for proc in runs]
    codes = [proc.returncode for proc in runs]
    assert codes == [0, 0], "\n\n".join(outputs)
    waited = [out for out in outputs if f"NFS folder {nfs.resolve()} is in use by" in out]
    assert len(waited) == 1, "the pipelines did not take turns on the NFS folder"
    tested = [int(re.findall(r"accuracy [0-9.]+ on (\d+) test images", o)[-1]) for o in outputs]
    assert tested == test_splits  # each scored on its own data, all of it
    report.record(
        "adversarial",
        "two pipelines on one NFS folder, two `python -m flows.retrain` at once",
        "both completed, each scored on its own test split; the second waited for the folder",
        exit_codes=codes,
        test_images=tested,
    )
