"""Getting the model out: ``python -m cli.models`` lists the runs with their data root and
version, scores and promotion decisions, and downloads the champion of the config's data root
(``data.container`` + ``data.prefix``; another with ``--set data.prefix=...``) or any run's model
to a file.

    python -m cli.models --config configs/local.yaml list
    python -m cli.models --config configs/local.yaml download --to models/
    python -m cli.models --config configs/local.yaml download --run RUN_ID --to model.pt
    python -m cli.models --config configs/local.yaml download --run RUN_ID --file score.json
    python -m cli.models --config configs/local.yaml download --file model.onnx
    python -m cli.models --config configs/local.yaml lineage
    python -m cli.models --config configs/local.yaml serve

``lineage`` follows what the champion (or ``--run``) started from, run by run, back to a run
from scratch or to outside weights. ``serve`` runs the outputs gateway (servers.gateway):
the links in a run's artifacts point at it when ``output.links_url`` names it, and open in a
browser while it runs. No link carries a signature (no secret ever goes into an artifact); each
also names the command that downloads its file.

It reads the output container the config names, with the same credentials the flow uses
(``output.connection_string_env``, a Prefect block or DefaultAzureCredential); nothing in it
starts a Prefect server or a pool.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from typing import TYPE_CHECKING

from backends.blob import StorageConfigError, container_client, unreachable
from core.config import ConfigError, PipelineConfig
from core.links import listen_address
from core.text import printable
from flows.config_args import add_config_arguments, config_from
from registry.lineage import lineage
from registry.migrate import migrate_legacy_records
from registry.store import (
    ModelStoreError,
    RunEntry,
    champion_of,
    download,
    list_runs,
    recorded_model_md5,
    run_file,
)
from servers.gateway import serve

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient


# The fewest characters of a decision on one wrapped line; a terminal narrower than the columns
# before it plus these gets the decision on lines of its own, below its run.
MIN_DECISION_WIDTH = 30


def _table(entries: list[RunEntry], width: int | None = None) -> str:
    """One row per run: its id, the data root and version it trained, the accuracy of its
    model, and the decision with its whole reason; the champion of each data root is marked.
    ``width``: wrap each decision to lines of at most this many characters (a terminal's);
    None: one line per run, however long (for a pipe, or ``--wide``). A decision is never
    cut."""
    root = max([len("data root"), *(len(e.root) for e in entries)])
    version = max([len("version"), *(len(e.data) for e in entries)])
    lines = [f"{'run':<28} {'data root':<{root}} {'version':<{version}} {'accuracy':>8}  decision"]
    for e in entries:
        accuracy = f"{e.accuracy:.4f}" if e.accuracy is not None else "-"
        mark = "  <- champion" if e.champion else ""
        head = f"{e.run_id:<28} {e.root:<{root}} {e.data:<{version}} {accuracy:>8}  "
        decision = f"{e.decision}{mark}"
        if width is None:
            lines.append(head + decision)
            continue
        room = width - len(head)
        if room >= MIN_DECISION_WIDTH:
            wrapped = textwrap.wrap(decision, room, break_on_hyphens=False)
            lines.append(head + wrapped[0])
            lines += [" " * len(head) + more for more in wrapped[1:]]
        else:  # too narrow beside the columns: below them, indented
            lines.append(head.rstrip())
            lines += textwrap.wrap(
                decision,
                max(width, MIN_DECISION_WIDTH),
                initial_indent="    ",
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def _list_width(wide: bool) -> int | None:
    """The width ``list`` wraps decisions to: the terminal's; none with ``--wide`` or when the
    output is not a terminal (a pipe or a file gets one line per run, whole, for grep)."""
    if wide or not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def _serve(
    config: PipelineConfig, outputs: ContainerClient, host: str | None, port: int | None
) -> int:
    problem = unreachable(config.output, "output")
    if problem:
        raise StorageConfigError(problem)
    links_url = config.output.links_url
    host, port = listen_address(links_url, host, port)
    server = serve(outputs, config.output.prefix, host, port, links_url)
    address = f"http://{f'[{host}]' if ':' in host else host}:{server.server_address[1]}"
    where = f"{config.output.container}/{config.output.prefix}".rstrip("/")
    print(f"serving {where} read-only at {address}/ (Ctrl-C stops it)", flush=True)
    if links_url is None:
        print(f"a run's links point here once output.links_url is {address}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cli.models", description=__doc__.split("\n")[0])
    add_config_arguments(p, "the config the runs used")
    sub = p.add_subparsers(dest="command", required=True)
    listing = sub.add_parser(
        "list",
        help="every run: its data root and version, accuracy, and decision (promoted, not "
        "promoted, up to date, failed at a step) with why, whole; each data root's champion "
        "marked",
    )
    listing.add_argument(
        "--wide",
        action="store_true",
        help="one line per run, however long, instead of decisions wrapped to the terminal's "
        "width (what a pipe or a file gets anyway)",
    )
    get = sub.add_parser(
        "download",
        help="the model of the champion of the config's data root (data.container and "
        "data.prefix; --set data.prefix=... names another) or of --run, to a file",
    )
    get.add_argument("--run", help="a run id from `list` (default: the champion)")
    get.add_argument(
        "--file",
        help="another file of the run's (or the champion's) outputs, e.g. model.onnx or score.json",
    )
    get.add_argument(
        "--to", default=".", help="a file, or a folder (an existing one, or one ending with /)"
    )
    family = sub.add_parser(
        "lineage",
        help="what the champion of the config's data root (or --run) started from, back to a "
        "run from scratch",
    )
    family.add_argument("--run", help="a run id from `list` (default: the champion)")
    gateway = sub.add_parser("serve", help="open the run links: a read-only outputs gateway")
    gateway.add_argument(
        "--host",
        help="address to listen on (default: output.links_url's "
        "when it is a loopback address, else 127.0.0.1)",
    )
    gateway.add_argument("--port", type=int, help="default: output.links_url's, else 4280")
    args = p.parse_args(argv)
    try:
        config = config_from(args)
        outputs = container_client(config.output, config.retries.storage_retries)
        base, root = config.output.prefix, config.data.root
        if args.command == "serve":
            return _serve(config, outputs, args.host, args.port)
        migrate_legacy_records(outputs, base, root, lambda line: print(line, file=sys.stderr))
        if args.command == "list":
            entries = list_runs(outputs, base, [root])
            print(_table(entries, _list_width(args.wide)) if entries else "no runs yet")
            return 0
        if args.command == "lineage":
            start = args.run or champion_of(outputs, base, root).run_id
            for ancestor in lineage(outputs, base, start):
                print(
                    f"{printable(ancestor.run_id)}  started from {printable(ancestor.started_from)}"
                )
            return 0
        if args.run:
            blob = run_file(base, args.run, args.file or "model.pt")
        else:
            champion = champion_of(outputs, base, root)
            blob = run_file(base, champion.run_id, args.file) if args.file else champion.model
            print(
                f"the champion of data root {root.where}: run {champion.run_id} "
                f"({champion.metric} {champion.value:.4f}, trained on {champion.data or '?'})"
            )
        got = download(outputs, blob, args.to, recorded_model_md5(outputs, blob))
    except (ConfigError, StorageConfigError, ModelStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{blob} -> {got.path} (checked against {got.checked})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
