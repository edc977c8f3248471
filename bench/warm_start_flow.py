"""Warm start against from scratch through the retrain flow, as the nightly runs it.

On the local target (Azurite, a Prefect API, the local pool with 2 training processes), per
dataset and seed, three flow runs with no training setting given (the config's defaults, fitted
to the data):

1. data version v1, from scratch: it becomes the data root's champion;
2. v2 as the nightly trains it (``training.follow_champion``: the champion's recipe and weights,
   ``init_from=champion``, and the warm start's epoch cap);
3. v2 from scratch (``init_from`` null, not following the champion), forced.

Both v2 runs are scored by the flow on v2's test split. The figure is the warm run's epochs over
scratch's, and whether the warm model reached scratch's final test accuracy in them. Datasets:
scikit-learn's digits (v1 without digit_9 and half the training images, v2 all of them) and
crops of scikit-image's photographs (v1 brick and grass, half the training crops; v2 adds gravel
and the other half). ``python -m bench.warm_start_flow`` (or ``bench.warm_start --flow-only``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, cast

from bench.output import ROOT, emit

DATASETS = ("digits", "textures")
NEW_CLASS = {"digits": "digit_9", "textures": "gravel"}


def write_dataset(name: str, folder: Path, seed: int) -> tuple[Path, Path]:
    """v1 and v2 of ``name`` below ``folder``: v2 whole, v1 without the new class and with half
    of the training images."""
    from imagedata.make_images import write_digits, write_textures

    v2, v1 = folder / "v2", folder / "v1"
    for path in (v1, v2):
        shutil.rmtree(path, ignore_errors=True)
    if name == "digits":
        write_digits(v2, test_fraction=0.25, seed=seed, per_class=None)
    else:
        write_textures(v2, {"train": 120, "val": 30, "test": 30}, seed)
    for split in sorted(p.name for p in v2.iterdir()):
        for cls in sorted((v2 / split).iterdir()):
            if cls.name == NEW_CLASS[name]:
                continue
            files = sorted(cls.iterdir())
            if split == "train":
                files = files[::2]
            (v1 / split / cls.name).mkdir(parents=True)
            for f in files:
                shutil.copy(f, v1 / split / cls.name / f.name)
    return v1, v2


def _run(config: Any, version: str, *overrides: str, force: bool = False) -> dict[str, Any]:
    from flows.retrain import retrain

    state = retrain(
        config=config,
        data_version=version,
        overrides=list(overrides),
        force=force,
        return_state=True,
    )
    if not state.is_completed():
        raise RuntimeError(f"the flow run on {version} ended {state.type}: {state.message}")
    result = cast(dict[str, Any], state.result())  # a completed run returns its summary
    metrics = _metrics(config, result["run_id"])
    stop = metrics.get("early_stopping") or {}
    return {
        "run_id": result["run_id"],
        "test_accuracy": result["accuracy"],
        "promoted": result["promoted"],
        "epochs_trained": len(metrics["epochs"]),
        "epoch_cap": stop.get("epoch_cap"),
        "kept_epoch": stop.get("kept_epoch"),
        "input_size": metrics.get("input_size"),
        "init_from": (metrics.get("init_from") or {}).get("run_id"),
        "val_curve": [e.get("val_accuracy") for e in metrics["epochs"]],
    }


def _metrics(config: Any, run_id: str) -> dict[str, Any]:
    import json

    from backends.blob import container_client
    from core.run import output_prefix

    outputs = container_client(config.output)
    blob = f"{output_prefix(config.output.prefix, run_id)}/metrics.json"
    return dict(json.loads(outputs.download_blob(blob).readall()))


def one(work: Path, dataset: str, seed: int, extra: list[str]) -> dict[str, Any]:
    """The three flow runs of one dataset and seed (the module docstring)."""
    from backends.blob import container_client
    from backends.version_upload import local_files, upload_version
    from core.config import load_config

    v1, v2 = write_dataset(dataset, work / f"{dataset}-{seed}", seed)
    suffix = uuid.uuid4().hex[:8]
    config = load_config(
        ROOT / "configs" / "local.yaml",
        [
            f"data.container=ws-data-{suffix}",
            f"data.prefix={dataset}",
            f"output.container=ws-out-{suffix}",
            f"share.local_dir={work / 'share'}",
            f"nfs.local_dir={work / 'nfs'}",
            f"work_dir={work / 'work'}",
            f"pool.id=ws-{suffix}",
            "tracking.mlflow_uri=null",
            "image.builder=none",
        ],
    )
    data = container_client(config.data, create=True)
    for version, folder in (("v1", v1), ("v2", v2)):
        upload_version(data, config.data.root, version, local_files(folder), say=lambda _: None)
    seeded = [f"training.seed={seed}"]
    champion = _run(config, "v1", *seeded)
    warm = _run(config, "v2", *seeded, "training.follow_champion=true", *extra)
    scratch = _run(config, "v2", *seeded, "training.init_from=null", force=True)
    return {
        "dataset": dataset,
        "seed": seed,
        "v1": champion,
        "warm": warm,
        "scratch": scratch,
        "epoch_share": warm["epochs_trained"] / scratch["epochs_trained"],
        "reached": warm["test_accuracy"] >= scratch["test_accuracy"] - 1e-9,
    }


def measure(
    work: Path, datasets: list[str], seeds: list[int], extra: list[str]
) -> list[dict[str, Any]]:
    """Every dataset and seed through the flow, against one Azurite and one Prefect API."""
    from backends.local.azurite import running_azurite
    from flows.temporary_server import temporary_server_settings

    work.mkdir(parents=True, exist_ok=True)
    results = []
    with running_azurite(work / "azurite") as conn:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = conn
        with temporary_server_settings(say=lambda _: None):
            for dataset in datasets:
                for seed in seeds:
                    results.append(one(work, dataset, seed, extra))
    return results


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the runs: the largest share of scratch's epochs a warm run took, and how many warm
    runs reached scratch's final test accuracy."""
    return {
        "runs": runs,
        "max_epoch_share": max((r["epoch_share"] for r in runs), default=None),
        "reached": sum(r["reached"] for r in runs),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    p.add_argument(
        "--warm-args",
        nargs="*",
        default=[],
        help="overrides of the warm run, e.g. training.extra_args=[--warmup-epochs,1]",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm_start_flow", description=__doc__)
    add_arguments(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "warm_start_flow")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    runs = measure(args.work, args.datasets, args.seeds, args.warm_args)
    return emit({"benchmark": "warm_start_flow", "flow": summary(runs)}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
