"""Where the registry's records live in the output container: the one definition.

Below ``output.prefix`` (``base``), so pipelines that share a container under different
prefixes each keep their own champion and last run, as they keep their own runs::

    <base>/runs/<run id>/...               a run's outputs (core.run.output_prefix)
    <base>/runs/<run id>/run.json          the run's record: data version, outcome, accuracy
    <base>/runs/<run id>/promotion.json    the run's promotion decision
    <base>/models/champion.json            the model that serves now (one flat record)
    <base>/models/history/<run id>.json    one record per promotion
    <base>/models/history/damaged-*.json   damaged champion records, kept when replaced
    <base>/models/last-run.json            the last run that trained: the up-to-date check's
    <base>/models/trained/<digest>.json    each trained fingerprint's run, by its digest
    <base>/labels/<id>/predictions.csv     new images labelled by a model (flows/label.py)

Run ids start with their UTC start time, so names under ``runs/`` and ``models/history/`` sort
in the order the runs started.
"""

from __future__ import annotations

from core.run import output_prefix

CHAMPION = "models/champion.json"
HISTORY = "models/history"
LAST_RUN = "models/last-run.json"
TRAINED = "models/trained"
DECISION = "promotion.json"
RUN_RECORD = "run.json"
LABELS = "labels"


def records_blob(base: str, name: str) -> str:
    """A record ``name`` (e.g. ``CHAMPION``) below the output prefix ``base``."""
    return f"{base.strip('/')}/{name}" if base.strip("/") else name


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


def champion_blob(base: str) -> str:
    return records_blob(base, CHAMPION)


def last_run_blob(base: str) -> str:
    return records_blob(base, LAST_RUN)


def trained_blob(base: str, digest: str) -> str:
    """The run that trained the fingerprint whose digest is ``digest``."""
    return records_blob(base, f"{TRAINED}/{digest}.json")


def history_blob(base: str, run_id: str) -> str:
    return records_blob(base, f"{HISTORY}/{run_id}.json")


def damaged_blob(base: str, stamp: str) -> str:
    return records_blob(base, f"{HISTORY}/damaged-{stamp}.json")


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
