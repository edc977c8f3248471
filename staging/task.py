"""Blob -> NFS staging as a Batch task on a pool node (``python -m staging.task``).

On Azure the dataset must not stream through the orchestrator: this runs inside the VNet on a
node that mounts the NFS share, with the same incremental code the local target uses. The data
container's URL comes in the environment (``RETRAIN_DATA_URL``), never the command line: with a
SAS it is used as is; without one the node authenticates with its managed identity
(``AZURE_CLIENT_ID`` selects it). What it stages is the data gate's pinned listing, which
arrives as a resource file (``--listing``): exactly the validated blobs, each at its validated
ETag. The report is written for the output-file upload; when staging refuses its input (an
unsafe name, a blob changed since the gate) the report holds the error instead, so the
orchestrator can name the blob.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common.atomic import atomic_write_json
from staging.blob import data_container
from staging.listing import ChangedSinceGateError, ListingError, parse_listing
from staging.sync import UnsafeBlobNameError, stage
from staging.transfer import IntegrityError

REFUSED = 3  # the input is refused (named in the report): a retry on the same input cannot help


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m staging.task", description=__doc__)
    p.add_argument("--prefix", default="")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument(
        "--listing", type=Path, help="the data gate's pinned listing: stage exactly these blobs"
    )
    p.add_argument(
        "--pack-image-size",
        type=int,
        default=0,
        help="pack shards of images this many pixels a side, the trainer's input size (0: do not)",
    )
    args = p.parse_args(argv)
    url = os.environ.get("RETRAIN_DATA_URL")
    if not url:
        print("error: RETRAIN_DATA_URL is not set (the task spec provides it)", file=sys.stderr)
        return 2
    try:
        listing = (
            parse_listing(args.listing.read_bytes(), str(args.listing), args.prefix)
            if args.listing
            else None
        )
        report = stage(
            data_container(url), args.prefix, args.dest, args.pack_image_size, args.workers, listing
        )
    except (ListingError, UnsafeBlobNameError, ChangedSinceGateError, IntegrityError) as exc:
        atomic_write_json({"error": str(exc)}, args.report)
        print(f"error: {exc}", file=sys.stderr)
        return REFUSED
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
