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

What MLflow must not miss does not depend on that switch: the model's registration, the alias
when the pipeline promoted it, and the run's end are tried again at the run's end, once, on a
thread of their own and for a bounded time; and each run, when its MLflow run is made, first
puts the registry back in line with the champion record (``registry.mlflow_registry``): a
stale alias moved, an unregistered champion registered, a run left ``RUNNING`` by an ended flow
run ended, each named in the summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.config import PipelineConfig, hide_credentials
from core.data_versions import DataRoot, DataVersion
from core.mlflow_env import mlflow_environment
from core.run import Run, output_prefix
from registry.layout import dataset_key
from registry.mlflow_registry import CHAMPION_ALIAS, ModelFiles, register

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient
    from mlflow import MlflowClient

    from registry.champion import Champion
    from registry.promotion import Decision

__all__ = ["CHAMPION_ALIAS", "HTTP_BOUNDS", "Tracker", "TrackingSummary"]
# MLflow's UI opens on its GenAI view unless told otherwise: its links name the classic one, and
# the experiment says it is one of machine learning (its kind, which the UI reads).
UI_VIEW = "workflowType=machine_learning"
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
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
CATCH_UP_SECONDS = 120.0  # the longest the run waits at its end for the retry of the essentials
METRICS_BYTES = 64 << 20  # a champion's metrics.json, read for its model's pointer
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


@dataclass(frozen=True)
class TrackingSummary:
    """What the run's summary says of tracking: the MLflow run's page, the experiment's runs,
    and what this run put back in line with the champion record."""

    run_link: str | None
    runs_link: str | None
    notes: tuple[str, ...] = ()


