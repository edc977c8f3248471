"""The retrain flow: gate the data, provision concurrently, train with Horovod, score, promote.

``python -m flows.retrain --config configs/local.yaml [--set training.epochs=3 ...]`` runs one
flow run in this process. Deployments run the same flow with the config as a typed parameter.
Heavy libraries (Great Expectations, torch, the Azure SDKs) are imported inside the tasks that
use them, so loading this module stays cheap.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any, cast

from prefect import Flow, State, flow, get_run_logger
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import deployment, flow_run
from prefect.states import Failed
from prefect.utilities.urls import url_for

from core.config import ConfigError, PipelineConfig
from core.data_versions import DataVersion
from core.deployment_runs import deployment_config_path
from core.recipe import explicit_training_fields
from core.run import Run
from core.run_config import RunRequest, build_run_config
from flows.config_args import add_config_arguments
from flows.form import FormConfig, run_form_signature
from flows.pool_lock import hold_pool, local_pool_lock
from training.architectures import ModelName

if TYPE_CHECKING:
    from tasks.outcome import RunLog
    from tasks.tracking import Tracker


def _release_after_abort(flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Crash and cancellation hook: the pool is released even when the flow body cannot, unless
    another run holds it by now (that run releases it; releasing here would stop its tasks)."""
    from backends.target import target_for

    config = build_run_config(
        RunRequest.from_parameters(flow_run.parameters),
        deployment_path=deployment_config_path(flow_run.deployment_id),
        deployed=bool(flow_run.deployment_id),
    ).config
    with local_pool_lock(config, f"flow run {flow_run.id} (releasing)", wait=False) as free:
        if free:
            target_for(config).cluster().release()


@flow(name="retrain", on_cancellation=[_release_after_abort], on_crashed=[_release_after_abort])
def retrain(
    epochs: int | None = None,
    model: ModelName | None = None,
    data_container: str | None = None,
    data_prefix: str | None = None,
    data_version: str | None = None,
    force: bool = False,
    overrides: list[str] | None = None,
    config_path: str | None = None,
    config: FormConfig | None = None,
) -> dict[str, Any] | State[Any]:
    """Retrain the image classifier: gate the data, train (Horovod or DDP), score, promote.

    A run whose data, code and settings are those of a run that trained ends as up to date
    before anything is provisioned (force trains anyway).

    Args:
        epochs: The most training epochs (training stops earlier at its best epoch).
            Empty: the config's training.epochs (the file at config_path below, which the
            deployment sets), or, unset there too, a cap fitted to the data.
        model: The network to train (cnn is the small, fast one; training/architectures.py
            lists them). Empty: the config's.
        data_container: The Blob container with the training data. Empty: the config's
            data.container. The new-data trigger fills it in from its event.
        data_prefix: The data root in that container, e.g. images: its data versions are
            the folders directly below it, each complete once its _SUCCESS marker is written.
            Empty: the config's data.prefix. The new-data trigger fills it in too.
        data_version: The data version to train, a folder directly below the data root, e.g.
            v2. Empty: the newest complete version (or the whole root when it holds no
            versions). The new-data trigger fills in the version its event reports.
        force: Train even when data, code and settings equal those of a run that trained
            (which otherwise ends the run as up to date, before any node is rented).
        overrides: Other training settings, one per line as section.field=value, e.g.
            training.lr=0.1 or training.batch_size=32 (numbers, booleans and lists are read as
            YAML; null clears an optional field). Applied after the config, before the fields
            above. A run may change the training section and data.container, data.prefix and
            data.version; endpoints, credentials, the image and the pool are the config file's.
        config_path: The config file the run starts from (the deployment sets its own;
            another must be in the project's configs/ folder). Ignored when the advanced
            config below is filled in.
        config: Advanced: the whole config, every field, starting from the values of the
            config file the deployment was made with. Filled in, it replaces the file at
            config_path; only its training section and data.container, data.prefix and
            data.version may differ from the deployment's config file.
    """
    from tasks.cost import OverBudgetError
    from tasks.outcome import RunLog
    from tasks.tracking import Tracker
    from tasks.validate import REFUSALS

    logger = get_run_logger()
    request = RunRequest(
        config=config,
        config_path=config_path,
        overrides=tuple(overrides or ()),
        epochs=epochs,
        model=model,
        data_container=data_container,
        data_prefix=data_prefix,
        data_version=data_version,
    )
    run: Run | None = None
    try:
        effective = build_run_config(
            request,
            deployment_path=deployment_config_path(deployment.id),
            deployed=bool(deployment.id),
        )
        run_config = effective.config
        logger.info("config: %s", effective.source)
        run = Run.start(flow_run.get_id(), run_config.output.prefix, run_config.work_dir)
        record = RunLog(run_config, run)
    except Exception as exc:  # a config it cannot use, a record it cannot write
        _announce_failure(run, exc)
        raise
    tracker = Tracker(run_config, logger.warning)
    refusals: tuple[type[Exception], ...] = (*REFUSALS, OverBudgetError)
    try:
        explicit = explicit_training_fields(
            request.overrides, request.run_fields(), deployed=bool(deployment.id)
        )
        return _retrain(
            run_config, effective.source, run, record, force, tracker, explicit, effective.base
        )
    except refusals as exc:
        # The data gate refused the data, or the budget the run, naming why in its artifact and
        # its step's log: the run ends failed with that message, not as an error in the code
        # (no traceback).
        record.failed(exc)
        _announce_failure(run, exc)
        tracker.end(exc)
        return Failed(message=str(exc))
    except BaseException as exc:
        if isinstance(exc, Exception):
            record.failed(exc)
            _announce_failure(run, exc)
        tracker.end(exc)
        raise


