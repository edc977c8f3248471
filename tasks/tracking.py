"""MLflow tracking of a training run, logged by the orchestrator (never by the nodes).

One MLflow run per training: its parameters (the training section, the data version, the code
version, what the model started from), one point per epoch of loss and accuracy as the
trainer's ``PROGRESS`` lines arrive, the final metrics, the charts and ``model.onnx``, and a
link back to the Prefect flow run. Its model is registered as a version of the data root's
registered model (champions are per data root), and the ``champion`` alias moves to it when,
and only when, the pipeline promotes it.

Tracking never fails or stalls a run. Every call goes through one background thread, in
order, so a slow server never holds the trainer's output or a step; the run waits only for its
MLflow run's creation and, at its end, for what is still queued, each for a bounded time.
MLflow's HTTP client retries and waits as its environment says
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``_TIMEOUT``, ``_BACKOFF_FACTOR``), bounded here to seconds
where the user has not set them; the first failure is a warning in the run's log and turns
tracking off for the rest of the run, so a server that is down costs one bounded wait, not one
per epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.config import PipelineConfig, hide_credentials
from core.data_versions import DataRoot, DataVersion
from core.run import Run
from registry.layout import dataset_key

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient
    from mlflow import MlflowClient

    from registry.promotion import Decision

CHAMPION_ALIAS = "champion"
# MLflow's own defaults wait minutes for a server that does not answer (7 retries, 120 s per
# request); a run waits at most about a minute for each of the few calls made before tracking
# is turned off. A value the user set in the environment is kept.
HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
START_SECONDS = 90.0  # the longest the run waits for its MLflow run to be created
FLUSH_SECONDS = 180.0  # the longest the run waits at its end for what is still queued
REGISTRATION_WAIT_SECONDS = 30  # for a registry that creates versions asynchronously
EPOCH_METRICS = ("train_loss", "train_accuracy", "val_accuracy", "lr", "images_per_sec")
_METRIC_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow accepts in a key


def registered_model_name(model_name: str, root: DataRoot) -> str:
    """The registered model of a data root: champions, and so the alias, are per data root."""
    return f"{model_name}-{dataset_key(root)}"


def metric_key(name: str) -> str:
    """``name`` as an MLflow metric key (a class name may hold any character)."""
    return _METRIC_KEY.sub("_", name)[:250]


def number(value: Any) -> float | None:
    """A finite number, or None (a bool, a string, a NaN are not metrics)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def final_metrics(metrics: dict[str, Any], score: dict[str, Any]) -> dict[str, float]:
    """The figures of a trained and scored model: the scorer's on the test split (``test_*``,
    per class recall and F1), and the trainer's own numbers (``trainer.*``, one level of
    nesting: an export check's figures, for instance)."""
    found: dict[str, float] = {}
    for key, value in score.items():
        if (v := number(value)) is not None:
            found[metric_key(f"test_{key}")] = v
    for name, per_class in (score.get("per_class") or {}).items():
        for figure in ("recall", "f1"):
            if isinstance(per_class, dict) and (v := number(per_class.get(figure))) is not None:
                found[metric_key(f"test_{figure}.{name}")] = v
    for key, value in metrics.items():
        if (v := number(value)) is not None:
            found[metric_key(f"trainer.{key}")] = v
        elif isinstance(value, dict):
            for inner, item in value.items():
                if (v := number(item)) is not None:
                    found[metric_key(f"trainer.{key}.{inner}")] = v
    return found


def run_params(
    config: PipelineConfig, data: DataVersion, code_version: str, staged_version: str
) -> dict[str, str]:
    """What the run trained with: the training section, the data and the code."""
    params = {
        f"training.{k}": v if isinstance(v, str) else json.dumps(v)
        for k, v in dataclasses.asdict(config.training).items()
    }
    params.update(
        {
            "data.container": data.container,
            "data.root": data.root,
            "data.version": data.version or "",
            "data.staged_version": staged_version,
            "code_version": code_version,
            "processes": str(config.pool.nodes * config.pool.processes_per_node),
        }
    )
    return params


