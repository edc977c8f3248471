"""Bringing your own data (``python -m cli.data upload``), as a newcomer does it: a folder of
real photos uploaded to Azurite as a data version, then trained by the flow and downloaded with
``python -m cli.models download``; and what the upload promises: every blob with its
Content-MD5, the marker last, a broken folder refused before a byte is sent, an interrupted
upload finished by the same command, a complete version never touched."""

from __future__ import annotations

import base64
import hashlib
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from cli.data import main as data
from core.config import PipelineConfig, load_config
from imagedata.make_images import write_digits
from tests.conftest import ROOT, child_env
from tests.image_mix import photo_mix, write_mix

LOCAL = str(ROOT / "configs" / "local.yaml")


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _sets(tmp_path: Path, prefix: str = "my-photos") -> list[str]:
    """configs/local.yaml on containers, folders and a pool of the test's own, its data root
    ``prefix``; one rank, two epochs, no image build (what is checked is the path from a folder
    to a model, not how well it learns)."""
    suffix = uuid.uuid4().hex[:10]
    sets = [
        f"data.container=data-{suffix}",
        f"data.prefix={prefix}",
        f"output.container=out-{suffix}",
        f"share.local_dir={tmp_path / 'share'}",
        f"nfs.local_dir={tmp_path / 'nfs'}",
        f"work_dir={tmp_path / 'work'}",
        f"pool.id=pool-{suffix}",
        "training.epochs=2",
        "training.batch_size=16",
        # Two epochs are near chance: no floor, or whether there is a champion is chance too.
        "promotion.minimum.class_recall=null",
        "pool.processes_per_node=1",
        "image.builder=none",
    ]
    return [arg for s in sets for arg in ("--set", s)]


def _config(sets: list[str]) -> PipelineConfig:
    return load_config(LOCAL, sets[1::2])


def _md5(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes(), usedforsecurity=False).digest()).decode()


def _stored(config: PipelineConfig, version: str) -> dict[str, Any]:
    """The version's blobs by name below it: their properties."""
    prefix = f"{config.data.prefix}/{version}/"
    return {
        b.name[len(prefix) :]: b
        for b in container_client(config.data).list_blobs(name_starts_with=prefix)
    }


def _local(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


@pytest.mark.usefixtures("prefect_api", "horovodrun")
def test_a_folder_of_photos_becomes_a_trained_downloaded_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs' "Use your own data", command by command: upload, run, download."""
    import torch

    from cli.models import main as models
    from flows.retrain import main as retrain

    # Real handwritten digits saved as a photo dump saves pictures: PNG and JPEG, grayscale,
    # RGB, palette, CMYK, transparency, EXIF-turned, at several sizes.
    folder = write_mix(photo_mix(tmp_path / "source", per_class=20), tmp_path / "my-photos")
    sets = _sets(tmp_path)
    config = _config(sets)

    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v1"]) == 0
    said = capsys.readouterr().out
    assert "passed: 200 images, 10 classes" in said
    assert "data version v1 of " in said and "my-photos/v1/_SUCCESS written last" in said
    assert f"train it: python -m flows.retrain --config {LOCAL} --set" in said
    stored = _stored(config, "v1")
    files = _local(folder)
    assert set(stored) == set(files) | {"_SUCCESS"}
    for rel, path in files.items():  # every blob with the MD5 of its file's bytes
        md5 = stored[rel].content_settings.content_md5
        assert md5 and base64.b64encode(bytes(md5)).decode() == _md5(path), rel
        assert stored[rel].content_settings.content_type in ("image/png", "image/jpeg")
    marker = stored.pop("_SUCCESS")
    assert marker.last_modified >= max(b.last_modified for b in stored.values())

    assert retrain(["--config", LOCAL, *sets]) == 0
    said = capsys.readouterr().out
    assert "data: version v1 of " in said and "test accuracy" in said, said

    models_dir = tmp_path / "models"
    assert models(["--config", LOCAL, *sets, "download", "--to", f"{models_dir}/"]) == 0
    saved = torch.load(models_dir / "model.pt", map_location="cpu", weights_only=False)
    assert saved["class_names"] == [f"digit_{d}" for d in range(10)]


def test_a_broken_folder_fails_before_anything_is_uploaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=12)
    (folder / "photos.zip").write_bytes(b"PK\x03\x04")
    shutil.rmtree(folder / "test" / "digit_7")
    sets = _sets(tmp_path)
    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v1"]) == 2
    said = capsys.readouterr().err
    assert "would fail the data gate; nothing was uploaded" in said
    assert "photos.zip" in said and "digit_7 (0 test images)" in said
    assert not container_client(_config(sets).data).exists()  # not even its container
    # A version name that is no folder name fails at once, before the folder is read.
    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v1/train"]) == 2
    assert "--version: 'v1/train' is not a version name" in capsys.readouterr().err