def _announce_failure(run: Run | None, exc: Exception) -> None:
    """The failure as an event naming the step it came out of, for the alerts (a crash, which
    reaches no code here, is told by Prefect's own event)."""
    from core.run_events import run_failed
    from registry.run_record import error_summary
    from tasks.steps import failed_step

    run_failed(run.id if run else str(flow_run.get_id()), failed_step(exc), error_summary(exc))


def _retrain(
    run_config: PipelineConfig,
    source: str,
    run: Run,
    record: RunLog,
    force: bool,
    tracker: Tracker,
    explicit: dict[str, str],
    base: str,
) -> dict[str, Any]:
    """The flow's body once the run has its config, id and record."""
    from backends.target import target_for
    from core.links import output_link
    from core.run_events import model_promoted
    from tasks.cost import (
        BudgetWatch,
        PoolMeter,
        data_counts,
        estimate_cost,
        provisional_cost,
        run_cost_record,
    )
    from tasks.fit_to_data import fit_to_data
    from tasks.follow_champion import follow_champion
    from tasks.init_from import resolve_init_from
    from tasks.promote import promote
    from tasks.provision import build_image, ensure_pool, release_pool, stage_data, upload_scripts
    from tasks.report import report
    from tasks.steps import StepRecord
    from tasks.train_and_score import collect_and_score, run_training, training_key
    from tasks.up_to_date import check_up_to_date, remember_run, report_up_to_date
    from tasks.validate import validate_data

    logger = get_run_logger()
    target = target_for(run_config)
    cluster = target.cluster()
    steps: list[StepRecord] = []
    meter = PoolMeter(run_config, cluster, run.id)  # node-minutes from the pool's own timestamps
    fresh = False
    trained = scored = watch = None
    cost: dict[str, Any] = {}
    # One run per pool at a time, across deployments, shells and machines (flows/pool_lock.py).
    holder = f"flow run {flow_run.get_id() or run.id}"
    with hold_pool(run_config, holder, shared=cluster.shared, say=logger.info):
        try:
            gate = validate_data(run_config, run)
            steps.append(gate.record)
            data = gate.value.version
            record.chose(data)
            # From here on the run names its version: staging, checkpoints, the champion.
            run_config = run_config.model_copy(
                update={"data": run_config.data.pinned(data.version)}
            )
            target = target_for(run_config)
            warm_from = None  # the epochs the followed champion's training ran
            if run_config.training.follow_champion:
                # The champion's recipe and weights, but what this run sets itself.
                followed = follow_champion(run_config, explicit, run, base)
                steps.append(followed.record)
                run_config = followed.value.config
                target = target_for(run_config)
                warm_from = followed.value.champion_epochs
            if gate.value.facts is not None:
                # What the config, the run and the recipe leave unset, fitted to the data.
                fitted = fit_to_data(run_config, gate.value.facts, run, warm_from)
                steps.append(fitted.record)
                run_config = fitted.value
                target = target_for(run_config)
            if run_config.training.init_from is not None:
                # What training starts from, resolved and checked before anything is
                # provisioned; the resolved weights are an input like the data (the checkpoint
                # key, the up-to-date fingerprint).
                start = resolve_init_from(run_config, run)
                steps.append(start.record)
                run_config = start.value.config
                target = target_for(run_config)
            check = check_up_to_date(run_config, gate.value, force)
            steps.append(check.record)
            fresh = check.value.fresh
            if fresh:  # nothing was provisioned: nothing to release
                result = report_up_to_date(run.id, steps, check.value, run_config, source)
                record.ended("up to date", check.value.why, None, result["matched_run"])
                return result
            # What the run will cost, and whether the budget lets it start: the one place, once
            # its config is the effective one and before anything is provisioned.
            priced = estimate_cost(run_config, run, data_counts(gate.value.facts))
            steps.append(priced.record)
            meter.start(priced.value)
            # Counted by the monthly cap from now on; the measured figure replaces it at the end.
            record.paid(provisional_cost(priced.value))
            scripts_f = upload_scripts.submit(target)
            image_f = build_image.submit(target)
            pool_f = ensure_pool.submit(cluster)
            staged_f = stage_data.submit(
                target,
                cluster,
                run,
                wait_for=[pool_f, scripts_f] if target.stages_on_pool else [],
                return_state=False,
            )
            scripts, staged, pool = scripts_f.result(), staged_f.result(), pool_f.result()
            # Batch runs the training task in the image; the local cluster runs the trainer on
            # this machine's files, so there training does not wait for the image's build.
            image = image_f.result() if target.trains_in_image else None
            steps += [scripts.record, staged.record]
            image_at = len(steps)  # its record goes here, in the steps' order, when it ends
            steps.append(pool.record)
            key = training_key(run_config, staged.value.version, scripts.value)
            if force:  # a checkpoint of the same settings would resume: start afresh
                key = f"{key}-{run.id}"
            flow_run_id = flow_run.get_id()
            tracker.start(
                run,
                data,
                scripts.value,
                staged.value.version,
                flow_run_id,
                url_for("flow-run", obj_id=flow_run_id) if flow_run_id else None,
            )
            # Batch retries the task itself on the same nodes; the local cluster needs Prefect to.
            trainer = run_training.with_options(
                retries=0
                if cluster.retries_in_service
                else run_config.retries.training_attempts - 1,
                retry_delay_seconds=run_config.retries.backoff_seconds,
            )
            # Past what the run may spend, training is asked to stop at its next checkpoint.
            watch = BudgetWatch(
                priced.value, target.share(), f"train-{run.id}", meter.spent_so_far(), logger
            ).start()
            try:
                trained = trainer(run_config, cluster, run, key, tracker.epoch)
            finally:
                watch.stop()
            steps.append(trained.record)
            if trained.value.stopped_after is None:
                scored = collect_and_score(cluster, run)
                steps.append(scored.record)
                tracker.trained(scored.value.metrics, scored.value.score)
                promotion = promote(
                    run_config, cluster, run, scored.value.score, staged.value.version, data
                )
                steps.append(promotion.record)
                tracker.decided(run, promotion.value, scored.value.metrics)
                if promotion.value.promoted:
                    model_promoted(
                        run.id,
                        run_config.data.root.where,
                        promotion.value.reason,
                        run_config.promotion.metric,
                    )
        finally:
            if not fresh:
                meter.before_release()
                steps.append(release_pool(cluster).record)
                if meter.plan is not None:  # what a run that provisioned paid, whatever its end
                    cost = meter.report()
                    if watch is not None:  # a stop request it could not write
                        cost = watch.note(cost)
                    record.paid(
                        run_cost_record(
                            cost,
                            meter.plan,
                            data_counts(gate.value.facts).images,
                            _work(run_config, trained, scored),
                        )
                    )
        # Scoring, promotion and the pool's release need no image (the local cluster trains on
        # this machine's files); only the report does, for the build step's record.
        steps.insert(image_at, (image or image_f.result()).record)
        # Still holding the pool (released above, the lock kept): a run of the same inputs
        # waiting for it decides whether it is up to date only once this run's record is there.
        if trained is not None and trained.value.stopped_after is not None:
            budget = watch is not None and watch.fired
            stopped = _stopped_by_budget(run, record, steps, cost, trained.value, budget)
            tracker.end()
            return stopped
        assert scored is not None  # training ended, not stopped: the model was scored above
        outputs_url = output_link(run_config.output, cluster.outputs, f"{run.output_prefix}/")
        decision, score = promotion.value, scored.value.score
        report(
            run.id,
            steps,
            scored.value,
            decision,
            staged.value,
            outputs_url,
            run_config,
            source,
            cost,
            data,
            tracker.summary(),
        )
        tracker.reported(run)
        # Last: the record makes the next run of the same inputs end as up to date, so it is
        # written only once this run's outcome is known (a run that fails in its report trains
        # again).
        remember_run(run_config, run, check.value.fingerprint, score["accuracy"], data)
    logger.info("run %s: accuracy %.4f, %s", run.id, score["accuracy"], decision.reason)
    record.ended(
        "promoted" if decision.promoted else "not promoted", decision.reason, score["accuracy"]
    )
    tracker.end()
    return {
        "run_id": run.id,
        "accuracy": score["accuracy"],
        "promoted": decision.promoted,
        "reason": decision.reason,
        "outputs": outputs_url,
        "data_version": data.version,
        "data": data.as_record(),
        "steps": [s.as_dict() for s in steps],
        "cost": cost,
        "tracking": tracking.runs_link if (tracking := tracker.summary()) else None,
    }


