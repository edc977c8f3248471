"""Where the registry's records live in the output container: the one definition.

Below ``output.prefix`` (``base``), so pipelines that share a container under different
prefixes each keep their own records, as they keep their own runs. Below that, the champion,
its history and the up-to-date check's records are kept per **data root** (``data.container``
and ``data.prefix``, not the version): runs over different data roots never read or replace
each other's champion, whatever output prefix they share::

    <base>/runs/<run id>/...               a run's outputs (core.run.output_prefix)
    <base>/runs/<run id>/run.json          the run's record: data version, outcome, accuracy
    <base>/runs/<run id>/promotion.json    the run's promotion decision
    <base>/models/datasets/<key>/champion.json          the data root's serving model
    <base>/models/datasets/<key>/history/<run id>.json  one record per promotion
    <base>/models/datasets/<key>/history/damaged-*.json damaged champion records, kept
    <base>/models/datasets/<key>/last-run.json          the last run that trained this root
    <base>/models/datasets/<key>/trained/<digest>.json  each trained fingerprint's run
    <base>/models/migrated.json            what the records of one champion per output prefix
                                           became (registry/migrate.py)
    <base>/labels/<id>/predictions.csv     new images labelled by a model (flows/label.py)

``<key>`` names the data root for a person (container and prefix, ``/`` written ``.``) and ends
with a digest of the exact root, so two roots never share a folder. Records written before data
roots had folders of their own are at ``<base>/models/{champion.json,history,last-run.json,
trained}`` (``LEGACY_*``); they are read once and copied into their roots' folders.

Run ids start with their UTC start time, so names under ``runs/`` and ``history/`` sort in the
order the runs started.
"""

from __future__ import annotations

import hashlib
import re

from core.data_versions import DataRoot
from core.run import output_prefix

DATASETS = "models/datasets"
CHAMPION = "champion.json"
HISTORY = "history"
LAST_RUN = "last-run.json"
TRAINED = "trained"
DECISION = "promotion.json"
RUN_RECORD = "run.json"
LABELS = "labels"
MIGRATED = "models/migrated.json"
# One champion per output prefix, as records were kept before data roots had folders.
LEGACY_CHAMPION = "models/champion.json"
LEGACY_HISTORY = "models/history"
LEGACY_LAST_RUN = "models/last-run.json"
LEGACY_TRAINED = "models/trained"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
MAX_KEY_NAME = 80  # characters of the readable part of a data root's folder name


def records_blob(base: str, name: str) -> str:
    """A record ``name`` (e.g. ``MIGRATED``) below the output prefix ``base``."""
    return f"{base.strip('/')}/{name}" if base.strip("/") else name


def dataset_key(root: DataRoot) -> str:
    """The folder name of a data root's records: readable (``training-data.digits``), and
    unique by the digest of the exact container and prefix (names are shortened and their
    unusual characters replaced, so the readable part alone could be shared)."""
    prefix = root.prefix.strip("/")
    readable = ".".join(
        _UNSAFE.sub("_", part) for part in [root.container, *prefix.split("/")] if part
    )
    digest = hashlib.sha256(f"{root.container}/{prefix}".encode()).hexdigest()[:10]
    return f"{readable[:MAX_KEY_NAME]}-{digest}"


def dataset_folder(base: str, root: DataRoot) -> str:
    """The folder of one data root's champion, history and up-to-date records."""
    return records_blob(base, f"{DATASETS}/{dataset_key(root)}")


def is_model_blob(name: object) -> bool:
    """Whether a record's ``model`` can name a model blob: a relative ``.pt`` name without
    ``..``, query, fragment, backslash or control character (a record is stored text anyone
    with write access to the container may have edited)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 1024
        and name.endswith(".pt")
        and not name.startswith("/")
        and ".." not in name.split("/")
        and name.isprintable()  # no NUL, no escape sequence for a terminal that prints it
        and not any(c in name for c in "?#\\")
    )


def champion_blob(base: str, root: DataRoot) -> str:
    return f"{dataset_folder(base, root)}/{CHAMPION}"


def last_run_blob(base: str, root: DataRoot) -> str:
    return f"{dataset_folder(base, root)}/{LAST_RUN}"


def trained_blob(base: str, root: DataRoot, digest: str) -> str:
    """The run that trained the fingerprint whose digest is ``digest``."""
    return f"{dataset_folder(base, root)}/{TRAINED}/{digest}.json"


def history_blob(base: str, root: DataRoot, run_id: str) -> str:
    return f"{dataset_folder(base, root)}/{HISTORY}/{run_id}.json"


def damaged_blob(base: str, root: DataRoot, stamp: str) -> str:
    return f"{dataset_folder(base, root)}/{HISTORY}/damaged-{stamp}.json"


def migrated_blob(base: str) -> str:
    return records_blob(base, MIGRATED)


def runs_root(base: str) -> str:
    """The folder holding every run's outputs (with its trailing slash, for listings)."""
    return output_prefix(base, "")


def run_folder(base: str, run_id: str) -> str:
    return output_prefix(base, run_id)


def decision_blob(run_prefix: str) -> str:
    """The promotion decision of the run whose outputs are at ``run_prefix``."""
    return f"{run_prefix}/{DECISION}"


def run_record_blob(run_prefix: str) -> str:
    """The record of the run whose outputs are at ``run_prefix``."""
    return f"{run_prefix}/{RUN_RECORD}"


def labels_blob(base: str, labelling_id: str) -> str:
    """The predictions of one labelling of new images (``python -m flows.label``)."""
    return records_blob(base, f"{LABELS}/{labelling_id}/predictions.csv")