def test_an_interrupted_upload_is_finished_by_the_same_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Blobs an earlier, cut-short upload left (some of the files, one of them cut short) and
    no marker: the same command sends only what is missing or differs, then the marker. Run
    once more, it refuses to touch the complete version and changes nothing."""
    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=12)
    sets = _sets(tmp_path)
    config = _config(sets)
    container = container_client(config.data, create=True)
    files = sorted(_local(folder).items())
    for rel, path in files[:50]:  # what the cut-short upload had sent
        container.upload_blob(f"{config.data.prefix}/v2/{rel}", path.read_bytes())
    cut = files[0][0]
    container.upload_blob(
        f"{config.data.prefix}/v2/{cut}", files[0][1].read_bytes()[:9], overwrite=True
    )

    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v2"]) == 0
    said = capsys.readouterr().out
    assert f"uploading {len(files) - 49} of {len(files)} files" in said and "49 are there" in said
    stored = _stored(config, "v2")
    assert {
        rel: base64.b64encode(bytes(b.content_settings.content_md5)).decode()
        for rel, b in stored.items()
        if rel != "_SUCCESS"
    } == {rel: _md5(path) for rel, path in files}
    etags = {rel: b.etag for rel, b in stored.items()}

    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v2"]) == 2
    assert "is complete" in capsys.readouterr().err
    assert {rel: b.etag for rel, b in _stored(config, "v2").items()} == etags


@pytest.mark.processes
def test_ctrl_c_leaves_the_version_incomplete_and_the_next_run_completes_it(
    tmp_path: Path, azurite: str
) -> None:
    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=None)  # 1,797 files
    sets = _sets(tmp_path)
    config = _config(sets)
    command = [sys.executable, "-m", "cli.data", "--config", LOCAL, *sets]
    upload = [*command, "upload", str(folder), "--version", "v1", "--workers", "2"]
    env = {**child_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    proc = subprocess.Popen(
        upload, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not container_client(config.data).exists() or len(_stored(config, "v1")) < 20:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "interrupted: the version is not marked complete" in err
    sent = _stored(config, "v1")
    assert "_SUCCESS" not in sent and 20 <= len(sent) < 1797

    again = subprocess.run(upload, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{len(sent)} are there already" in again.stdout
    assert len(_stored(config, "v1")) == 1797 + 1


def test_a_root_of_loose_files_takes_no_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data root holding a dataset without versions (train/, test/ directly below it): a
    version beside it would make a root no run can train, so none is uploaded."""
    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=10)
    sets = _sets(tmp_path)
    config = _config(sets)
    container = container_client(config.data, create=True)
    container.upload_blob(f"{config.data.prefix}/train/digit_0/old.png", b"loose")
    assert data(["--config", LOCAL, *sets, "upload", str(folder), "--version", "v1"]) == 2
    said = capsys.readouterr().err
    assert "uploading version v1 is refused" in said and "loose files (train/)" in said
    assert _stored(config, "v1") == {}