def _work(config: PipelineConfig, trained: Any, scored: Any) -> Any:
    """What training did, for the run's cost record (None: it did not get that far)."""
    from tasks.cost import work_of

    if trained is None:
        return None
    test = scored.value.score.get("num_images") if scored is not None else None
    return work_of(config, trained.value.epochs, test)


def _stopped_by_budget(
    run: Run, record: RunLog, steps: list[Any], cost: dict[str, Any], trained: Any, budget: bool
) -> dict[str, Any]:
    """A run whose training stopped at a checkpoint when asked: no model, nothing promoted, the
    checkpoint kept for the next run of the same inputs to resume from. Not a failure."""
    from tasks.cost import stopped_markdown

    done = trained.stopped_after
    why = (
        f"training stopped after epoch {done}"
        + (": the run's spend reached its budget" if budget else " on request")
        + (
            "; the next run of the same data, code and settings resumes from that checkpoint"
            if done
            else " (before its first epoch: nothing to resume)"
        )
    )
    get_run_logger().warning("run %s: %s", run.id, why)
    stopped_markdown(run.id, why, cost)
    record.ended("stopped by budget" if budget else "failed", why)
    return {
        "run_id": run.id,
        "stopped": "budget" if budget else "request",
        "stopped_after_epoch": trained.stopped_after,
        "reason": why,
        "steps": [s.as_dict() for s in steps],
        "cost": cost,
    }


