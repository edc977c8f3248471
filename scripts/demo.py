"""`make demo`: the whole pipeline on the local target, from an empty machine state.

Starts Azurite, seeds a Blob container with a real image dataset (scikit-learn's handwritten
digits), runs the retrain flow once in this process, and stops everything it started. A second
run finds the scripts, data and image unchanged and skips that work.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.azurite import running_azurite  # noqa: E402
from backends.blob import container_client, upload_directory  # noqa: E402
from core.config import load_config  # noqa: E402
from training.make_images import write_digits  # noqa: E402


def main() -> int:
    os.chdir(ROOT)
    demo = ROOT / ".demo"
    source = demo / "digits"
    if not (source / "train").is_dir():
        write_digits(demo / "digits.tmp", test_fraction=0.25, seed=0, per_class=None)
        (demo / "digits.tmp").rename(source)
    config = load_config(ROOT / "configs" / "local.yaml")
    started = time.perf_counter()
    with running_azurite(demo / "azurite") as conn:
        os.environ[config.data.connection_string_env or ""] = conn
        container = container_client(config.data, create=True)
        n = upload_directory(container, source, config.data.prefix)
        print(f"seeded {n} new or changed images into {config.data.container}/{config.data.prefix}")
        from flows.retrain import main as run_flow

        code = run_flow(["--config", "configs/local.yaml"])
        if code == 0:  # the model a person would take away, on disk (Azurite stops below)
            from flows.models import main as models

            print("the champion's model, copied out of Blob storage:")
            code = models(["--config", "configs/local.yaml", "download", "--to", str(demo)])
    print(f"demo finished in {time.perf_counter() - started:.0f}s; Azurite stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
