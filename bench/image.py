"""The training image: how long it takes to build, from nothing and after a code change, and
how large it is.

The cpu variant of docker/Dockerfile is built as the local target builds it
(backends/local/buildah.py), into a cache of its own (buildah storage, registry, base tarball),
so the first build starts from what a fresh machine has after `make setup` and nothing more: the
Debian base is made with debootstrap again, the packages are installed again, and only the
Horovod wheel that `make setup` built is reused (scripts/install_horovod.sh's cache, the
documented reuse). Then the same inputs with one line of training code changed are built: what
a code change costs. With ``--variant gpu`` the image Azure runs (PyPI's CUDA torch, Horovod
compiled with NCCL and MPI by the nvcc of torch's CUDA release) is built once on the same base,
with its build-time checks, and kept in buildah's storage only; that takes tens of minutes and
several GB of downloads, so its result is kept in docs/bench-gpu/ like the GPU benchmarks. The
scratch cache is removed afterwards. Needs root, buildah, debootstrap and docker-registry;
elsewhere it says why it did not run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.output import ROOT, emit
from bench.report import machine


def _copy_inputs(target: Path) -> None:
    from backends.image import image_inputs

    for rel, source in image_inputs(ROOT).items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / rel)


def measure(variant: str, cache: Path) -> dict[str, Any]:
    from backends.local.buildah import LocalImageBuilder
    from backends.local.oci_server import local_registry

    lines: list[str] = []
    report: dict[str, Any] = {}
    with local_registry(None, cache / "registry") as registry:
        builder = LocalImageBuilder(registry, cache, variant)
        push = variant == "cpu"
        started = time.perf_counter()
        builder.ensure_base(ROOT, lines.append)
        report["base_seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        first = builder.build(ROOT, "retrain/horovod", lines.append, push=push)
        report["build_seconds"] = time.perf_counter() - started
        report["cold_seconds"] = report["base_seconds"] + report["build_seconds"]
        report["size"] = builder.buildah.image_size(first.reference)
        report["checks"] = [
            line
            for line in lines
            if line.startswith(("check_image: cpu image ok", "check_image: gpu image ok"))
            or line.startswith("cuda_build_env: built with")
        ]
        report["storage_driver"] = builder.buildah.driver
        if variant == "cpu":
            edited = cache / "checkout"
            _copy_inputs(edited)
            with open(edited / "training" / "__init__.py", "a") as handle:
                handle.write("# one line of training code changed\n")
            started = time.perf_counter()
            builder.build(edited, "retrain/horovod", lines.append)
            report["code_change_seconds"] = time.perf_counter() - started
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    from backends.local.buildah import unavailable_reason

    report: dict[str, Any] = {
        "benchmark": "image",
        "variant": args.variant,
        "machine": machine(),
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "method": (
            "docker/Dockerfile's "
            + args.variant
            + " variant built with buildah (chroot isolation) into an empty cache of its own; "
            "the base made with debootstrap in that cache; the Horovod wheel from `make "
            "setup`'s cache where the variant's is there (cpu), compiled otherwise (gpu)"
        ),
    }
    reason = unavailable_reason()
    if reason:
        report["skipped"] = reason
        return report
    cache = Path(tempfile.mkdtemp(prefix="bench-image-", dir=args.work))
    try:
        report.update(measure(args.variant, cache))
    finally:
        from backends.local.buildah import Buildah

        # Everything this run stored (layers can be GBs): its own storage, registry and base.
        Buildah(cache / "build").remove_all()
        shutil.rmtree(cache, ignore_errors=True)
    report["load_average"] = os.getloadavg()[0]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.image",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--variant", choices=("cpu", "gpu"), default="cpu")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where the scratch cache goes (default: beside the machine's image cache, on the "
        "same file system)",
    )
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    if args.work is None:
        from backends.oci import cache_dir

        args.work = cache_dir()
    args.work.mkdir(parents=True, exist_ok=True)
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
