"""The MLflow registry kept to the pipeline's truth: the champion record (``registry.champion``)
decides which model serves a data root, and MLflow's ``champion`` alias follows it.

The alias is moved by the run that promotes, through the tracker (``tasks/tracking.py``); a
server that refused that run's calls, even the retry at its end, leaves the alias on the model
before, the new model unregistered and the MLflow run ``RUNNING``. :func:`reconcile`, at the next
run's start, puts MLflow back in line with the records: the champion's model registered (from
its MLflow run, or a run made for it), the alias moved to it, and a run whose flow run has ended
(its ``run.json`` says how) ended too. Each repair is a sentence for the run's summary.

Registration is idempotent (:func:`register`): a version is found by the retrain run id it is
tagged with before one is created, so a retry after a lost answer registers nothing twice.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.champion import Champion

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION_ALIAS = "champion"
REGISTRATION_WAIT_SECONDS = 30  # for a registry that creates versions asynchronously
RUNNING_RUNS_CHECKED = 200  # runs left RUNNING looked at per reconcile, newest first
# What a retrain run id and a registered model's name hold (core/run.py and the config's
# tracking.model_name with registry.layout.dataset_key make them so): a search filter quotes
# nothing else, so a champion record edited to hold a quote filters nothing.
_RUN_ID = re.compile(r"[A-Za-z0-9._-]+\Z")


@dataclass(frozen=True)
class ModelFiles:
    """What a model version's ``model/`` folder holds: ``model.json`` (where ``model.pt`` is,
    its MD5, classes and input size) and ``model.onnx`` when the trainer wrote one."""

    pointer: dict[str, Any]
    onnx: Path | None = None


def _quoted(value: str) -> str:
    if not _RUN_ID.match(value):
        raise ValueError(f"{value!r} is not a name a run writes")
    return f"'{value}'"


def version_of(client: MlflowClient, name: str, run_id: str) -> str | None:
    """The version of registered model ``name`` of retrain run ``run_id``, if registered."""
    found = client.search_model_versions(
        f"name = {_quoted(name)} and tags.`retrain.run_id` = {_quoted(run_id)}"
    )
    return str(max(int(v.version) for v in found)) if found else None


def alias_version(client: MlflowClient, name: str) -> str | None:
    """The version the ``champion`` alias of ``name`` names (None: no alias, no model)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def register(
    client: MlflowClient,
    name: str,
    description: str,
    mlflow_run: str,
    run_id: str,
    files: ModelFiles,
    promoted: bool,
    reason: str,
) -> str:
    """The version of ``run_id``'s model in ``name``: the one registered already, or one made
    from ``files`` logged into the MLflow run ``mlflow_run`` (``model/``); the ``champion``
    alias is moved to it when ``promoted``."""
    import json

    from mlflow.exceptions import MlflowException

    version = version_of(client, name, run_id)
    if version is None:
        with tempfile.TemporaryDirectory(prefix="retrain-mlflow-") as tmp:
            folder = Path(tmp) / "model"
            folder.mkdir()
            (folder / "model.json").write_text(json.dumps(files.pointer, indent=2))
            if files.onnx is not None:
                (folder / "model.onnx").write_bytes(files.onnx.read_bytes())
            client.log_artifacts(mlflow_run, str(folder), "model")
        try:
            client.create_registered_model(name, description=description)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        artifact_uri = client.get_run(mlflow_run).info.artifact_uri
        created = client.create_model_version(
            name,
            f"{artifact_uri}/model",
            run_id=mlflow_run,
            tags={"retrain.run_id": run_id, "retrain.promoted": str(promoted).lower()},
            description=reason[:5000],
            await_creation_for=REGISTRATION_WAIT_SECONDS,
        )
        version = str(created.version)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, version)
    return version


def _runs_of(client: MlflowClient, experiment_id: str, run_id: str) -> list[Any]:
    return list(
        client.search_runs(
            [experiment_id],
            f"tags.`retrain.run_id` = {_quoted(run_id)}",
            order_by=["attributes.start_time DESC"],
        )
    )


def end_finished_runs(
    client: MlflowClient,
    experiment_id: str,
    outcome: Callable[[str], str | None],
    current: str | None = None,
) -> list[str]:
    """End the MLflow runs left ``RUNNING`` whose flow run has ended: ``outcome`` gives a
    retrain run's recorded outcome (``registry.run_record``), None when there is no record (a
    run of another output prefix, or from before records). A run still ``running`` in its
    record is left alone: it may be running now."""
    notes = []
    for left in client.search_runs(
        [experiment_id], "attributes.status = 'RUNNING'", max_results=RUNNING_RUNS_CHECKED
    ):
        retrain = left.data.tags.get("retrain.run_id")
        if left.info.run_id == current or not isinstance(retrain, str):
            continue
        ended = outcome(retrain) if _RUN_ID.match(retrain) else None
        if ended in (None, "running"):
            continue
        status = "FAILED" if ended == "failed" else "FINISHED"
        client.set_terminated(left.info.run_id, status)
        notes.append(
            f"MLflow run {retrain} was left RUNNING after its flow run ended ({ended}): "
            f"ended as {status}"
        )
    return notes


def reconcile(
    client: MlflowClient,
    name: str,
    experiment_id: str,
    champion: Champion | None,
    files: Callable[[Champion], ModelFiles],
    outcome: Callable[[str], str | None],
    tags: Mapping[str, str] | None = None,
    current: str | None = None,
) -> list[str]:
    """Put registered model ``name`` (of one data root, experiment ``experiment_id``) back in
    line with the root's champion record ``champion``; what was repaired, as sentences.

    ``files``: the champion's ``model/`` folder, asked for only when its model was never
    registered; ``outcome``: a retrain run's recorded outcome (:func:`end_finished_runs`);
    ``tags``: of an MLflow run made for a champion that has none; ``current``: this run's own
    MLflow run, left alone. With no champion record nothing of the alias is touched: the
    pipeline has no champion to say where it belongs."""
    notes = end_finished_runs(client, experiment_id, outcome, current)
    if champion is None or not _RUN_ID.match(champion.run_id):
        return notes
    moved_from = alias_version(client, name)
    target = version_of(client, name, champion.run_id)
    if target is None:
        runs = _runs_of(client, experiment_id, champion.run_id)
        if runs:
            mlflow_run = runs[0].info.run_id
        else:
            made = client.create_run(
                experiment_id,
                run_name=champion.run_id,
                tags={**(tags or {}), "retrain.run_id": champion.run_id, "retrain.reconciled": "1"},
            )
            mlflow_run = made.info.run_id
            client.set_terminated(mlflow_run, "FINISHED")
        target = register(
            client,
            name,
            f"champions of data root {champion.root.where if champion.root else '?'}",
            mlflow_run,
            champion.run_id,
            files(champion),
            True,
            f"the recorded champion ({champion.metric} {champion.value:.4f}), registered from "
            "its record by a later run: the run that promoted it could not reach MLflow",
        )
        notes.append(
            f"the recorded champion, run {champion.run_id}, was not registered in MLflow: "
            f"registered as version {target} of {name}"
        )
    if moved_from != target:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, target)
        was = f"version {moved_from}" if moved_from else "no version"
        notes.append(
            f"the `champion` alias of {name} named {was}, not the recorded champion's (run "
            f"{champion.run_id}): moved to version {target}"
        )
    return notes
