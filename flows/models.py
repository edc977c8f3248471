"""Getting the model out: ``python -m flows.models`` lists the runs with their scores and
promotion decisions, and downloads the champion (or any run's model) to a file.

    python -m flows.models --config configs/local.yaml list
    python -m flows.models --config configs/local.yaml download --to models/
    python -m flows.models --config configs/local.yaml download --run RUN_ID --to model.pt
    python -m flows.models --config configs/local.yaml download --run RUN_ID --file score.json

The run summary's output links name the command for each file: the links themselves point at
private Blob storage and carry no signature (no secret ever goes into an artifact).

It reads the output container the config names, with the same credentials the flow uses
(``output.connection_string_env``, a Prefect block or DefaultAzureCredential); nothing in it
starts a Prefect server or a pool.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backends.blob import StorageConfigError, container_client
from backends.model_store import (
    ModelStoreError,
    RunEntry,
    download,
    list_runs,
    model_blob,
    run_file,
)
from core.config import ConfigError, load_config


def _table(entries: list[RunEntry]) -> str:
    lines = [f"{'run':<28} {'accuracy':>8}  decision"]
    for e in entries:
        accuracy = f"{e.accuracy:.4f}" if e.accuracy is not None else "-"
        decision = (
            "unfinished" if e.promoted is None else "promoted" if e.promoted else "not promoted"
        )
        mark = "  <- champion" if e.champion else ""
        lines.append(f"{e.run_id:<28} {accuracy:>8}  {decision}: {e.reason}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.models", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, type=Path, help="the config the runs used")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every run: accuracy, promoted or not, and why")
    get = sub.add_parser("download", help="the champion's model (or --run's) to a file")
    get.add_argument("--run", help="a run id from `list` (default: the champion)")
    get.add_argument("--file", help="another file of the run's outputs, e.g. score.json")
    get.add_argument("--to", type=Path, default=Path("."), help="a file, or a folder")
    args = p.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        outputs = container_client(config.output, config.retries.storage_retries)
        base, metric = config.output.prefix, config.promotion.metric
        if args.command == "list":
            entries = list_runs(outputs, base, metric)
            print(_table(entries) if entries else "no runs yet")
            return 0
        if args.file and not args.run:
            raise ModelStoreError("--file needs --run: which run's outputs")
        blob = (
            run_file(base, args.run, args.file)
            if args.file
            else model_blob(outputs, base, metric, args.run)
        )
        path = download(outputs, blob, args.to)
    except (ConfigError, StorageConfigError, ModelStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{blob} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