class Tracker:
    """The MLflow run of one training, or nothing when tracking is off (every method is then
    a no-op). What the methods log is sent by the tracker's own thread: only ``start`` and
    ``end`` wait for it, each for a bounded time."""

    def __init__(self, config: PipelineConfig, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say  # a warning in the run's log
        self.off: str | None = None if config.tracking.mlflow_uri else "tracking is off"
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.link: str | None = None  # the MLflow run's page, for the summary
        self.version: str | None = None  # the model version registered
        self._client: MlflowClient | None = None
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ended = False

    # -- the run's turns --------------------------------------------------------------------

    def start(
        self,
        run: Run,
        data: DataVersion,
        code_version: str,
        staged_version: str,
        flow_run_id: str | None = None,
        flow_run_url: str | None = None,
    ) -> None:
        """Create the MLflow run: the one call the run waits for (its id makes the link), for
        at most ``START_SECONDS``."""
        if self.off:
            return
        for name, value in HTTP_BOUNDS.items():
            os.environ.setdefault(name, value)
        tags = {
            "retrain.run_id": run.id,
            "retrain.data_root": self.config.data.root.where,
            **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {}),
            **({"prefect.flow_run_url": flow_run_url} if flow_run_url else {}),
        }
        note = f"Retrain run `{run.id}`"
        if flow_run_url:
            note += f": [the Prefect flow run]({flow_run_url})"
        tags["mlflow.note.content"] = note

        def create() -> None:
            client = self.client()
            experiment = client.get_experiment_by_name(self.config.tracking.experiment)
            self.experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(self.config.tracking.experiment)
            )
            created = client.create_run(self.experiment_id, run_name=run.id, tags=tags)
            self.run_id = created.info.run_id
            self.link = self._run_link()

        created = threading.Event()

        def create_then_say() -> None:
            try:
                create()
            finally:
                created.set()

        self._thread = threading.Thread(target=self._work, name="mlflow-tracking", daemon=True)
        self._thread.start()
        self._send("starting the MLflow run", create_then_say)
        # Bounded even where MLflow's HTTP bounds are not the wait (a plugin's sign-in).
        if not created.wait(START_SECONDS) and not self.off:
            self.off = f"starting the MLflow run took more than {START_SECONDS:.0f} s"
            self.say(f"tracking: {self.off}; MLflow tracking is off for the rest of this run")
        if self.off:
            return
        params = run_params(self.config, data, code_version, staged_version)
        self._send("logging the run's parameters", lambda: self._log(params=params))

    def epoch(self, record: dict[str, Any]) -> None:
        """One trainer ``PROGRESS`` record: its epoch's loss and accuracy, as a point at its
        epoch (a retried attempt's epochs land on the same steps)."""
        if self.off or "epoch" not in record:
            return
        step = int(record["epoch"])
        values = {k: v for k in EPOCH_METRICS if (v := number(record.get(k))) is not None}
        self._send(f"logging epoch {step}", lambda: self._log(metrics=values, step=step))

    def trained(self, metrics: dict[str, Any], score: dict[str, Any]) -> None:
        """The trained model's final figures, and what it started from (``init_from`` in
        metrics.json, when the trainer warm-started it)."""
        if self.off:
            return
        params = {}
        if "init_from" in metrics:
            start = metrics["init_from"]
            params["init_from"] = start if isinstance(start, str) else json.dumps(start)
        figures = final_metrics(metrics, score)
        self._send("logging the final metrics", lambda: self._log(params=params, metrics=figures))

    def decided(self, run: Run, decision: Decision, metrics: dict[str, Any]) -> None:
        """Log the model (``model.onnx`` when the trainer wrote one, and where ``model.pt``
        is), register it as a version of the data root's model, and move the ``champion``
        alias to it when the pipeline promoted it."""
        if self.off:
            return
        self._send("registering the model", lambda: self._register(run, decision, metrics))

    def reported(self, run: Run) -> None:
        """The run's charts (the report saved them with the outputs) as artifacts."""
        if self.off:
            return
        self._send("logging the charts", lambda: self._log_blobs(run, "charts/", "charts"))

    def end(self, failed: BaseException | None = None) -> None:
        """End the MLflow run (FAILED when the flow run failed after training began), and wait
        a bounded time for what is still queued."""
        if self.off or self._ended:
            self._stop()
            return
        self._ended = True
        status = "FAILED" if failed is not None else "FINISHED"
        self._send(
            "ending the MLflow run", lambda: self.client().set_terminated(self._id(), status)
        )
        self._stop()

    # -- the work -----------------------------------------------------------------------------

    def client(self) -> MlflowClient:
        if self._client is None:
            from mlflow import MlflowClient

            uri = self.config.tracking.mlflow_uri
            self._client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        return self._client

    def _id(self) -> str:
        assert self.run_id is not None
        return self.run_id

    def _run_link(self) -> str | None:
        uri = self.config.tracking.mlflow_uri or ""
        if not uri.startswith(("http://", "https://")):
            return None  # an Azure ML workspace: its studio shows the run by its id
        return f"{uri}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _log(
        self,
        params: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        step: int = 0,
    ) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        self.client().log_batch(
            self._id(),
            metrics=[Metric(k, v, now, step) for k, v in (metrics or {}).items()],
            params=[Param(k, v) for k, v in (params or {}).items()],
        )

    def _outputs(self) -> ContainerClient:
        from backends.blob import container_client

        return container_client(self.config.output, self.config.retries.storage_retries)

    def _log_blobs(self, run: Run, below: str, artifact_path: str) -> None:
        outputs = self._outputs()
        prefix = f"{run.output_prefix}/{below}"
        with tempfile.TemporaryDirectory(prefix="retrain-mlflow-") as tmp:
            for blob in outputs.list_blobs(name_starts_with=prefix):
                name = blob.name[len(prefix) :]
                if not name or "/" in name:
                    continue
                local = Path(tmp) / name
                with local.open("wb") as out:
                    outputs.download_blob(blob.name).readinto(out)
                self.client().log_artifact(self._id(), str(local), artifact_path)

    def _register(self, run: Run, decision: Decision, metrics: dict[str, Any]) -> None:
        from azure.core.exceptions import ResourceNotFoundError
        from mlflow.exceptions import MlflowException

        client = self.client()
        outputs = self._outputs()
        pointer = {
            "run_id": run.id,
            "container": self.config.output.container,
            "model_pt": f"{run.output_prefix}/model.pt",
            "model_md5": metrics.get("model_md5"),
            "class_names": metrics.get("class_names"),
            "input_size": metrics.get("input_size"),
            "promoted": decision.promoted,
            "reason": decision.reason,
        }
        with tempfile.TemporaryDirectory(prefix="retrain-mlflow-") as tmp:
            folder = Path(tmp) / "model"
            folder.mkdir()
            (folder / "model.json").write_text(json.dumps(pointer, indent=2))
            with contextlib.suppress(ResourceNotFoundError):  # a trainer without ONNX export
                data = outputs.download_blob(f"{run.output_prefix}/model.onnx")
                with (folder / "model.onnx").open("wb") as out:
                    data.readinto(out)
            client.log_artifacts(self._id(), str(folder), "model")
        name = registered_model_name(self.config.tracking.model_name, self.config.data.root)
        try:
            client.create_registered_model(
                name, description=f"champions of data root {self.config.data.root.where}"
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        artifact_uri = client.get_run(self._id()).info.artifact_uri
        version = client.create_model_version(
            name,
            f"{artifact_uri}/model",
            run_id=self._id(),
            tags={"retrain.run_id": run.id, "retrain.promoted": str(decision.promoted).lower()},
            description=decision.reason[:5000],
            await_creation_for=REGISTRATION_WAIT_SECONDS,
        )
        self.version = str(version.version)
        if decision.promoted:
            client.set_registered_model_alias(name, CHAMPION_ALIAS, self.version)

    # -- the thread and its failures ----------------------------------------------------------

    def _call(self, what: str, work: Callable[[], None]) -> None:
        if self.off:
            return
        try:
            work()
        except Exception as exc:
            first = hide_credentials((str(exc).strip().splitlines() or [""])[0])[:300]
            self.off = f"{what} failed: {type(exc).__name__}: {first}"
            self.say(
                f"tracking: {self.off}; MLflow tracking is off for the rest of this run (the "
                f"run itself goes on), server {self.config.tracking.mlflow_uri}"
            )

    def _send(self, what: str, work: Callable[[], None]) -> None:
        if not self.off and self._thread is not None:
            self._queue.put(lambda: self._call(what, work))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            item()

    def _stop(self) -> None:
        """Let the thread finish what is queued, for at most ``FLUSH_SECONDS``."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(FLUSH_SECONDS)
        if thread.is_alive():
            self.off = f"the MLflow server took more than {FLUSH_SECONDS:.0f} s"
            self.say(
                f"tracking: {self.off} to take the run's last records; what is left is not "
                "logged (the run itself is not held up)"
            )
