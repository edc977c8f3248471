"""Bringing your own data: ``python -m cli.data`` uploads a folder on this machine as a new
data version of the config's data root (``data.container`` + ``data.prefix``), which a run then
trains.

    python -m cli.data --config configs/local.yaml --set data.prefix=pets \\
        upload pets/ --version v1

The folder is an image-folder dataset (``train/<class>/*.png|jpg|jpeg``, ``test/<class>/...``,
optional ``val/<class>/...``) or WebDataset tar shards (``train/000000.tar``, ...). Before a
byte is sent, the data gate's checks that need no decode run here, with the gate's own rules
(``gate.folder``): a folder the gate would refuse for its layout, splits, classes, file kinds,
empty files, train/test duplicates, or images too large in bytes or pixels (by their headers)
fails, naming its files. Links are followed inside the folder; one leading out of it is
refused by name (``backends.version_upload.local_files``). Then every file is uploaded with
its Content-MD5, many at once (a file the newest complete version holds already is copied in
storage, not sent), and the version's ``_SUCCESS`` marker last (``backends.version_upload``);
a run cut short is finished by the same command, which sends only what is missing or differs,
and a complete version is never touched, even by an upload of it that was running when
another completed it.

Storage is the config's, with the flow's credential rules (``backends.blob``: the connection
string ``data.connection_string_env`` names, a credentials block, or DefaultAzureCredential for
``data.account_url`` on Azure). On the local target with that variable unset, it is Azurite's
development account on its default port, where ``make azurite`` serves it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from backends.blob import StorageConfigError, container_client, unreachable
from backends.version_upload import UploadError, local_files, upload_version
from core.config import ConfigError, PipelineConfig, hide_credentials
from core.data_versions import check_version_name
from flows.config_args import add_config_arguments, config_from

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

LAYOUT = (
    "the layout the gate reads: <split>/<class>/<image>.png|jpg|jpeg, splits train and test "
    "(and val, optional), every class in each; or <split>/NNNNNN.tar WebDataset shards "
    "(docs/data.md, Layouts)"
)


def data_container(config: PipelineConfig) -> ContainerClient:
    """The data root's container (created when missing), reached as the flow reaches it; on
    the local target without a connection string, Azurite's development account on its
    default port. StorageConfigError says why it cannot be reached."""
    from backends.local.azurite import DEFAULT_PORT, connection_string

    data = config.data
    env = data.connection_string_env
    local = config.target == "local" and not data.credentials_block and not data.account_url
    if local and env and not os.environ.get(env):
        os.environ[env] = connection_string(DEFAULT_PORT)
        print(
            f"{env} is not set: using Azurite's development account on 127.0.0.1:{DEFAULT_PORT} "
            "(`make azurite` serves it there)",
            file=sys.stderr,
        )
    problem = unreachable(data, "data")
    if problem:
        raise StorageConfigError(problem)
    return container_client(data, config.retries.storage_retries, create=True)


def upload(args: argparse.Namespace, config: PipelineConfig) -> int:
    from gate.folder import check_folder

    source: Path = args.source
    try:  # before the folder is read: a name no version can have fails at once
        check_version_name(args.version)
    except ValueError as exc:
        raise UploadError(f"--version: {exc}") from None
    files = local_files(source, args.workers)
    print(
        f"checking {source} as the data gate will ({len(files)} files; each image's header is "
        "read here, its pixels decoded by the run's gate)"
    )
    check = check_folder(files, config.validation)
    if not check.success:
        print(f"error: {source} would fail the data gate; nothing was uploaded:", file=sys.stderr)
        for line in check.problems():
            print(f"  {line}", file=sys.stderr)
        print(f"  ({LAYOUT})", file=sys.stderr)
        return 2
    labels = sorted({r["label"] for r in check.rows if r["label"]})
    print(f"  passed: {len(check.rows)} images, {len(labels)} classes")
    container = data_container(config)
    root = config.data.root
    done = upload_version(container, root, args.version, files, args.workers, args.delete_extra)
    for name in done.deleted:
        print(f"  deleted {name} (not in the folder)")
    copied = (
        f"{len(done.copied)} copied in storage from version {done.copied_from} "
        f"({done.bytes_copied / 2**20:.1f} MB not sent again), "
        if done.copied_from
        else ""
    )
    print(
        f"  {len(done.sent)} files sent ({done.bytes_sent / 2**20:.1f} MB), {copied}"
        f"{done.unchanged} there already, in {done.seconds:.1f} s"
    )
    if done.by_another:
        print(
            f"data version {args.version} of {root.where} is complete: another upload of the "
            f"same files wrote {done.marker} while this one ran"
        )
    else:
        print(
            f"data version {args.version} of {root.where} is complete: {done.marker} written last"
        )
    given = ["--config", str(args.config), *[a for s in args.set for a in ("--set", s)]]
    command = hide_credentials(shlex.join(["python", "-m", "flows.retrain", *given]))
    print(f"train it: {command}  (the newest complete version; --set data.version=... names one)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cli.data",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="upload SRC --version NAME [--workers N] [--delete-extra]: SRC as data version "
        "NAME of the config's data root (python -m cli.data upload --help)",
    )
    add_config_arguments(p)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "upload",
        help="a folder as a new data version of the config's data root, its files checked as "
        "the gate checks them first, its _SUCCESS marker last",
    )
    up.add_argument("source", type=Path, help="the folder: train/<class>/..., test/<class>/...")
    up.add_argument(
        "--version", required=True, help="the new version's name, one folder name, e.g. v1"
    )
    up.add_argument("--workers", type=int, default=8, help="files uploaded at once (default 8)")
    up.add_argument(
        "--delete-extra",
        action="store_true",
        help="delete blobs of the (incomplete) version that the folder does not hold, left by "
        "an earlier upload of files since removed or renamed",
    )
    args = p.parse_args(argv)
    try:
        config = config_from(args)
        return upload(args, config)
    except (ConfigError, StorageConfigError, UploadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: the version is not marked complete; the same command uploads what is "
            "missing",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
