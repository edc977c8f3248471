"""The ``label-images`` flow: label a folder of new images in Blob storage with the champion of a
data root (the config's ``data.container`` + ``data.prefix``, or the one the run names).

    python -m flows.label --config configs/local.yaml --container incoming --prefix 2026-11-25

or the ``label-images/manual`` deployment (the UI's form). The predictions go to the output
container (``<output.prefix>/labels/<id>/predictions.csv``: each image's top classes with their
probabilities), shown as a table and a link among the run's artifacts; images that cannot be
read are named and skipped. Without ``PREFECT_API_URL`` a command-line run starts a temporary
Prefect server, as ``python -m flows.retrain`` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from core.config import ConfigError, load_config
from core.run import new_run_id
from flows.form import run_form_signature


@flow(name="label-images")
def label(
    container: str,
    prefix: str = "",
    run_id: str | None = None,
    top_k: int = 3,
    config_path: str = "configs/local.yaml",
    data_container: str | None = None,
    data_prefix: str | None = None,
) -> dict[str, Any]:
    """Label every image under a folder of Blob storage with a trained model.

    Args:
        container: The Blob container holding the new images (read with the credentials of
            the config's data location).
        prefix: The folder in that container; every PNG or JPEG below it is labelled.
        run_id: Label with this run's model instead of the champion's (a run id from
            `python -m cli.models list`).
        top_k: How many of the likeliest classes each image gets, with their probabilities.
        config_path: The pipeline config: where the models and the outputs are.
        data_container: The dataset whose champion labels the images: its container. Empty:
            the config's data.container. Each data root has a champion of its own.
        data_prefix: That dataset's data root in the container (the data_prefix its runs
            trained). Empty: the config's data.prefix.
    """
    from tasks.label import images_location, label_images

    overrides = [
        f"data.{name}={value}"
        for name, value in (("container", data_container), ("prefix", data_prefix))
        if value is not None and value != ""
    ]
    config = load_config(config_path, overrides)
    labelling_id = new_run_id(flow_run.get_id())
    images = images_location(config, container, prefix)
    done = label_images(config, images, labelling_id, run_id, top_k)
    get_run_logger().info(
        "%d images labelled by %s (%s) -> %s", done.labelled, done.model, done.chosen, done.link
    )
    return {
        "labelled": done.labelled,
        "skipped": done.skipped,
        "model": done.model,
        "chosen": done.chosen,
        "predictions": done.csv_blob,
        "link": done.link,
    }


# The run form's fields (flows/form.py): run_id is optional, of one plain type.
label.__signature__ = run_form_signature(label.fn)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.label", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/local.yaml", help="the pipeline config")
    p.add_argument("--container", required=True, help="the container of the new images")
    p.add_argument("--prefix", default="", help="their folder in it")
    p.add_argument(
        "--run",
        help="label with this run's model (default: the champion of the config's data root)",
    )
    p.add_argument("--data-container", help="the dataset whose champion labels: its container")
    p.add_argument("--data-prefix", help="the dataset whose champion labels: its data root")
    p.add_argument("--top-k", type=int, default=3)
    args = p.parse_args(argv)
    try:
        load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from flows.temporary_server import temporary_server_settings

    with temporary_server_settings(say=lambda line: print(line, file=sys.stderr)):
        state = label(
            container=args.container,
            prefix=args.prefix,
            run_id=args.run,
            top_k=args.top_k,
            config_path=args.config,
            data_container=args.data_container,
            data_prefix=args.data_prefix,
            return_state=True,
        )
        if not state.is_completed():
            print(f"labelling failed: {state.message}", file=sys.stderr)
            return 1
        result = state.result()
    for line in result["skipped"]:
        print(f"skipped {line}", file=sys.stderr)
    print(
        f"{result['labelled']} images labelled by {result['model']} ({result['chosen']}): "
        f"{result['link']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
