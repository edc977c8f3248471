"""The local registry at a shared loopback address: it serves every user on this machine until
the last one leaves, whoever started it, and a user killed mid-use keeps nothing alive for good.

Real docker-registry processes, real users in other processes; each test's lock and pid files
live in its own cache folder.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from backends.local.oci_server import BINARY, local_registry
from backends.local.ports import free_port
from backends.local.processes import ProcessRecord, is_running, read_record, record_of, write_record
from backends.oci import ImageRegistry
from tests.conftest import ROOT

pytestmark = pytest.mark.processes  # docker-registry and users in processes of their own

USER = """
import sys
from pathlib import Path
from backends.local.oci_server import local_registry
with local_registry(sys.argv[1], Path(sys.argv[2])):
    print("in", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def other_user(address: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process on this machine using the registry at ``address`` until told to leave
    (a line on its stdin)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", USER, address, str(tmp_path / "storage")],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "in\n"
    yield proc
    proc.kill()
    proc.wait()


def _pid_file(address: str, tmp_path: Path) -> Path:
    port = address.rsplit(":", 1)[1]
    return tmp_path / "cache" / "retrain-image" / "run" / f"registry-port-{port}.pid"


def _recorded(address: str, tmp_path: Path) -> ProcessRecord:
    record = read_record(_pid_file(address, tmp_path))
    assert record is not None and is_running(record)
    return record


def test_the_registry_outlives_the_user_that_started_it_while_another_uses_it(
    address: str, tmp_path: Path
) -> None:
    first = local_registry(address, tmp_path / "storage")
    first.__enter__()
    with local_registry(address, tmp_path / "storage") as second:
        first.__exit__(None, None, None)
        # The first user has left; the registry it started still answers the second.
        assert second.answers()
        assert second.has_tag("retrain/horovod", "absent") is False
    assert not ImageRegistry(address).answers()


def test_localhost_and_the_loopback_ip_are_one_address(address: str, tmp_path: Path) -> None:
    first = local_registry(address, tmp_path / "storage")
    first.__enter__()
    with local_registry(address.replace("127.0.0.1", "localhost"), tmp_path / "storage") as other:
        first.__exit__(None, None, None)
        assert other.has_tag("retrain/horovod", "absent") is False
    assert not ImageRegistry(address).answers()


def test_a_registry_whose_launch_was_cut_short_is_adopted_and_stopped(
    address: str, tmp_path: Path
) -> None:
    """A user killed between the registry's launch and its record leaves a registry no record
    names: the next user finds it by its command line, and stops it when it leaves."""
    first = local_registry(address, tmp_path / "storage")
    first.__enter__()
    started = _recorded(address, tmp_path)
    _pid_file(address, tmp_path).unlink()  # as if the user died before writing it
    first.__exit__(None, None, None)
    assert ImageRegistry(address).answers()  # nobody knew it was there
    with local_registry(address, tmp_path / "storage") as registry:
        assert _recorded(address, tmp_path) == started
        assert registry.has_tag("retrain/horovod", "absent") is False
    assert not registry.answers() and not is_running(started)


def test_users_reaching_the_cache_by_a_link_share_one_registry(
    address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = tmp_path / "link-to-cache"
    (tmp_path / "cache").mkdir()
    link.symlink_to(tmp_path / "cache")
    first = local_registry(address, tmp_path / "storage")
    first.__enter__()
    started = _recorded(address, tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(link))
    with local_registry(address, tmp_path / "storage") as registry:
        first.__exit__(None, None, None)
        assert registry.has_tag("retrain/horovod", "absent") is False
    # The last user, by the link, stopped the registry started through the real path.
    assert not registry.answers() and not is_running(started)


def test_a_process_forked_by_a_user_keeps_no_lock_after_the_user_leaves(
    address: str, tmp_path: Path
) -> None:
    """A flow forks (the packing pool) while it holds the address: the child shares the lock's
    open file, so a lock only closed, not released, would outlive the user in the child and
    block every later user of the machine."""
    read_end, write_end = os.pipe()
    with local_registry(address, tmp_path / "storage"):
        child = os.fork()
        if child == 0:  # holds every descriptor the user had until the test lets it go
            os.read(read_end, 1)
            os._exit(0)
    try:
        # The next user, leaving while the child still runs, is the last and stops the registry.
        with local_registry(address, tmp_path / "storage") as registry:
            assert registry.answers()
        assert not registry.answers()
    finally:
        os.write(write_end, b"x")
        os.waitpid(child, 0)


def test_a_pid_record_naming_another_process_never_gets_it_signalled(
    address: str, tmp_path: Path
) -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        with local_registry(address, tmp_path / "storage"):
            record = record_of(bystander.pid)
            assert record is not None
            write_record(record, _pid_file(address, tmp_path))  # a copied or hand-made file
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        # The registry this block started, whose record was overwritten, is still ours to end.
        for proc in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                proc.kill()


def test_a_storage_path_yaml_would_misread_is_served_as_given(address: str, tmp_path: Path) -> None:
    storage = tmp_path / "a #b: c"
    with local_registry(address, storage) as registry:
        data = b"a layer"
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        start = urllib.request.Request(
            f"http://{registry.address}/v2/probe/blobs/uploads/", method="POST"
        )
        with urllib.request.urlopen(start, timeout=30) as response:
            location = response.headers["Location"]
        upload = urllib.request.Request(
            f"{location}&digest={digest}",
            data=data,
            method="PUT",
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(upload, timeout=30) as response:
            assert response.status == 201
    stored = list(storage.rglob("data"))
    assert [p.read_bytes() for p in stored] == [data]


def test_the_last_user_to_leave_stops_it_whoever_started_it(
    address: str, tmp_path: Path, other_user: subprocess.Popen[str]
) -> None:
    record = _recorded(address, tmp_path)
    with local_registry(address, tmp_path / "storage") as registry:
        assert _recorded(address, tmp_path) == record  # found, not started again
        assert other_user.stdin is not None
        other_user.stdin.write("leave\n")
        other_user.stdin.close()
        assert other_user.wait(timeout=60) == 0
        assert registry.answers() and registry.has_tag("retrain/horovod", "absent") is False
    assert not registry.answers() and not is_running(record)


def test_a_user_killed_mid_use_leaves_the_registry_to_the_next_one_who_stops_it(
    address: str, tmp_path: Path, other_user: subprocess.Popen[str]
) -> None:
    record = _recorded(address, tmp_path)
    # The registry is no child of the user that started it: killing the user's whole process
    # group (what a worker's teardown does to a flow run) does not take it down.
    assert psutil.Process(record.pid).ppid() != other_user.pid
    os.killpg(other_user.pid, signal.SIGKILL)
    other_user.wait()
    assert ImageRegistry(address).answers()
    with local_registry(address, tmp_path / "storage") as registry:
        assert registry.has_tag("retrain/horovod", "absent") is False
    assert not registry.answers() and not is_running(record)


def test_a_registry_this_machine_runs_by_other_means_is_used_and_left_running(
    address: str, tmp_path: Path
) -> None:
    config = tmp_path / "own.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'own'}\n"
        f"http:\n  addr: {address}\n"
    )
    own = subprocess.Popen([BINARY, "serve", str(config)], stderr=subprocess.DEVNULL)
    try:
        registry = ImageRegistry(address)
        while not registry.answers():
            assert own.poll() is None
        with local_registry(address, tmp_path / "storage") as found:
            assert found.has_tag("retrain/horovod", "absent") is False
        assert registry.answers() and own.poll() is None
    finally:
        own.terminate()
        own.wait()
