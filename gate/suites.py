"""The gate's expectations, and running them with Great Expectations.

Two tables: the manifest (one row per image) and the class counts (one row per class). What
each expectation demands comes from ``validation`` in the config; the Data Docs are built into
a folder the run uploads with its outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.config import ValidationConfig
from gate.manifest import class_counts
from imagedata.images import SPLITS

IMAGE_COLUMNS = [
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
    "problem",
]
CLASS_COLUMNS = ["label", "train_images", "val_images", "test_images"]


def _suites(rules: ValidationConfig, known: list[str], has_val: bool) -> dict[str, list[Any]]:
    """Expectations per table; ``known``: the labels of the train split."""
    import great_expectations.expectations as gxe

    suites: dict[str, list[Any]] = {
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
                column="width", min_value=rules.min_side, max_value=rules.max_side
            ),
            gxe.ExpectColumnValuesToBeBetween(
                column="height", min_value=rules.min_side, max_value=rules.max_side
            ),
            gxe.ExpectColumnValuesToBeInSet(column="channels", value_set=[1, 2, 3, 4]),
            gxe.ExpectColumnValuesToBeInSet(column="leak", value_set=[False]),
            # Why a tar shard cannot be read as samples, or a file sits where no reader looks.
            gxe.ExpectColumnValuesToBeNull(column="problem"),
        ],
        "classes": [
            gxe.ExpectTableRowCountToBeBetween(min_value=2),
            gxe.ExpectColumnValuesToBeBetween(
                column="train_images", min_value=rules.min_images_per_class
            ),
            gxe.ExpectColumnValuesToBeBetween(column="test_images", min_value=1),
        ],
    }
    if has_val:  # optional, but when present, every class in it
        suites["classes"].append(
            gxe.ExpectColumnValuesToBeBetween(column="val_images", min_value=1)
        )
    return suites


def _context(docs_dir: Path) -> Any:
    """An ephemeral Great Expectations context whose only Data Docs site is ``docs_dir``.

    Built from a config of its own rather than the ephemeral default, which adds a site in a
    temporary folder (and logs it) that the run never reads, and draws a progress bar per
    expectation batch on stderr (twice over: one bar per metrics pass), which in a run's
    terminal is noise around the gate's one-line verdict.
    """
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    site = {
        "class_name": "SiteBuilder",
        "store_backend": {
            "class_name": "TupleFilesystemStoreBackend",
            # Great Expectations substitutes $NAME and ${NAME} in its config: a literal $ in
            # the path (a work_dir of that name) is escaped as its docs say.
            "base_directory": str(docs_dir.resolve()).replace("$", r"\$"),
        },
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        data_docs_sites={"run": site},
        progress_bars=ProgressBarsConfig(globally=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def _record(table: str, result: Any) -> dict[str, Any]:
    """One expectation's outcome as the gate's report shows it."""
    conf = result.expectation_config
    assert conf is not None  # GX fills it for every result of a suite run
    return {
        "table": table,
        "expectation": conf.type,
        "column": conf.kwargs.get("column", ""),
        "success": bool(result.success),
        "unexpected": result.result.get("unexpected_count"),
        "examples": [str(x) for x in (result.result.get("partial_unexpected_list") or [])[:5]],
    }


def run_expectations(
    rows: list[dict[str, Any]], rules: ValidationConfig, docs_dir: Path
) -> tuple[bool, list[dict[str, Any]]]:
    """Run the suites; return success and one record per expectation (failed ones first)."""
    import great_expectations as gx
    import pandas as pd

    manifest = pd.DataFrame(rows, columns=IMAGE_COLUMNS)
    frames = {
        "images": manifest,
        "classes": pd.DataFrame(class_counts(rows), columns=CLASS_COLUMNS),
    }
    known = sorted(set(manifest.loc[manifest["split"] == "train", "label"].dropna()))
    context = _context(docs_dir)
    source = context.data_sources.add_pandas("dataset")
    definitions = []
    for name, expectations in _suites(
        rules, known, bool((manifest["split"] == "val").any())
    ).items():
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
        records += [_record(definition.name, r) for r in result.results]
    context.build_data_docs(site_names=["run"])
    records.sort(key=lambda rec: rec["success"])
    return success, records