class Tracker:
    """The MLflow run of one training, or nothing when tracking is off (every method is then
    a no-op). What the methods log is sent by the tracker's own thread: only ``start`` and
    ``end`` wait for it, each for a bounded time."""

    def __init__(self, config: PipelineConfig, say: Callable[[str], None]) -> None:
        self.config = config
        self.say = say  # a warning in the run's log
        self.enabled = bool(config.tracking.mlflow_uri)
        self.off: str | None = None if self.enabled else "tracking is off"
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.link: str | None = None  # the MLflow run's page, for the summary
        self.version: str | None = None  # the model version registered
        self.notes: list[str] = []  # what was put back in line with the champion record
        self._client: MlflowClient | None = None
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ended = False
        # What MLflow must not miss, kept whatever the switch says, for the retry at the end.
        self._create: Callable[[], None] | None = None
        self._decision: tuple[Run, Decision, dict[str, Any]] | None = None
        self._registered = False
        self._status = "FINISHED"
        self._terminated = False
        self._caught_up = False

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
        at most ``START_SECONDS``; then put the registry in line with the champion record."""
        if not self.enabled:
            return
        mlflow_environment(defaults=HTTP_BOUNDS)
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
        params = run_params(self.config, data, code_version, staged_version)

        def create() -> None:
            client = self.client()
            self.experiment_id = self._experiment(client)
            created = client.create_run(self.experiment_id, run_name=run.id, tags=tags)
            self.run_id = created.info.run_id
            self.link = self._ui(f"experiments/{self.experiment_id}/runs/{self.run_id}")
            self._log(params=params)

        self._create = create
        started = threading.Event()

        def create_then_reconcile() -> None:
            try:
                create()
                # Before this run decides anything; a repair that fails is a warning only.
                self._soft("putting MLflow in line with the champion record", self._reconcile)
            finally:
                started.set()

        self._thread = threading.Thread(target=self._work, name="mlflow-tracking", daemon=True)
        self._thread.start()
        self._send("starting the MLflow run", create_then_reconcile)
        # Bounded even where MLflow's HTTP bounds are not the wait (a plugin's sign-in).
        if not started.wait(START_SECONDS) and not self.off:
            self.off = f"starting the MLflow run took more than {START_SECONDS:.0f} s"
            self.say(f"tracking: {self.off}; MLflow tracking is off for the rest of this run")

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
        alias to it when the pipeline promoted it. Kept for the retry at the run's end when
        tracking is off after a failure."""
        if not self.enabled:
            return
        self._decision = (run, decision, metrics)
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
        a bounded time for what is still queued; then, if a failure turned tracking off, try
        once more what MLflow must not miss."""
        if not self.enabled:
            return
        if not self._ended:
            self._ended = True
            self._status = "FAILED" if failed is not None else "FINISHED"
            self._send("ending the MLflow run", self._terminate)
        self._stop()
        self._catch_up()

    def summary(self) -> TrackingSummary | None:
        """For the run's summary: links, and what this run repaired (None when untracked)."""
        if self.link is None and not self.notes:
            return None
        runs = self._ui(f"experiments/{self.experiment_id}/runs") if self.experiment_id else None
        return TrackingSummary(self.link, runs, tuple(self.notes))

    # -- the work -----------------------------------------------------------------------------

    def client(self) -> MlflowClient:
        if self._client is None:
            mlflow_environment(defaults=HTTP_BOUNDS)  # before mlflow is first imported
            from mlflow import MlflowClient

            uri = self.config.tracking.mlflow_uri
            self._client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        return self._client

    def _experiment(self, client: MlflowClient) -> str:
        """The config's experiment, made if missing, and marked as one of machine learning."""
        name = self.config.tracking.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            return str(client.create_experiment(name, tags=dict([EXPERIMENT_KIND])))
        key, kind = EXPERIMENT_KIND
        if key not in (experiment.tags or {}):
            client.set_experiment_tag(experiment.experiment_id, key, kind)
        return str(experiment.experiment_id)

    def _id(self) -> str:
        assert self.run_id is not None
        return self.run_id

    def _ui(self, route: str) -> str | None:
        uri = self.config.tracking.mlflow_uri or ""
        if not uri.startswith(("http://", "https://")):
            return None  # an Azure ML workspace: its studio shows the run by its id
        return f"{uri}/#/{route}?{UI_VIEW}"

    def _terminate(self) -> None:
        self.client().set_terminated(self._id(), self._status)
        self._terminated = True

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

    def _model_files(
        self,
        run_id: str,
        prefix: str,
        metrics: dict[str, Any],
        promoted: bool,
        reason: str,
        tmp: Path,
    ) -> ModelFiles:
        """``model/`` of a run's model: where ``model.pt`` is (and its MD5, classes, input
        size) and ``model.onnx`` when the trainer wrote one."""
        from azure.core.exceptions import ResourceNotFoundError

        pointer = {
            "run_id": run_id,
            "container": self.config.output.container,
            "model_pt": f"{prefix}/model.pt",
            "model_md5": metrics.get("model_md5"),
            "class_names": metrics.get("class_names"),
            "input_size": metrics.get("input_size"),
            "promoted": promoted,
            "reason": reason,
        }
        onnx: Path | None = tmp / "model.onnx"
        try:
            data = self._outputs().download_blob(f"{prefix}/model.onnx")
            with onnx.open("wb") as out:  # type: ignore[union-attr]
                data.readinto(out)
        except ResourceNotFoundError:  # a trainer without ONNX export
            onnx = None
        return ModelFiles(pointer, onnx)

    def _name(self) -> str:
        return registered_model_name(self.config.tracking.model_name, self.config.data.root)

    def _register(self, run: Run, decision: Decision, metrics: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="retrain-mlflow-") as tmp:
            files = self._model_files(
                run.id, run.output_prefix, metrics, decision.promoted, decision.reason, Path(tmp)
            )
            self.version = register(
                self.client(),
                self._name(),
                f"champions of data root {self.config.data.root.where}",
                self._id(),
                run.id,
                files,
                decision.promoted,
                decision.reason,
            )
        self._registered = True

    def _reconcile(self) -> None:
        """The registry in line with the champion record of the run's data root, before this
        run decides anything (``registry.mlflow_registry.reconcile``)."""
        from registry.champion import champion_for
        from registry.mlflow_registry import reconcile
        from registry.record_blob import json_object, read_record
        from registry.run_record import RunRecord, read_run_record

        outputs = self._outputs()
        base, root = self.config.output.prefix, self.config.data.root
        read = champion_for(outputs, base, root)

        def outcome(run_id: str) -> str | None:
            record = read_run_record(outputs, output_prefix(base, run_id))
            return record.outcome if isinstance(record, RunRecord) else None

        with tempfile.TemporaryDirectory(prefix="retrain-mlflow-") as tmp:

            def files(champion: Champion) -> ModelFiles:
                prefix = champion.model.rsplit("/", 1)[0]
                stored = read_record(outputs, f"{prefix}/metrics.json", METRICS_BYTES)
                doc = json_object(stored.data, stored.limit) if stored else None
                why = "the recorded champion, registered from its record by a later run"
                return self._model_files(
                    champion.run_id,
                    prefix,
                    doc if isinstance(doc, dict) else {},
                    True,
                    why,
                    Path(tmp),
                )

            notes = reconcile(
                self.client(),
                self._name(),
                str(self.experiment_id),
                read.champion,
                files,
                outcome,
                {"retrain.data_root": root.where},
                self.run_id,
            )
        for line in notes:
            self.notes.append(line)
            self.say(f"tracking: put in line with the champion record: {line}")

    # -- the thread, its failures and the retry at the end --------------------------------------

    def _call(self, what: str, work: Callable[[], None]) -> None:
        if self.off:
            return
        try:
            work()
        except Exception as exc:
            self.off = f"{what} failed: {type(exc).__name__}: {_first_line(exc)}"
            self.say(
                f"tracking: {self.off}; MLflow tracking is off for the rest of this run (the "
                f"run itself goes on; its registration and end are tried again at its end), "
                f"server {self.config.tracking.mlflow_uri}"
            )

    def _soft(self, what: str, work: Callable[[], None]) -> None:
        """``work``, whose failure is a warning that leaves tracking on."""
        try:
            work()
        except Exception as exc:
            self.say(
                f"tracking: {what} failed: {type(exc).__name__}: {_first_line(exc)} (tracking "
                "goes on)"
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

    def _left(self) -> list[str]:
        """What MLflow must not miss and has not got: the run (when there is a model to
        register), the model's registration and alias, the run's end."""
        left = []
        if self.run_id is None and self._decision is not None:
            left.append("the MLflow run")
        if self._decision is not None and not self._registered:
            promoted = self._decision[1].promoted
            left.append(
                "the model's registration" + (" and the champion alias" if promoted else "")
            )
        if (self.run_id is not None or self._decision is not None) and not self._terminated:
            left.append("the run's end")
        return left

    def _catch_up(self) -> None:
        """Once, after a failure turned tracking off: the MLflow run (if it was never made and
        a model was decided on), the model's registration and alias, and the run's end, on a
        thread of its own for at most ``CATCH_UP_SECONDS``."""
        if self._caught_up or not self.enabled or self.off is None:
            return
        self._caught_up = True
        left = self._left()
        if not left or self._create is None:
            return
        create = self._create
        failure: list[str] = []

        def again() -> None:
            try:
                if self.run_id is None:
                    create()
                if self._decision is not None and not self._registered:
                    self._register(*self._decision)
                if not self._terminated:
                    self._terminate()
            except Exception as exc:
                failure.append(f"{type(exc).__name__}: {_first_line(exc)}")

        thread = threading.Thread(target=again, name="mlflow-catch-up", daemon=True)
        thread.start()
        thread.join(CATCH_UP_SECONDS)
        what = ", ".join(left)
        if thread.is_alive() or failure:
            why = failure[0] if failure else f"no answer in {CATCH_UP_SECONDS:.0f} s"
            self.say(
                f"tracking: at the run's end, {what} failed again ({why}); the next run puts "
                "MLflow in line with the champion record when it starts"
            )
        else:
            self.say(f"tracking: at the run's end, {what} reached MLflow after all")


def _first_line(exc: BaseException) -> str:
    return hide_credentials((str(exc).strip().splitlines() or [""])[0])[:300]
