"""Step 1, the data gate: Great Expectations over a manifest of the dataset in Blob storage.

The manifest comes from the listing plus one small ranged read per image (enough for the
header, and usually the whole file), so the gate costs seconds and no GPU is provisioned, and no
data is copied, for a dataset that would fail. A failed gate raises: nothing after it runs.

What each read found is kept in the work folder by blob name and ETag (a blob's ETag changes
with its content), so a nightly run over unchanged data lists the container and reads nothing:
per-request cost, not bandwidth, is what a gate over many small images pays.

Every blob under the prefix is validated but the completion marker; the listing the gate
validated (names and ETags) is pinned in the run's output prefix, and staging stages exactly
that listing: what is trained is what was validated.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from backends.blob import blob_link, container_client, folder, upload_directory
from backends.listing import listing_blob, listing_json, pin
from flows.config import PipelineConfig
from tasks.steps import step_record
from training.atomic import atomic_write
from training.images import is_image_name, open_image

HEADER_BYTES = 64 * 1024
SPLITS = ("train", "val", "test")
# Written last by an uploader, directly under the version's prefix; the relay and the sensor
# wait for it. It is the one blob that is neither validated nor staged.
COMPLETION_MARKER = "_SUCCESS"
# Bumped when what a row says about an image changes, so cached rows of older rules are not
# reused (2: only PNG and JPEG, by name and content, are readable).
DESCRIBE_VERSION = 2


class DataValidationError(RuntimeError):
    """The data gate failed; the message lists each failed expectation with its counts."""


def _describe_image(container: Any, blob: Any, prefix: str) -> dict[str, Any]:
    rel = blob.name[len(prefix) + 1 :] if prefix else blob.name
    parts = rel.split("/")
    row: dict[str, Any] = {
        "path": rel,
        "split": parts[0] if len(parts) == 3 else None,
        "label": parts[1] if len(parts) == 3 else None,
        "bytes": int(blob.size),
        "width": None,
        "height": None,
        "channels": None,
        "readable": False,
        "md5": None,
    }
    stored = blob.content_settings.content_md5 if blob.content_settings else None
    if stored:
        row["md5"] = base64.b64encode(bytes(stored)).decode()
    if blob.size == 0 or not is_image_name(rel):  # the trainer reads only .png/.jpg/.jpeg
        return row
    head = container.download_blob(
        blob.name, offset=0, length=min(blob.size, HEADER_BYTES)
    ).readall()
    if row["md5"] is None and len(head) == blob.size:
        row["md5"] = base64.b64encode(hashlib.md5(head, usedforsecurity=False).digest()).decode()
    try:
        with open_image(io.BytesIO(head)) as image:
            row.update(
                width=image.width,
                height=image.height,
                channels=len(image.getbands()),
                readable=True,
            )
    except Exception:  # PIL raises many types for garbage; the gate reports them as unreadable
        pass
    return row


def _cache_path(config: PipelineConfig) -> Path:
    where = (
        f"{DESCRIBE_VERSION}|{config.data.account_url or ''}|{config.data.container}|"
        f"{config.data.prefix}"
    )
    key = hashlib.sha256(where.encode()).hexdigest()[:16]
    return config.work_dir / "gate-cache" / f"{config.data.container}-{key}.json"


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        entries = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}  # no usable cache: every image is read again
    return entries if isinstance(entries, dict) else {}


def list_dataset(config: PipelineConfig) -> list[Any]:
    """Every blob under the prefix but the completion marker: what the gate validates and
    staging stages (a name starting with ``_`` elsewhere is data like any other)."""
    container = container_client(config.data, config.retries.storage_retries)
    prefix = config.data.prefix
    marker = f"{prefix}/{COMPLETION_MARKER}" if prefix else COMPLETION_MARKER
    return [b for b in container.list_blobs(name_starts_with=folder(prefix)) if b.name != marker]


def build_manifest(
    config: PipelineConfig, blobs: list[Any] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """One row per blob (``blobs``, default: :func:`list_dataset`), and how many rows came
    from the cache (unchanged blobs)."""
    container = container_client(config.data, config.retries.storage_retries)
    prefix = config.data.prefix
    if blobs is None:
        blobs = list_dataset(config)
    cache_file = _cache_path(config)
    cache = _load_cache(cache_file)

    def describe(blob: Any) -> tuple[dict[str, Any], bool]:
        """The blob's row, and whether it came from the cache (same name, same ETag)."""
        hit = cache.get(blob.name)
        if (
            isinstance(hit, dict)
            and hit.get("etag") == blob.etag
            and isinstance(hit.get("row"), dict)
        ):
            return dict(hit["row"]), True
        return _describe_image(container, blob, prefix), False

    with ThreadPoolExecutor(max_workers=16) as pool:
        described = list(pool.map(describe, blobs))
    rows = [row for row, _ in described]
    reused = sum(1 for _, from_cache in described if from_cache)
    entries = {b.name: {"etag": b.etag, "row": row} for b, row in zip(blobs, rows, strict=True)}
    atomic_write(
        cache_file, lambda fh: fh.write(json.dumps(entries, separators=(",", ":")).encode())
    )
    by_split: dict[str, set[str]] = {}
    for row in rows:
        if row["md5"]:
            by_split.setdefault(row["split"] or "", set()).add(row["md5"])
    train, test = (
        by_split.get("train", set()),
        by_split.get("test", set()) | by_split.get("val", set()),
    )
    for row in rows:
        row["leak"] = bool(row["md5"]) and row["md5"] in train and row["md5"] in test
    return rows, reused


