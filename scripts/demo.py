"""`make demo`: the whole pipeline on the local target, from an empty machine state.

Starts Azurite, seeds a Blob container with a real image dataset (scikit-learn's handwritten
digits) as the first data version of the local config's data root (``digits/v1/...``, its
``_SUCCESS`` marker last: see core/data_versions.py), runs the retrain flow once in this process,
and stops everything it started. A second run finds the scripts, data and image unchanged and
ends up to date.

`make azurite` (``--serve-storage``): the same Azurite data and the same upload, on Azurite's
default port, kept running in the foreground until Ctrl-C, for the deployments and worker of
the README's "Running it as a service" (``UseDevelopmentStorage=true`` finds it there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.azurite import FolderInUseError, running_azurite  # noqa: E402
from backends.blob import container_client, upload_directory  # noqa: E402
from core.config import PipelineConfig, load_config  # noqa: E402
from core.data_versions import DataRoot  # noqa: E402
from training.images import SPLITS  # noqa: E402
from training.make_images import write_digits  # noqa: E402

LOCAL_CONFIG = ROOT / "configs" / "local.yaml"
DEFAULT_PORT = 10000  # Azurite's own default, the one UseDevelopmentStorage=true points at
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


def serve_storage(demo: Path, port: int) -> int:
    """Azurite with the local config's data on ``port`` until Ctrl-C or SIGTERM."""
    config = load_config(LOCAL_CONFIG)
    source = dataset(demo)
    location = demo / "azurite"
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    try:
        with running_azurite(location, port) as conn:
            seed(config, source, conn)
            env = config.data.connection_string_env
            use = (
                f"export {env}=UseDevelopmentStorage=true"
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


def demo_run() -> int:
    demo = ROOT / ".demo"
    source = dataset(demo)
    config = load_config(LOCAL_CONFIG)
    started = time.perf_counter()
    flow_args = ["--config", "configs/local.yaml"]
    from backends.buildah import unavailable_reason

    reason = unavailable_reason() if config.image.builder == "buildah" else None
    if reason:  # the local cluster runs the trainer on this machine's files either way
        print(f"the training image is not built: {reason}")
        flow_args += ["--set", "image.builder=none"]
    with running_azurite(demo / "azurite") as conn:
        seed(config, source, conn)
        from flows.retrain import main as run_flow

        code = run_flow(flow_args)
        if code == 0:  # the model a person would take away, on disk (Azurite stops below)
            from flows.models import main as models

            print("the champion's model, copied out of Blob storage:")
            code = models(["--config", "configs/local.yaml", "download", "--to", str(demo)])
    print(f"demo finished in {time.perf_counter() - started:.0f}s; Azurite stopped")
    if code == 0:  # the run's links name a gateway that only runs when asked for
        print(
            "to open the run's links (its outputs, Data Docs) in a browser: `make azurite` in one "
            "terminal, then `python -m flows.models --config configs/local.yaml serve` in another "
            "with the connection string it prints"
        )
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/demo.py", description=__doc__)
    p.add_argument(
        "--serve-storage",
        action="store_true",
        help="start Azurite with the demo's data uploaded and keep it running (no flow run)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="with --serve-storage")
    p.add_argument(
        "--dir",
        type=Path,
        default=ROOT / ".demo",
        help="with --serve-storage: where the dataset and Azurite's data live",
    )
    args = p.parse_args(argv)
    where = args.dir.resolve()  # before the chdir: relative to where the command was typed
    os.chdir(ROOT)
    if args.serve_storage:
        try:
            return serve_storage(where, args.port)
        except (RuntimeError, FileNotFoundError, TimeoutError) as exc:  # Azurite did not start
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        return demo_run()
    except FolderInUseError as exc:  # `make azurite` runs on the demo's folder
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
