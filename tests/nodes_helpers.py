"""Helpers for tests on emulated Batch nodes: availability, the scripts share, task bodies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backends.share import collect_files
from backends.taskspec import TaskSpec, training_task
from core.config import load_config
from tests.conftest import ROOT
from tests.fakes.hosts import Node, unavailable_reason
from tests.fakes.node import PoolNodes, TaskRun

# CI sets this: there the multi-node tests must run, so a machine that cannot emulate nodes fails
# them instead of skipping them.
REQUIRED = "RETRAIN_REQUIRE_EMULATED_NODES"
_checked: list[str | None] = []


def require_emulated_nodes() -> None:
    """Skip (or, under CI, fail) with the reason when nodes cannot be emulated here."""
    if not _checked:
        _checked.append(unavailable_reason())
    reason = _checked[0]
    if reason is None:
        return
    if os.environ.get(REQUIRED):
        pytest.fail(f"{REQUIRED} is set but {reason}")
    print(f"\nskipping emulated-node test: {reason}")
    pytest.skip(reason)


def require_image_tools() -> None:
    """Skip (or, under CI, fail) with the reason when the training image cannot be built and
    run here (the emulated nodes run their tasks in it)."""
    from backends.local.buildah import unavailable_reason as build_reason

    require_emulated_nodes()
    reason = build_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRED):
        pytest.fail(f"{REQUIRED} is set but {reason}")
    print(f"\nskipping test on the training image: {reason}")
    pytest.skip(reason)


def copy_scripts(target: Path) -> None:
    """The scripts share as upload-scripts fills it (the node-side package)."""
    from tasks.provision import SCRIPT_PACKAGES

    for rel, source in collect_files(ROOT, SCRIPT_PACKAGES).items():
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)


def task_body(spec: TaskSpec, image: str | None = None, **environment: str) -> dict[str, Any]:
    """The parts of a Batch task body a node uses, from the project's own task spec; with
    ``image``, the container settings the pipeline sends (backends/azure/batch_requests.py)."""
    env = {**spec.environment, "RETRAIN_PYTHON": "python", **environment}
    body: dict[str, Any] = {
        "id": spec.id,
        "commandLine": spec.command_line,
        "environmentSettings": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "constraints": {"maxWallClockTime": f"PT{spec.max_wall_clock_seconds}S"},
    }
    if image is not None:
        body["containerSettings"] = {
            "imageName": image,
            "containerRunOptions": "--network=host",
            "workingDirectory": "taskWorkingDirectory",
        }
    if spec.coordination_command:
        body["multiInstanceSettings"] = {
            "numberOfInstances": spec.instances,
            "coordinationCommandLine": spec.coordination_command,
        }
    return body


NODES = [("tvmps_0000", "10.211.0.4"), ("tvmps_0001", "10.211.0.5")]
JOB = "retrain-pool-train-test"


def training_spec(nodes: int, ppn: int, *overrides: str) -> TaskSpec:
    """The task spec the pipeline sends to Batch for this many nodes and processes per node."""
    config = load_config(
        ROOT / "configs" / "local.yaml",
        [
            f"pool.dedicated_nodes={nodes}",
            f"pool.processes_per_node={ppn}",
            "training.epochs=3",
            "training.batch_size=16",
            "training.lr=0.05",
            "training.seed=3",
            "training.timeline=false",
            *overrides,
        ],
    )
    key = training_key(nodes, ppn, *overrides)
    return training_task(config, f"train-{nodes}x{ppn}", key, "runs/test")


def training_key(nodes: int, ppn: int, *overrides: str) -> str:
    """The checkpoint folder's name (under the NFS checkpoints/) of ``training_spec``'s task: one
    per layout and settings, as a run that found another's checkpoint of the same settings
    would resume after its last epoch and train nothing."""
    return hashlib.sha256(repr((nodes, ppn, overrides)).encode()).hexdigest()[:12]


def run_task(
    pool: PoolNodes, spec: TaskSpec, job: str = JOB, image: str | None = None, **env: str
) -> TaskRun:
    run = pool.start(task_body(spec, image, **env), job)
    run.wait(timeout=600)
    return run


def metrics(run: TaskRun) -> dict[str, Any]:
    return json.loads((run.primary.wd / "outputs" / "metrics.json").read_text())


_LISTEN = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
time.sleep(600)
"""


def listen_on(node: Node, port: int) -> subprocess.Popen[str]:
    """A process on ``node`` holding ``port`` (it accepts nothing); returns once it listens."""
    proc = node.popen([sys.executable, "-c", _LISTEN, str(port)], {}, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def push_with_file_deleted(reference: str, path: str, suffix: str) -> str:
    """``reference``'s image with one layer more that deletes ``path`` (an OCI whiteout, what
    a Dockerfile's ``RUN rm`` adds), pushed beside it as ``<tag><suffix>`` through the
    registry's HTTP API; the new reference. Nothing is rebuilt or copied: the base layers are
    the registry's already (a buildah container of a 2 GB image copies every layer first)."""
    import gzip
    import io
    import tarfile
    import urllib.request

    from tests.fakes.container import MANIFEST_TYPES, WHITEOUT, split_reference

    host, repository, tag = split_reference(reference)
    base = f"http://{host}/v2/{repository}"

    def call(url: str, method: str = "GET", data: bytes | None = None, **headers: str) -> Any:
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.headers, response.read()

    def push_blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        headers, _ = call(f"{base}/blobs/uploads/", "POST", b"")
        location = headers["Location"]
        if location.startswith("/"):
            location = f"http://{host}{location}"
        sep = "&" if "?" in location else "?"
        call(
            f"{location}{sep}digest={digest}",
            "PUT",
            data,
            **{"Content-Type": "application/octet-stream"},
        )
        return digest

    got, raw = call(f"{base}/manifests/{tag}", Accept=MANIFEST_TYPES)
    manifest = json.loads(raw)
    media_type = manifest.get("mediaType") or got["Content-Type"]  # optional in OCI's body
    _, config_raw = call(f"{base}/blobs/{manifest['config']['digest']}")
    config = json.loads(config_raw)

    folder, name = os.path.split(path.strip("/"))
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parts = folder.split("/") if folder else []
        for depth in range(1, len(parts) + 1):  # the folders above it, as a layer lists them
            entry = tarfile.TarInfo("/".join(parts[:depth]))
            entry.type, entry.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(entry)
        tar.addfile(tarfile.TarInfo("/".join([*parts, f"{WHITEOUT}{name}"])))
    plain = layer_tar.getvalue()
    layer = gzip.compress(plain, mtime=0)
    oci = media_type.startswith("application/vnd.oci")
    manifest["layers"].append(
        {
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"
            if oci
            else "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "digest": push_blob(layer),
            "size": len(layer),
        }
    )
    config["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(plain).hexdigest())
    config.setdefault("history", []).append({"created_by": f"rm {path}"})
    config_bytes = json.dumps(config).encode()
    manifest["config"] = {
        **manifest["config"],
        "digest": push_blob(config_bytes),
        "size": len(config_bytes),
    }
    new_tag = f"{tag}{suffix}"
    call(
        f"{base}/manifests/{new_tag}",
        "PUT",
        json.dumps(manifest).encode(),
        **{"Content-Type": media_type},
    )
    return f"{host}/{repository}:{new_tag}"
