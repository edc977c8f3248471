"""The commands the README's service section and the Azure docs name, run as a person would:
`make azurite` (scripts/demo.py --serve-storage) and `make azure-config`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from backends.local.azurite import connection_string
from backends.local.ports import free_port
from core.config import load_config
from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.processes  # each test starts the command it checks


def _serve(port: int, tmp_path: Path) -> list[str]:
    """`make azurite`'s command, on a port and in a folder of the test's own."""
    demo = str(tmp_path / "demo")
    return [sys.executable, "scripts/demo.py", "--serve-storage", f"--port={port}", "--dir", demo]


def test_serve_storage_seeds_what_the_local_config_reads(tmp_path: Path) -> None:
    """From a fresh location: Azurite starts, the demo's dataset lands in the container and
    prefix configs/local.yaml reads, the terminal gets no access log, and SIGTERM stops it."""
    from backends.blob import container_client
    from backends.data_root import resolve

    port = free_port()
    proc = subprocess.Popen(
        _serve(port, tmp_path),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until it says it is serving (or exits)
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        assert any(f"127.0.0.1:{port}" in x for x in lines), "".join(lines)
        config = load_config(ROOT / "configs" / "local.yaml")
        os.environ[config.data.connection_string_env or ""] = connection_string(port)
        container = container_client(config.data)
        names = {b.name for b in container.list_blobs(name_starts_with=config.data.prefix + "/")}
        images = {
            f"{config.data.prefix}/v1/{p.relative_to(tmp_path / 'demo' / 'digits').as_posix()}"
            for p in (tmp_path / "demo" / "digits").rglob("*.png")
        }
        # Every digit, as the first data version of the root the config reads.
        assert len(images) == 1797 and names == images | {f"{config.data.prefix}/v1/_SUCCESS"}
        assert any("/v1/train/" in n for n in names) and any("/v1/test/" in n for n in names)
        assert resolve(config.data).version == "v1"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "Azurite stopped" in rest
    assert "GET /devstoreaccount1" not in output and "PUT /devstoreaccount1" not in output
    assert (tmp_path / "demo" / "azurite" / "azurite.log").is_file()
    with pytest.raises(OSError):  # Azurite stopped with it
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_seeding_again_keeps_the_version_and_moves_an_earlier_flat_copy(
    azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's seeding (`make azurite`, `make demo`) over an Azurite folder an earlier demo
    filled before data versions (the digits loose below the root): the copy becomes version
    v1 and the loose images go, so the root is not refused as mixed; what the demo did not
    put there stays. Seeding again changes nothing, the marker included (a new marker would
    be a new completion, reported again by the relay and the sensor)."""
    from backends.blob import container_client, upload_directory
    from backends.data_root import resolve
    from core.data_versions import DataVersionError
    from imagedata.make_images import write_digits
    from scripts.demo import seed

    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=6)
    config = load_config(ROOT / "configs" / "local.yaml", [f"data.container=demo-{os.getpid()}"])
    monkeypatch.setenv(config.data.connection_string_env or "", azurite)
    container = container_client(config.data, create=True)
    upload_directory(container, source, "digits")  # what the demo seeded before versions
    container.upload_blob("digits/train/notes.txt", b"a person's own file")

    seed(config, source, azurite)
    names = {b.name for b in container.list_blobs(name_starts_with="digits/")}
    assert names == {
        f"digits/v1/{p.relative_to(source).as_posix()}" for p in source.rglob("*.png")
    } | {"digits/v1/_SUCCESS", "digits/train/notes.txt"}
    marker = container.get_blob_client("digits/v1/_SUCCESS").get_blob_properties().etag
    assert seed(config, source, azurite) == 0
    assert container.get_blob_client("digits/v1/_SUCCESS").get_blob_properties().etag == marker
    with pytest.raises(DataVersionError, match=r"loose files \(train/\)"):
        resolve(config.data)  # the person's own file is theirs to move
    container.delete_blob("digits/train/notes.txt")
    assert resolve(config.data).version == "v1"


def test_serve_storage_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            _serve(port, tmp_path),
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2
    assert f"127.0.0.1:{port} is already in use" in result.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_azure_config_is_created_from_the_example_and_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "azure.example.yaml", tmp_path / "configs")
    make = ["make", "-s", "-f", str(ROOT / "Makefile"), "azure-config"]
    first = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    created = tmp_path / "configs" / "azure.yaml"
    assert created.read_bytes() == (ROOT / "configs" / "azure.example.yaml").read_bytes()
    created.write_text("target: azure  # filled in\n")
    again = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "configs/azure.yaml exists" in again.stderr
    assert created.read_text() == "target: azure  # filled in\n"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_azurite_passes_its_args_on() -> None:
    """`make azurite AZURITE_ARGS="--port 10001"` reaches scripts/demo.py, whose --port the
    serving test above reads back from its status line (make -n: nothing runs)."""
    result = subprocess.run(
        ["make", "-n", "-s", "-C", str(ROOT), "azurite", "AZURITE_ARGS=--port 10001"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("scripts/demo.py --serve-storage --port 10001")