def test_an_upload_through_storage_faults_stores_every_byte_with_its_md5(
    azurite: str, tmp_path: Path
) -> None:
    """Resets, 503s, slow and lost answers (the write done, its answer gone) on every kind of
    request, a large file in parallel blocks among them: the SDK's retries carry the upload
    through, every blob holds its file's bytes and MD5, and the marker is written (a lost
    answer to it is not taken for another upload's)."""
    from azure.storage.blob import ContainerClient

    from backends.blob import API_VERSION
    from backends.version_upload import local_files, upload_version
    from core.data_versions import DataRoot
    from tests.reliability import report
    from tests.reliability.fault_proxy import FaultProxy

    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=10)
    (folder / "big.bin").write_bytes(random_bytes(3_000_000))  # sent in parallel blocks
    files = local_files(folder)
    parts = dict(p.split("=", 1) for p in azurite.split(";") if "=" in p)
    port = int(parts["BlobEndpoint"].rsplit(":", 1)[1].split("/")[0])
    name = f"faults-{uuid.uuid4().hex[:10]}"
    direct = ContainerClient.from_connection_string(azurite, name, api_version=API_VERSION)
    direct.create_container()
    proxy = FaultProxy(port, rate=0.15, seed=5, faults=("reset", "503", "slow", "lost"))
    try:
        faulty = ContainerClient.from_connection_string(
            proxy.connection_string(parts["AccountName"], parts["AccountKey"]),
            name,
            api_version=API_VERSION,
            retry_total=6,
            # Resets and lost answers count against the read and connect budgets (3 each by
            # default): at a 15% fault rate four in a row on one of ~150 requests is a chance
            # the test must not take.
            retry_read=6,
            retry_connect=6,
            # The storage SDK's ExponentialRetry reads these: waits of about 0.2 s.
            initial_backoff=0,
            increment_base=0.2,
            random_jitter_range=0.05,
            max_single_put_size=1 << 20,
            max_block_size=256 << 10,
        )
        done = upload_version(faulty, DataRoot(name, "mine"), "v1", files, workers=4)
    finally:
        proxy.close()
    assert len(done.sent) == len(files) and done.marker == "mine/v1/_SUCCESS"
    for file in files:
        blob = direct.get_blob_client(f"mine/v1/{file.rel}")
        stored = blob.get_blob_properties().content_settings.content_md5
        assert base64.b64encode(bytes(stored)).decode() == file.md5, file.rel
        assert _md5_of(blob.download_blob().readall()) == file.md5, file.rel
    assert direct.get_blob_client("mine/v1/_SUCCESS").exists()
    assert sum(proxy.injected.values()) > 0
    report.record(
        "storage",
        f"data version upload ({len(files)} files, one of 3 MB in blocks)",
        "complete, every blob's bytes and stored MD5 match its file, marker written",
        files=len(files),
        faults=dict(proxy.injected),
        requests=proxy.requests,
    )
    direct.delete_container()


def test_a_lost_answer_to_the_marker_is_not_taken_for_another_upload(
    azurite: str, tmp_path: Path
) -> None:
    """The marker is written only where none is (If-None-Match): when the answer to that write
    is lost, the SDK's retry finds the marker the write left. That is this upload's, and the
    version is complete with these files; it was reported as another upload's, and failed."""
    from azure.storage.blob import ContainerClient

    from backends.blob import API_VERSION
    from backends.version_upload import local_files, upload_version
    from core.data_versions import DataRoot
    from tests.reliability.fault_proxy import FaultProxy

    folder = tmp_path / "mine"
    write_digits(folder, test_fraction=0.25, seed=0, per_class=10)
    files = local_files(folder)

    class LoseTheMarkersAnswer(FaultProxy):
        """Every blob a single PUT, the marker's the last: its answer is lost."""

        puts = 0

        def _choose(self, method: str) -> str | None:
            if method == "PUT":
                self.puts += 1
                if self.puts == len(files) + 1:
                    self.injected["lost"] += 1
                    return "lost"
            return super()._choose(method)

    parts = dict(p.split("=", 1) for p in azurite.split(";") if "=" in p)
    port = int(parts["BlobEndpoint"].rsplit(":", 1)[1].split("/")[0])
    name = f"lost-{uuid.uuid4().hex[:10]}"
    ContainerClient.from_connection_string(
        azurite, name, api_version=API_VERSION
    ).create_container()
    proxy = LoseTheMarkersAnswer(port)
    try:
        faulty = ContainerClient.from_connection_string(
            proxy.connection_string(parts["AccountName"], parts["AccountKey"]),
            name,
            api_version=API_VERSION,
            initial_backoff=0,
            increment_base=0.2,
        )
        done = upload_version(faulty, DataRoot(name, "mine"), "v1", files, workers=1)
    finally:
        proxy.close()
    assert proxy.injected["lost"] == 1 and done.marker == "mine/v1/_SUCCESS"


def random_bytes(n: int) -> bytes:
    import random

    return random.Random(3).randbytes(n)


def _md5_of(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
