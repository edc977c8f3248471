"""The gate's verdict, kept by what decided it: the manifest's rows, the rules, the code the
suites run (``DECIDING_SOURCES``) and the libraries' versions (``DECIDING_PACKAGES``).

A nightly run over unchanged data builds the same manifest from the read cache
(``gate.manifest``) and would run the same suites on it to the same verdict: importing Great
Expectations alone costs a flow process seconds of CPU, and the suites over a large manifest
more. So a verdict is stored with its Data Docs under a digest of everything that decides it,
and a gate whose digest is known takes both from there. Any change in what decides it (one
image's row, one rule, the deciding code, a library upgrade) is another digest, and
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
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from common.atomic import read_json_object
from core.config import ValidationConfig
from gate import manifest, suites
from imagedata import images

KEEP = 8  # verdicts kept per cache folder, newest first; each is a few hundred KB of Data Docs
VERDICT = "verdict.json"
DOCS = "data_docs"
STALE_SECONDS = 3600  # a half-written verdict's folder older than this is a killed gate's

# The code that turns rows and rules into a verdict, whole files (a change anywhere in them
# runs the suites again: one Great Expectations run, never a stale verdict): the suites, the
# class counts they read (gate.manifest), the split names (imagedata.images), and the libraries
# that build the tables and run the expectations.
DECIDING_SOURCES: tuple[Path, ...] = tuple(
    Path(m.__file__ or "") for m in (suites, manifest, images)
)
DECIDING_PACKAGES = ("great_expectations", "pandas", "numpy")


@dataclass(frozen=True)
class Verdict:
    success: bool
    records: list[dict[str, Any]]
    reused: bool  # taken from an earlier gate of the same manifest and rules


def _part(digest: Any, data: bytes) -> None:
    """One length-prefixed part: no two different sequences of parts hash alike."""
    digest.update(len(data).to_bytes(8, "big"))
    digest.update(data)


def verdict_key(rows: list[dict[str, Any]], rules: ValidationConfig) -> str:
    """A digest of what decides the verdict: row by row (a large manifest is never one
    string), then the rules, the deciding code and the libraries' versions."""
    digest = hashlib.sha256()
    _part(digest, str(len(rows)).encode())
    for row in rows:
        _part(digest, json.dumps(row, sort_keys=True, default=str).encode())
    _part(digest, json.dumps(rules.model_dump(mode="json"), sort_keys=True).encode())
    for source in DECIDING_SOURCES:
        _part(digest, source.read_bytes())
    for package in DECIDING_PACKAGES:
        _part(digest, f"{package}=={metadata.version(package)}".encode())
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
    mid-write leaves no half verdict under its key. A cache: a failure to store (a full disk)
    costs the next gate one run of the suites, never this one its verdict."""
    with contextlib.suppress(OSError):
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
    _prune(cache)


def _prune(cache: Path) -> None:
    """The newest KEEP verdicts stay; older ones, and what killed gates left half-written, go.
    Another gate may prune at once: what vanished meanwhile is skipped."""
    found: list[tuple[float, Path]] = []
    for entry in cache.iterdir() if cache.is_dir() else ():
        with contextlib.suppress(OSError):
            mtime = entry.stat().st_mtime
            if entry.name.startswith("."):
                if mtime < time.time() - STALE_SECONDS:
                    shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_dir():
                found.append((mtime, entry))
    for _, old in sorted(found, reverse=True)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def _reuse(folder: Path, docs: Path) -> Verdict | None:
    """The stored verdict with its Data Docs copied to ``docs``; None when there is none whole
    (then ``docs`` is left for the suites to build)."""
    stored = _stored(folder)
    if stored is None:
        return None
    try:
        os.utime(folder)  # newest use: kept longest (before the copy, so no prune takes it)
        shutil.rmtree(docs, ignore_errors=True)
        shutil.copytree(folder / DOCS, docs)
    except OSError:  # pruned or damaged meanwhile: judged again
        shutil.rmtree(docs, ignore_errors=True)
        return None
    return stored


def judge(rows: list[dict[str, Any]], rules: ValidationConfig, docs: Path, cache: Path) -> Verdict:
    """The suites' verdict on ``rows`` under ``rules``, with its Data Docs in ``docs``: the
    stored one when this manifest and these rules were judged before, else a new one (then
    stored)."""
    key = verdict_key(rows, rules)
    reused = _reuse(cache / key, docs)
    if reused is not None:
        return reused
    success, records = suites.run_expectations(rows, rules, docs)
    verdict = Verdict(success, records, reused=False)
    _store(cache, key, verdict, docs)
    return verdict
