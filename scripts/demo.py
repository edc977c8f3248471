"""`make demo`: the whole pipeline on the local target, from an empty machine state.

Starts Azurite, seeds a Blob container with a real image dataset (scikit-learn's handwritten
digits) as the first data version of the local config's data root (``digits/v1/...``, its
``_SUCCESS`` marker last: see core/data_versions.py), runs the retrain flow once in this process,
and stops everything it started; it ends by saying how to look at the run it made (the
temporary Prefect server kept it in Prefect's database). A second run finds the scripts, data
and image unchanged and ends up to date.

``--keep`` (``make demo DEMO_ARGS=--keep``): the same run on a Prefect server of its own, then
Azurite, that server with its UI and the outputs gateway stay up, the run's page and links
open, until Ctrl-C.

`make azurite` (``--serve-storage``): the same Azurite data and the same upload, on Azurite's
default port, kept running in the foreground until Ctrl-C, for the deployments and worker of
the README's "Running it as a service" (``UseDevelopmentStorage=true`` finds it there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.blob import container_client, upload_directory  # noqa: E402
from backends.local.azurite import (  # noqa: E402
    ACCOUNTS_ENV,
    DEFAULT_PORT,
    FolderInUseError,
    running_azurite,
)
from core.config import ConfigError, PipelineConfig, load_config  # noqa: E402
from core.data_versions import DataRoot  # noqa: E402
from flows.config_args import add_config_arguments  # noqa: E402
from imagedata.images import SPLITS  # noqa: E402
from imagedata.make_images import write_digits  # noqa: E402

LOCAL_CONFIG = ROOT / "configs" / "local.yaml"
PREFECT_PORT = 4200  # `prefect server start`'s default
SEED_VERSION = "v1"  # the data version the seeded digits are


def dataset(demo: Path) -> Path:
    """The digits as image folders under ``demo``, written once (under a temporary name). A
    ``digits`` folder without ``train/`` (an older demo's, or one cut short) is the demo's own
    scratch data, written again; renaming onto it failed with an OSError."""
    source = demo / "digits"
    if (source / "train").is_dir():
        return source
    partial = demo / "digits.tmp"
    shutil.rmtree(partial, ignore_errors=True)  # a write that was interrupted
    write_digits(partial, test_fraction=0.25, seed=0, per_class=None)
    if source.exists() or source.is_symlink():
        print(f"{source} holds no train/ folder: written again")
        if source.is_dir() and not source.is_symlink():
            shutil.rmtree(source)
        else:
            source.unlink()
    partial.rename(source)
    return source


def seed(config: PipelineConfig, source: Path, connection_string: str) -> int:
    """Upload ``source`` as data version v1 of ``config``'s data root, its marker last; the
    number of new or changed images. The marker is written again only when an image changed:
    a new marker is a new completion of the version, which the relay and the sensor report."""
    os.environ[config.data.connection_string_env or ""] = connection_string
    container = container_client(config.data, create=True)
    root = config.data.root
    n = upload_directory(container, source, root.folder(SEED_VERSION))
    marker = container.get_blob_client(root.marker(SEED_VERSION))
    if n or not marker.exists():
        marker.upload_blob(b"", overwrite=True)
    print(
        f"seeded {n} new or changed images into {config.data.container}/"
        f"{root.folder(SEED_VERSION)} (data version {SEED_VERSION})"
    )
    moved = drop_earlier_layout(container, root, source)
    if moved:
        print(
            f"removed the {moved} images an earlier demo seeded directly below "
            f"{root.where}: they are data version {SEED_VERSION} now"
        )
    return n


def drop_earlier_layout(container: Any, root: DataRoot, source: Path) -> int:
    """Delete the copies of ``source`` that an earlier demo uploaded loose below the root
    (before data versions, it seeded ``digits/train/...``): beside version v1 they would make
    the root hold loose files and versions, which no run trains. Only blobs at the paths this
    demo's own files map to go, once v1 holds them; anything else stays for the run to name."""
    ours = {p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()}
    base = f"{root.folder(None)}/" if root.folder(None) else ""
    loose = [
        b.name
        for split in SPLITS
        for b in container.list_blobs(name_starts_with=f"{base}{split}/")
        if b.name[len(base) :] in ours
    ]
    for name in loose:
        container.delete_blob(name)
    return len(loose)


def serve_storage(demo: Path, port: int, config: PipelineConfig) -> int:
    """Azurite with the local config's data on ``port`` until Ctrl-C or SIGTERM."""
    source = dataset(demo)
    location = demo / "azurite"
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    try:
        with running_azurite(location, port) as conn:
            seed(config, source, conn)
            env = config.data.connection_string_env
            use = (
                f"its account's key is the one {ACCOUNTS_ENV} gave it (not the published one): "
                f"set {env} to the connection string with that key"
                if os.environ.get(ACCOUNTS_ENV)
                else f"export {env}=UseDevelopmentStorage=true"
                if port == DEFAULT_PORT
                else f"point {env} at Azurite's development account with "
                f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1"
            )
            print(
                f"Azurite is serving the local target's Blob storage on 127.0.0.1:{port} "
                f"(data in {location}, its output in {location / 'azurite.log'}, no access "
                f"log); {use} where the flow runs. Ctrl-C stops it.",
                flush=True,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:  # running_azurite has stopped Azurite on the way out
        pass
    print("Azurite stopped")
    return 0


def flow_run_made(since: datetime) -> str | None:
    """The id of the retrain flow run this demo started (the newest started since ``since``),
    asked of the Prefect server it ran on; None when it cannot be told."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["retrain"])),
                flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)),
                sort=FlowRunSort.START_TIME_DESC,
                limit=1,
            )
    except Exception:  # the run itself is done; only the pointer to it is lost
        return None
    return str(runs[0].id) if runs else None


@contextlib.contextmanager
def outputs_gateway(config: PipelineConfig) -> Iterator[str | None]:
    """The outputs gateway (`python -m cli.models serve`) in a thread, at the config's
    ``output.links_url``, for the block: the run's links open. None without a links_url."""
    from core.links import listen_address
    from servers.gateway import serve

    if config.output.links_url is None:
        yield None
        return
    host, port = listen_address(config.output.links_url)
    outputs = container_client(config.output, create=True)
    server = serve(outputs, config.output.prefix, host, port, config.output.links_url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield config.output.links_url
    finally:
        server.shutdown()
        server.server_close()


@dataclass(frozen=True)
class Keep:
    """``--keep``: what stays up after the run, until Ctrl-C, and on which ports."""

    azurite_port: int
    prefect_port: int


def demo_run(demo: Path, config_path: Path, overrides: list[str], keep: Keep | None = None) -> int:
    """The demo's run; with ``keep``, Azurite, a Prefect server with its UI and the outputs
    gateway stay up after it until Ctrl-C (or SIGTERM), and it says where to look."""
    source = dataset(demo)
    config = load_config(config_path, overrides)
    started = time.perf_counter()
    began = datetime.now(UTC) - timedelta(seconds=1)  # the server's clock is this machine's
    sets = [arg for o in overrides for arg in ("--set", o)]
    given = ["--config", str(config_path), *sets]
    flow_args = list(given)
    from backends.local.buildah import unavailable_reason

    reason = unavailable_reason() if config.image.builder == "buildah" else None
    if reason:  # the local cluster runs the trainer on this machine's files either way
        print(f"the training image is not built: {reason}")
        flow_args += ["--set", "image.builder=none"]
    untracked = _not_tracked(config.tracking.mlflow_uri) if config.tracking.mlflow_uri else None
    if untracked:
        print(untracked)
        flow_args += ["--set", "tracking.mlflow_uri=null"]
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.temporary_server import kept_server

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    api_url = PREFECT_API_URL.value()  # a server of the person's own: the run goes there
    with contextlib.ExitStack() as held:
        conn = held.enter_context(
            running_azurite(demo / "azurite", keep.azurite_port if keep else None)
        )
        seed(config, source, conn)
        if keep:
            if not api_url:
                print(f"starting a Prefect server with its UI on 127.0.0.1:{keep.prefect_port}")
                log = demo / "prefect-server.log"
                api_url = held.enter_context(kept_server(keep.prefect_port, log))
            held.enter_context(temporary_settings(updates={PREFECT_API_URL: api_url}))
            links = held.enter_context(outputs_gateway(config))
        from flows.retrain import main as run_flow

        code = ran = run_flow(flow_args)  # 0 or 1: a flow run was made; 2: none started
        if code == 0:  # the model a person would take away, on disk
            from cli.models import main as models

            print("the champion's model, copied out of Blob storage:")
            code = models([*given, "download", "--to", str(demo)])
        flow_run = flow_run_made(began) if ran in (0, 1) else None
        if keep:
            return _kept(config, keep, api_url, links, flow_run, code)
    print(f"demo finished in {time.perf_counter() - started:.0f}s; Azurite stopped")
    if ran in (0, 1):
        print(look_at_the_run(api_url, flow_run))
    return code


def _not_tracked(url: str) -> str | None:
    """Why the run is not tracked at ``url``, or None when a tracking server there takes this
    checkout's requests (``make service`` starts one; the demo alone does not, and its run then
    says one line instead of a warning per request). A server that asks for a credential this
    checkout does not have (the service of another checkout, on the same default port) is
    named and left alone: the demo's run never lands in someone else's MLflow."""
    import base64
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        return None  # an Azure ML workspace: the run's own tracking reports what it finds
    base = url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=3):
            pass
    except OSError:
        return f"no MLflow server at {url}: this run is not tracked"
    user, password = (os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("USERNAME", "PASSWORD"))
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Authorization": f"Basic {token}"} if user and password else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=10):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return (
                f"the MLflow server at {url} refuses this checkout ({exc.code}: it asks for a "
                "credential this checkout's service did not give; another checkout's make "
                "service?): this run is not tracked, and logs nothing there"
            )
        return None  # any other answer: the run's own tracking reports what it finds
    except OSError:
        return f"no MLflow server at {url}: this run is not tracked"


def _run_page(api_url: str | None, flow_run: str | None) -> str:
    """The address of the run's page in the Prefect UI (of the runs' list without an id)."""
    ui = (api_url or f"http://127.0.0.1:{PREFECT_PORT}/api").rstrip("/").removesuffix("/api")
    return f"{ui}/runs/flow-run/{flow_run}" if flow_run else f"{ui}/runs"


def look_at_the_run(api_url: str | None, flow_run: str | None) -> str:
    """What the demo prints last: where the run it made is, now that what ran it is stopped."""
    page = _run_page(api_url, flow_run)
    where = (
        f"open {page} (on your Prefect server)"
        if api_url
        else f"`.venv/bin/prefect server start`, then open {page}\n"
        "  (the temporary Prefect server kept the run in Prefect's database)"
    )
    return "\n".join(
        [
            f"to look at the run: {where}",
            "  its links (outputs, Data Docs) open while `make azurite` and",
            "  `python -m cli.models --config configs/local.yaml serve` run",
            "or `make demo DEMO_ARGS=--keep`: it leaves Azurite, the Prefect UI and the outputs",
            "  gateway up after its run, until Ctrl-C",
        ]
    )


def _kept(
    config: PipelineConfig,
    keep: Keep,
    api_url: str,
    links: str | None,
    flow_run: str | None,
    code: int,
) -> int:
    """Say where everything is, then hold it up until Ctrl-C or SIGTERM."""
    env = config.data.connection_string_env
    storage = (
        "UseDevelopmentStorage=true"
        if keep.azurite_port == DEFAULT_PORT
        else f"its development account with BlobEndpoint=http://127.0.0.1:{keep.azurite_port}"
        "/devstoreaccount1"
    )
    lines = [
        f"the run: {_run_page(api_url, flow_run)} (the Prefect UI)",
        f"its links (outputs, Data Docs): {links}/ (the outputs gateway)"
        if links
        else "its links point at Blob storage (no output.links_url, no gateway)",
        f"Blob storage: Azurite on 127.0.0.1:{keep.azurite_port}; from another terminal, "
        f"{env}={storage} and PREFECT_API_URL={api_url} reach them",
        "they stay up until Ctrl-C stops them all",
    ]
    print("\n".join(lines), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    print("stopped: the outputs gateway, the Prefect server and Azurite")
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/demo.py", description=__doc__)
    add_config_arguments(p, "the local target's config", default=LOCAL_CONFIG)
    p.add_argument(
        "--serve-storage",
        action="store_true",
        help="start Azurite with the demo's data uploaded and keep it running (no flow run)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="after the run, leave Azurite, a Prefect server with its UI and the outputs "
        "gateway up until Ctrl-C, and say where the run is",
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="Azurite's, with --serve-storage or --keep"
    )
    p.add_argument(
        "--prefect-port", type=int, default=PREFECT_PORT, help="the Prefect UI's, with --keep"
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".demo",
        help="where the dataset, Azurite's data and the downloaded model live",
    )
    args = p.parse_args(argv)
    where = args.dir.resolve()  # before the chdir: relative to where the command was typed
    config_path = args.config.resolve()
    os.chdir(ROOT)
    try:
        config = load_config(config_path, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.serve_storage:
        try:
            return serve_storage(where, args.port, config)
        except (RuntimeError, FileNotFoundError, TimeoutError) as exc:  # Azurite did not start
            print(f"error: {exc}", file=sys.stderr)
            return 2
    shown = config_path.relative_to(ROOT) if config_path.is_relative_to(ROOT) else config_path
    keep = Keep(args.port, args.prefect_port) if args.keep else None
    try:
        return demo_run(where, shown, args.set, keep)
    except (FolderInUseError, RuntimeError, TimeoutError) as exc:  # `make azurite` holds it
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