def _class_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    labels = sorted({r["label"] for r in rows if r["label"]})
    counts = []
    for label in labels:
        per = {s: sum(1 for r in rows if r["label"] == label and r["split"] == s) for s in SPLITS}
        counts.append({"label": label, **{f"{s}_images": n for s, n in per.items()}})
    return counts


def run_expectations(
    rows: list[dict[str, Any]], config: PipelineConfig, docs_dir: Path
) -> tuple[bool, list[dict[str, Any]]]:
    """Run the suites; return success and one record per expectation (failed ones first)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    import pandas as pd

    v = config.validation
    manifest = pd.DataFrame(
        rows,
        columns=[
            "path",
            "split",
            "label",
            "width",
            "height",
            "channels",
            "bytes",
            "md5",
            "readable",
            "leak",
        ],
    )
    counts = pd.DataFrame(
        _class_counts(rows), columns=["label", "train_images", "val_images", "test_images"]
    )
    known = sorted(set(manifest.loc[manifest["split"] == "train", "label"].dropna()))
    context = gx.get_context(mode="ephemeral")
    context.add_data_docs_site(
        "run",
        {
            "class_name": "SiteBuilder",
            "store_backend": {
                "class_name": "TupleFilesystemStoreBackend",
                "base_directory": str(docs_dir.resolve()),
            },
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    source = context.data_sources.add_pandas("dataset")
    suites = {
        "images": [
            gxe.ExpectTableRowCountToBeBetween(min_value=1),
            gxe.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS)),
            gxe.ExpectColumnDistinctValuesToContainSet(column="split", value_set=["train", "test"]),
            gxe.ExpectColumnValuesToBeInSet(
                column="label", value_set=known or ["(no train split)"]
            ),
            gxe.ExpectColumnValuesToBeInSet(column="readable", value_set=[True]),
            gxe.ExpectColumnValuesToBeBetween(column="bytes", min_value=1),
            gxe.ExpectColumnValuesToBeBetween(
                column="width", min_value=v.min_side, max_value=v.max_side
            ),
            gxe.ExpectColumnValuesToBeBetween(
                column="height", min_value=v.min_side, max_value=v.max_side
            ),
            gxe.ExpectColumnValuesToBeInSet(column="channels", value_set=[1, 2, 3, 4]),
            gxe.ExpectColumnValuesToBeInSet(column="leak", value_set=[False]),
        ],
        "classes": [
            gxe.ExpectTableRowCountToBeBetween(min_value=2),
            gxe.ExpectColumnValuesToBeBetween(
                column="train_images", min_value=v.min_images_per_class
            ),
            gxe.ExpectColumnValuesToBeBetween(column="test_images", min_value=1),
        ],
    }
    if (manifest["split"] == "val").any():  # optional, but when present, every class in it
        suites["classes"].append(
            gxe.ExpectColumnValuesToBeBetween(column="val_images", min_value=1)
        )
    frames = {"images": manifest, "classes": counts}
    definitions = []
    for name, expectations in suites.items():
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        suite = context.suites.add(gx.ExpectationSuite(name=name))
        for expectation in expectations:
            suite.add_expectation(expectation)
        definitions.append(
            context.validation_definitions.add(
                gx.ValidationDefinition(name=name, data=batch, suite=suite)
            )
        )
    records: list[dict[str, Any]] = []
    success = True
    for definition in definitions:
        result = definition.run(
            batch_parameters={"dataframe": frames[definition.name]}, result_format="SUMMARY"
        )
        success &= bool(result.success)
        for r in result.results:
            conf = r.expectation_config
            assert conf is not None  # GX fills it for every result of a suite run
            kwargs = conf.kwargs
            records.append(
                {
                    "table": definition.name,
                    "expectation": conf.type,
                    "column": kwargs.get("column", ""),
                    "success": bool(r.success),
                    "unexpected": r.result.get("unexpected_count"),
                    "examples": [
                        str(x) for x in (r.result.get("partial_unexpected_list") or [])[:5]
                    ],
                }
            )
    context.build_data_docs(site_names=["run"])
    records.sort(key=lambda rec: rec["success"])
    return success, records


def _examples(rows: list[dict[str, Any]], record: dict[str, Any]) -> list[str]:
    """File names behind a failed column expectation, so the report points at the data."""
    column = record["column"]
    if record["table"] != "images" or not column or not record["examples"]:
        return record["examples"]
    bad = set(record["examples"])
    return [r["path"] for r in rows if str(r.get(column)) in bad][:5]


def _upload_docs(config: PipelineConfig, docs: Path, output_prefix: str) -> str:
    container = container_client(config.output, config.retries.storage_retries, create=True)
    upload_directory(container, docs, f"{output_prefix}/data_docs", workers=8)
    return blob_link(container, f"{output_prefix}/data_docs/index.html")


@task(name="validate-data", cache_policy=NONE)
def validate_data(config: PipelineConfig, run_dir: Path, output_prefix: str) -> dict[str, Any]:
    logger = get_run_logger()
    started = time.perf_counter()
    blobs = list_dataset(config)
    rows, cached = build_manifest(config, blobs)
    docs = run_dir / "data_docs"
    success, records = run_expectations(rows, config, docs)
    docs_url = _upload_docs(config, docs, output_prefix)
    failed = [r for r in records if not r["success"]]
    lines = [
        f"# Data gate: {'passed' if success else 'FAILED'}",
        "",
        f"{len(rows)} images under `{config.data.container}/{config.data.prefix}`; "
        f"{len(records) - len(failed)} of {len(records)} expectations met. "
        f"Data Docs: {docs_url}",
        "",
    ]
    # An empty table renders as a stray dot: a passed gate says so in words.
    if failed:
        lines += [
            "| table | expectation | column | unexpected | examples |",
            "|---|---|---|---|---|",
        ]
    else:
        lines.append("Every expectation was met.")
    for r in failed:
        lines.append(
            f"| {r['table']} | {r['expectation']} | {r['column']} | {r['unexpected']} "
            f"| {', '.join(_examples(rows, r))} |"
        )
    create_markdown_artifact(
        "\n".join(lines), key="data-gate", description="Great Expectations gate"
    )
    if not success:
        summary = "; ".join(
            f"{r['expectation']}({r['column'] or r['table']}): "
            f"{r['unexpected'] if r['unexpected'] is not None else 'failed'} "
            f"unexpected, e.g. {', '.join(_examples(rows, r)) or '-'}"
            for r in failed
        )
        raise DataValidationError(f"data gate failed, nothing was provisioned: {summary}")
    # Staging stages exactly this listing (names and ETags), nothing listed later.
    pinned = listing_blob(output_prefix)
    container_client(config.output, config.retries.storage_retries).upload_blob(
        pinned, listing_json(config.data.prefix, (pin(b) for b in blobs)), overwrite=True
    )
    logger.info(
        "data gate passed: %d images (%d unchanged since the last gate, not read again), "
        "%d expectations",
        len(rows),
        cached,
        len(records),
    )
    return step_record(
        "validate-data",
        started,
        True,
        images=len(rows),
        read_from_cache=cached,
        listing=pinned,
        classes=len({r["label"] for r in rows}),
        data_docs=docs_url,
    )
