"""Between the data gate and the up-to-date check: what this run's training starts from.

``training.init_from`` (``core/init_from.py``) is resolved to a place the training task reads,
and checked, before anything is provisioned:

- ``champion``: the data root's champion record is read; its model must exist, be the network
  and input size this run trains (from the ``metrics.json`` beside it), and its bytes must match
  the MD5 the trainer recorded (downloaded and compared). A root with no champion yet trains from
  scratch, and the run says so. The value becomes ``output:<the champion's model.pt>``;
- ``output:<blob>``: the blob must exist;
- ``data:<blob>`` (or a URL into the data container): the blob is copied into the output
  container under its MD5 (``<output prefix>/init-from/<md5>/<name>``, once per content), where
  the training task's resource files come from;
- ``nfs:<path>``: on the local target the file must exist; on Azure the orchestrator cannot see
  NFS, and the trainer checks it at its start.

The resolved value replaces the config's for the rest of the run, so the checkpoint key, the
up-to-date fingerprint and the run's summary name the very weights it started from: a new
champion is a new input. What the file holds (a state dict, its shapes, NaNs) is checked by the
trainer at its start, before a step is trained (``training/weights.py``).
"""

from __future__ import annotations

import base64
import hashlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from backends.blob import container_client
from core.config import PipelineConfig
from core.init_from import InitFrom, parse_init_from, url_location
from core.run import Run
from registry.champion import Champion, champion_for
from registry.last_run import blob_exists
from registry.record_blob import json_object, read_record
from registry.store import MAX_METRICS_BYTES, download, recorded_model_md5
from tasks.steps import Done, step

INIT_FROM_FOLDER = "init-from"


class InitFromConfigError(ValueError):
    """``training.init_from`` names weights this run cannot start from; the message names the
    value, the blob or file, and what is wrong."""


@dataclass(frozen=True)
class Start:
    """What the run's training starts from, resolved."""

    config: PipelineConfig  # with training.init_from resolved (None: from scratch)
    asked: str | None  # the config's value
    resolved: str | None
    why: str  # in words, for the summary
    run_id: str | None = None  # the champion's run
    md5: str | None = None

    def as_record(self) -> dict[str, Any]:
        return {
            "asked": self.asked,
            "resolved": self.resolved,
            "run_id": self.run_id,
            "md5": self.md5,
            "why": self.why,
        }


def _with(config: PipelineConfig, value: str | None) -> PipelineConfig:
    return config.model_copy(update={"training": replace(config.training, init_from=value)})


def champion_metrics(outputs: Any, champion: Champion) -> dict[str, Any]:
    """The ``metrics.json`` of the champion's run: what its model is and how it was trained."""
    blob = f"{champion.model.rsplit('/', 1)[0]}/metrics.json"
    stored = read_record(outputs, blob, MAX_METRICS_BYTES)
    doc = None if stored is None else json_object(stored.data, stored.limit)
    if not isinstance(doc, dict):
        raise InitFromConfigError(
            f"init_from champion: {blob}, which says what the champion's model is, "
            + ("does not exist" if stored is None else f"is unusable ({doc})")
        )
    return doc


def _champion(config: PipelineConfig, outputs: Any) -> Start:
    asked = "champion"
    base, root = config.output.prefix, config.data.root
    read = champion_for(outputs, base, root)
    if read.damaged:
        raise InitFromConfigError(
            f"init_from champion: the champion record of data root {root.where} "
            f"({read.blob}) is damaged ({read.damaged})"
        )
    champion = read.champion
    if champion is None:
        why = f"from scratch: data root {root.where} has no champion yet"
        return Start(_with(config, None), asked, None, why)
    if not blob_exists(outputs, champion.model):
        raise InitFromConfigError(
            f"init_from champion: the champion of {root.where} (run {champion.run_id}) names "
            f"the model {champion.model}, which does not exist in {outputs.container_name}"
        )
    metrics = champion_metrics(outputs, champion)
    have = (metrics.get("model"), metrics.get("input_size"))
    if config.training.image_size is None and have[0] == config.training.model:
        # A size left unset is the champion's (one fitted to its data, tasks/fit_to_data.py).
        size = have[1]
        if type(size) is int and size > 0:
            config = config.model_copy(
                update={"training": replace(config.training, image_size=size)}
            )
    want = (config.training.model, config.training.input_size())
    if have != want:
        raise InitFromConfigError(
            f"init_from champion: the champion of {root.where} (run {champion.run_id}) is a "
            f"{have[0]} at {have[1]} px; this run trains a {want[0]} at {want[1]} px "
            "(training.model, training.image_size): set them as the champion's, or "
            "init_from to null"
        )
    recorded = recorded_model_md5(outputs, champion.model)
    if recorded is None:
        raise InitFromConfigError(
            f"init_from champion: no MD5 is recorded for {champion.model} (its metrics.json "
            "has no model_md5): the model cannot be checked before it is used"
        )
    from registry.store import ModelStoreError

    with tempfile.TemporaryDirectory(prefix="init-from-") as work:
        try:
            download(outputs, champion.model, Path(work) / "model.pt", recorded)
        except ModelStoreError as exc:
            raise InitFromConfigError(f"init_from champion: {exc}") from None
    why = (
        f"from the champion of {root.where}: run {champion.run_id} "
        f"({champion.metric} {champion.value:.4f}), its model checked against its recorded MD5"
    )
    resolved = f"output:{champion.model}"
    return Start(_with(config, resolved), asked, resolved, why, champion.run_id, recorded)


