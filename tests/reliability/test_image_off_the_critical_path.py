"""The local target's training image is off the run's critical path: the local cluster trains and
scores on this machine's files, so scoring and promotion never wait for the image's build;
only the report (which records the build step) does. On a first `make demo` the build takes
minutes (docs/performance.md): before, scoring waited for all of it although training had
finished. Marked slow: a whole flow run of its own (`make reliability` runs it)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from backends.blob import container_client
from backends.local.ports import free_port
from imagedata.make_images import write_digits
from registry.layout import champion_blob
from tests.conftest import ROOT
from tests.pipeline_helpers import make_config, seed
from tests.reliability import report

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api", "horovodrun")]
WAIT = 600  # seconds the run may take to promote while the build is held; past it, it failed


def _push_empty_image(address: str, repository: str, tag: str) -> None:
    """A manifest for ``repository:tag`` with an empty config and no layer, pushed through the
    registry's HTTP API: the tag the build step looks for, so it ends without building."""
    base = f"http://{address}/v2/{repository}"

    def call(url: str, method: str, data: bytes, **headers: str) -> Any:
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.headers

    config = b"{}"
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    location = call(f"{base}/blobs/uploads/", "POST", b"")["Location"]
    location = f"http://{address}{location}" if location.startswith("/") else location
    sep = "&" if "?" in location else "?"
    call(
        f"{location}{sep}digest={digest}",
        "PUT",
        config,
        **{"Content-Type": "application/octet-stream"},
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "size": len(config),
            "digest": digest,
        },
        "layers": [],
    }
    call(
        f"{base}/manifests/{tag}",
        "PUT",
        json.dumps(manifest).encode(),
        **{"Content-Type": manifest["mediaType"]},
    )


def test_scoring_and_promotion_do_not_wait_for_the_local_image_build(
    tmp_path: Path, azurite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build step is held (its lock taken, as a build of the same image in another process
    takes it) until the run has promoted its model; then the tag appears and the build step
    ends. Before, the run waited for the build before scoring, and never promoted while it
    was held."""
    from backends.local.buildah import LocalImageBuilder, unavailable_reason
    from backends.oci import ImageRegistry, cache_dir
    from flows.retrain import retrain

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"the local target builds no image here: {reason}")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a registry of its own
    address = f"127.0.0.1:{free_port()}"
    config = make_config(
        tmp_path, "image.builder=buildah", f"image.registry={address}", "training.epochs=1"
    )
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=20)
    seed(config, source)
    reference = LocalImageBuilder(ImageRegistry(address)).reference(ROOT, config.image.repository)
    tag = reference.rsplit(":", 1)[1]
    held = FileLock(cache_dir() / "locks" / f"{tag}.lock")
    (cache_dir() / "locks").mkdir(parents=True)
    held.acquire()

    states: list[Any] = []
    flow = threading.Thread(target=lambda: states.append(retrain(config=config, return_state=True)))
    flow.start()
    champion = container_client(config.output).get_blob_client(champion_blob("", config.data.root))
    deadline = time.monotonic() + WAIT
    try:
        while not champion.exists() and flow.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)  # polling for the record, not ordering anything
        promoted_while_held = champion.exists()
    finally:
        _push_empty_image(address, config.image.repository, tag)
        held.release()
        flow.join(WAIT)
    assert states and states[0].is_completed(), states
    assert promoted_while_held, "the run did not promote before the image's build ended"
    steps = {s["step"]: s for s in states[0].result()["steps"]}
    assert steps["build-image"]["details"]["reason"] == "tag already in the registry"
    report.record(
        "orchestrator",
        "local target: the image's build held until the run promoted",
        "scored and promoted while the build ran; the report waited for the build step",
        before_fix="scoring waited for the build: nothing promoted while it ran (the first "
        "`make demo` waited minutes after training)",
    )