# The run form's fields (flows/form.py): what `prefect deploy` derives the parameter schema from.
retrain.__signature__ = run_form_signature(retrain.fn)  # type: ignore[attr-defined]


STOPPED = 3  # the exit status of a run whose training was stopped at a checkpoint (budget)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flows.retrain",
        description=__doc__,
        epilog="Config fields: every section and field, with its meaning and bounds, is in "
        "core/config.py (PipelineConfig); configs/local.yaml and configs/azure.example.yaml "
        "set them. --show-config prints the config a run would use (the file with the --set "
        "values applied) and starts nothing.",
    )
    add_config_arguments(p)
    p.add_argument(
        "--show-config",
        action="store_true",
        help="print the effective config as YAML (the file plus --set) and exit",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="train even when data, code and settings are those of the last trained run",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print, as JSON, every request an Azure run would send to Batch; call nothing",
    )
    args = p.parse_args(argv)
    try:
        config = build_run_config(
            RunRequest(config_path=str(args.config), overrides=tuple(args.set))
        ).config
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.show_config:
        import yaml

        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    if args.plan:
        import json

        from backends.azure.plan import PlanError, build_plan
        from backends.target import PROJECT_ROOT

        try:
            plan = build_plan(config, PROJECT_ROOT)
        except PlanError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(plan, indent=2))
        return 0
    from backends.blob import unreachable

    problems = [
        p for p in (unreachable(config.data, "data"), unreachable(config.output, "output")) if p
    ]
    if problems:  # before a Prefect server or a pool is started for nothing
        print("error: " + "\nerror: ".join(problems), file=sys.stderr)
        return 2
    from flows.temporary_server import temporary_server_settings

    # The flow reads the file again (the run's parameters then say which file and overrides,
    # and its summary shows them); loading it above only checked it before anything starts.
    with temporary_server_settings(say=lambda line: print(line, file=sys.stderr)):
        state = retrain(
            config_path=str(args.config), overrides=args.set, force=args.force, return_state=True
        )
        if not state.is_completed():
            print(f"retrain failed: {state.message}", file=sys.stderr)
            return 1
        result = cast(dict[str, Any], state.result())  # a completed run returns its summary
    if result.get("stopped"):  # not a failure: the next run of the same inputs resumes it
        print(f"run {result['run_id']}: {result['reason']}", file=sys.stderr)
        return STOPPED
    serve = (
        f"  (links open while `python -m cli.models --config {shlex.quote(str(args.config))} "
        "serve` runs)"
        if config.output.links_url
        else ""
    )
    data = DataVersion.from_record(result["data"])
    print(f"data: {data.describe()} ({data.chosen})")
    if result.get("up_to_date"):
        print(f"run {result['run_id']}: {result['reason']}, nothing trained (--force trains)")
        print(f"model in use: test accuracy {result['accuracy']:.4f}, outputs {result['outputs']}")
        if serve:
            print(serve)
        return 0
    print(f"run {result['run_id']}: test accuracy {result['accuracy']:.4f}")
    print(f"promotion: {'promoted' if result['promoted'] else 'not promoted'} ({result['reason']})")
    print(f"outputs: {result['outputs']}")
    if result.get("tracking"):
        print(f"tracked in MLflow: {result['tracking']} (the experiment's runs)")
    if serve:
        print(serve)
    for s in result["steps"]:
        print(f"  {s['step']:18s} {s['status']:8s} {s['seconds']:7.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