def _copy_from_data(config: PipelineConfig, blob: str, outputs: Any) -> tuple[str, str]:
    """The data container's ``blob`` in the output container, under its MD5; (its name
    there, the MD5 in base64). Streamed through this process once per content."""
    from azure.core.exceptions import ResourceNotFoundError

    data = container_client(config.data, config.retries.storage_retries)
    with tempfile.TemporaryDirectory(prefix="init-from-") as work:
        local = Path(work) / "weights"
        digest = hashlib.md5(usedforsecurity=False)
        try:
            stream = data.download_blob(blob)
        except ResourceNotFoundError:
            raise InitFromConfigError(
                f"init_from data:{blob}: no such blob in the data container {config.data.container}"
            ) from None
        with open(local, "wb") as fh:
            for chunk in stream.chunks():
                digest.update(chunk)
                fh.write(chunk)
        name = blob.rsplit("/", 1)[-1]
        base = config.output.prefix.strip("/")
        folder = f"{base}/{INIT_FROM_FOLDER}" if base else INIT_FROM_FOLDER
        target = f"{folder}/{digest.hexdigest()}/{name}"
        if not blob_exists(outputs, target):
            with open(local, "rb") as fh:
                outputs.upload_blob(target, fh, overwrite=True)
    return target, base64.b64encode(digest.digest()).decode()


def _location(config: PipelineConfig, start: InitFrom, outputs: Any) -> Start:
    asked = config.training.init_from
    if start.kind == "url":
        start = url_location(start.path, config.init_from_accounts())
    if start.kind == "output":
        if not blob_exists(outputs, start.path):
            raise InitFromConfigError(
                f"init_from {asked}: no such blob in the output container {config.output.container}"
            )
        resolved = f"output:{start.path}"
        return Start(_with(config, resolved), asked, resolved, f"from the blob {start.path}")
    if start.kind == "data":
        target, md5 = _copy_from_data(config, start.path, outputs)
        resolved = f"output:{target}"
        why = f"from the data container's blob {start.path} (copied to {target})"
        return Start(_with(config, resolved), asked, resolved, why, md5=md5)
    assert start.kind == "nfs"
    if config.target == "local":
        file = config.nfs.local_dir / start.path
        if not file.is_file():
            raise InitFromConfigError(
                f"init_from {asked}: {file} does not exist (nfs: paths are below nfs.local_dir)"
            )
    return Start(config, asked, asked, f"from the file {start.path} on NFS")


def resolve_start(config: PipelineConfig) -> Start:
    """``training.init_from`` resolved and checked (the module docstring)."""
    value = config.training.init_from
    if value is None:
        return Start(config, None, None, "from scratch: training.init_from is null")
    outputs = container_client(config.output, config.retries.storage_retries)
    parsed = parse_init_from(value)
    if parsed.kind == "champion":
        return _champion(config, outputs)
    return _location(config, parsed, outputs)


@step("resolve-init-from")
def resolve_init_from(config: PipelineConfig, run: Run) -> Done[Start]:
    """The run's starting weights, before anything is provisioned; a run that starts from
    scratch is told so too."""
    start = resolve_start(config)
    get_run_logger().info("run %s starts %s", run.id, start.why)
    return Done(start.resolved is not None, start, start.as_record())
