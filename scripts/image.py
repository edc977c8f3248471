"""`make image`: build the training image's cpu variant and push it to the local registry.

The same builder the local target's build-image step runs (backends/local/buildah.py), outside a
flow: the registry at the config's image.registry is used when one listens there, else one is
run on the shared storage for as long as the build and push take. Prints the reference and
whether it was built or already there (the tag names the content: an unchanged image is not
built twice). ``--hold`` then keeps the registry up until Ctrl-C or SIGTERM: ``make service``
runs it so, as root, for flow runs that run unprivileged and cannot build (buildah needs root),
whose build step then finds the image in the registry.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.local.buildah import BuildError, LocalImageBuilder  # noqa: E402
from backends.local.oci_server import local_registry  # noqa: E402
from backends.oci import RegistryError  # noqa: E402
from core.config import load_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.yaml")
    parser.add_argument("--quiet", action="store_true", help="print the result only")
    parser.add_argument(
        "--variant",
        choices=["cpu", "gpu"],
        default="cpu",
        help="gpu builds the image Azure runs (PyPI's CUDA torch, Horovod with NCCL and MPI) on "
        "the local base, to run its build-time checks here; it is kept in buildah's storage, "
        "not pushed",
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="then keep the registry up, with the image, until Ctrl-C or SIGTERM",
    )
    args = parser.parse_args()
    config = load_config(args.config)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop, as Ctrl-C is
    try:
        with local_registry(config.image.registry) as registry:
            builder = LocalImageBuilder(registry, variant=args.variant)
            result = builder.build(
                ROOT,
                config.image.repository,
                (lambda _: None) if args.quiet else print,
                push=args.variant == "cpu",
            )
            took = time.monotonic() - started
            print(f"image {result.reference}: {result.reason} ({took:.0f} s)", flush=True)
            if args.hold:
                print(f"holding the registry at {registry.address} (Ctrl-C stops)", flush=True)
                while True:
                    time.sleep(3600)
    except (BuildError, RegistryError) as exc:  # what failed and what to do, without a trace
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # --hold's end: the registry is let go on the way out
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
