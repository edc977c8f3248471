"""The gate's verdict, kept by what it judged: the manifest's rows, the rules, the suites' code
and Great Expectations' version.

A nightly run over unchanged data builds the same manifest from the read cache
(``gate.manifest``) and would run the same suites on it to the same verdict: importing Great
Expectations alone costs a flow process seconds of CPU, and the suites over a large manifest
more. So a verdict is stored with its Data Docs under a digest of everything that decides it,
and a gate whose digest is known takes both from there. Any change in what decides it (one
image's row, one rule, the suites' code, a Great Expectations upgrade) is another digest, and
the suites run again. A stored verdict that cannot be read is run again too, never trusted.

The Data Docs of a reused verdict are the ones built when it was first reached: they show that
run's validation time, and the step's log says the verdict was reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from core.config import ValidationConfig
from gate import suites
from training.atomic import read_json_object

KEEP = 8  # verdicts kept per cache folder, newest first; each is a few hundred KB of Data Docs
VERDICT = "verdict.json"
DOCS = "data_docs"


@dataclass(frozen=True)
class Verdict:
    success: bool
    records: list[dict[str, Any]]
    reused: bool  # taken from an earlier gate of the same manifest and rules


def verdict_key(rows: list[dict[str, Any]], rules: ValidationConfig) -> str:
    """A digest of what decides the verdict: row by row (a large manifest is never one
    string), then the rules, the suites' source and Great Expectations' version."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    digest.update(json.dumps(rules.model_dump(mode="json"), sort_keys=True).encode())
    digest.update(Path(suites.__file__).read_bytes())
    digest.update(metadata.version("great_expectations").encode())
    return digest.hexdigest()


def _stored(folder: Path) -> Verdict | None:
    try:
        record = read_json_object(folder / VERDICT)
    except OSError:  # not a folder, or not readable: judged again
        return None
    if record is None or not (folder / DOCS / "index.html").is_file():
        return None
    success, records = record.get("success"), record.get("records")
    if not isinstance(success, bool) or not isinstance(records, list):
        return None
    if not all(isinstance(r, dict) for r in records):
        return None
    return Verdict(success, records, reused=True)


def _store(cache: Path, key: str, verdict: Verdict, docs: Path) -> None:
    """Written whole in a folder beside the cache's, then renamed into place: a gate killed
    mid-write leaves no half verdict under its key."""
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".verdict-", dir=cache))
    try:
        shutil.copytree(docs, work / DOCS)
        body = {"success": verdict.success, "records": verdict.records}
        (work / VERDICT).write_text(json.dumps(body))
        target = cache / key
        if target.is_file() or target.is_symlink():  # damaged: not a verdict's folder
            target.unlink()
        elif target.is_dir() and _stored(target) is None:  # damaged, not another gate's
            shutil.rmtree(target, ignore_errors=True)
        with contextlib.suppress(OSError):  # another gate stored the same verdict first
            work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kept = sorted(
        (p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in kept[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def judge(rows: list[dict[str, Any]], rules: ValidationConfig, docs: Path, cache: Path) -> Verdict:
    """The suites' verdict on ``rows`` under ``rules``, with its Data Docs in ``docs``: the
    stored one when this manifest and these rules were judged before, else a new one (then
    stored)."""
    key = verdict_key(rows, rules)
    stored = _stored(cache / key)
    if stored is not None:
        shutil.rmtree(docs, ignore_errors=True)
        shutil.copytree(cache / key / DOCS, docs)
        os.utime(cache / key)  # newest use: kept longest
        return stored
    success, records = suites.run_expectations(rows, rules, docs)
    verdict = Verdict(success, records, reused=False)
    _store(cache, key, verdict, docs)
    return verdict
