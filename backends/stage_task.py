"""Blob -> NFS staging as a Batch task on a pool node (``python -m backends.stage_task``).

On Azure the dataset must not stream through the orchestrator: this runs inside the VNet on a
node that mounts the NFS share, with the same incremental code the local target uses. The data
container's URL comes in the environment (``RETRAIN_DATA_URL``), never the command line: with a
SAS it is used as is; without one the node authenticates with its managed identity
(``AZURE_CLIENT_ID`` selects it). The report is written for the output-file upload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from backends.staging import stage
from training.atomic import atomic_write_json


def _container(url: str) -> Any:
    from azure.storage.blob import ContainerClient

    from backends.blob import API_VERSION

    if "sig=" in url:
        return ContainerClient.from_container_url(url, api_version=API_VERSION)
    from azure.identity import DefaultAzureCredential

    return ContainerClient.from_container_url(
        url, credential=DefaultAzureCredential(), api_version=API_VERSION
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m backends.stage_task", description=__doc__)
    p.add_argument("--prefix", default="")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument(
        "--shards-size", type=int, default=0, help="pack shards at this input size (0: do not)"
    )
    args = p.parse_args(argv)
    url = os.environ.get("RETRAIN_DATA_URL")
    if not url:
        print("error: RETRAIN_DATA_URL is not set (the task spec provides it)", file=sys.stderr)
        return 2
    report = stage(_container(url), args.prefix, args.dest, args.shards_size, args.workers)
    atomic_write_json(report, args.report)
    print(
        f"staged {len(report['downloaded'])} files ({report['bytes_downloaded']} bytes), "
        f"{report['skipped']} unchanged, {len(report['deleted'])} deleted; "
        f"version {report['data_version']}; shards {report['shards']['action']}"
    )
    print(json.dumps({"data_version": report["data_version"], "files": report["total_files"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
