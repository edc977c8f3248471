"""Names from storage in the run's Markdown artifacts: shown as written, never as Markdown.

Whoever can upload training data names the blobs, the class folders and the data versions; the
gate's report and the run's summary name them. A blob called ``![x](https://host/p.png).png``
was an image the Prefect UI fetched from that host whenever the report was opened, ``a|b.png``
broke the table, a prefix with ``[text](url)`` was a link. The artifacts are rendered here with
markdown-it-py (CommonMark and tables, the syntax the Prefect UI renders) and the HTML checked."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from core.data_versions import DataVersion
from core.text import code_fence, markdown_text
from registry.promotion import Decision
from tasks.provision import StagedData
from tasks.report import Charts, summary_markdown
from tasks.steps import StepRecord
from tasks.train_and_score import Scored
from tests.conftest import ROOT
from tests.reliability import report

HOSTILE = [
    "![pixel](https://tracker.example/p.png).png",
    "[sign in](https://evil.example/login).png",
    "<img src=https://tracker.example/x.png>.png",
    "a|b|c.png",
    "`code` and *stars* and _under_.png",
    "www.evil.example.png",
]


def _html(markdown: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(markdown)


def _assert_inert(rendered: str) -> None:
    assert "<img" not in rendered and "<a " not in rendered, rendered
    assert "<em>" not in rendered and "<strong>" not in rendered.split("</p>", 1)[1], rendered


def test_blob_names_in_the_gate_report_are_text(
    azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unreadable images with hostile names: the gate fails and names them in its table."""
    from core.config import BlobLocation, ValidationConfig
    from gate.manifest import build_manifest
    from gate.report import gate_markdown
    from gate.suites import run_expectations
    from tests.pipeline_helpers import new_container

    container = new_container(azurite, "names")
    for label in ("0", "1"):
        for i in range(5):
            container.upload_blob(f"images/v1/train/{label}/{i}.png", b"not an image")
            container.upload_blob(f"images/v1/test/{label}/{i}.png", b"not an image")
    for name in HOSTILE:
        container.upload_blob(f"images/v1/train/0/{name}", b"not an image")
    location = BlobLocation(
        connection_string_env="AZURE_STORAGE_CONNECTION_STRING",
        container=container.container_name,
        prefix="images/v1",
    )
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    rows, _ = build_manifest(location, tmp_path / "cache")
    hostile_rows = [r for r in rows if any(r["path"] == f"train/0/{h}" for h in HOSTILE)]
    assert len(hostile_rows) == len(HOSTILE)
    # Examples are the first five of each failed expectation: the hostile names sort first.
    rows.sort(key=lambda r: r["path"] not in {h["path"] for h in hostile_rows})
    success, records = run_expectations(rows, ValidationConfig(), tmp_path / "docs")
    assert not success
    where = "names/images/v1"
    markdown = gate_markdown(success, rows, records, where, "http://127.0.0.1:4280/docs/index.html")
    rendered = _html(markdown)
    links = re.findall(r'<a href="([^"]*)"', rendered)
    assert links == ["http://127.0.0.1:4280/docs/index.html"], links  # the Data Docs' only
    assert "<img" not in rendered and "<em>" not in rendered and "<code>" not in rendered
    table = rendered.split("<tbody>", 1)[1]
    assert all(row.count("<td>") == 5 for row in table.split("<tr>")[1:]), table
    shown = html.unescape(re.sub(r"<[^>]+>", "", table))
    assert sum(name in shown for name in HOSTILE) >= 5  # named as written (five examples)
    report.record(
        "adversarial",
        "gate report: images named ![x](url), [text](url), <img ...>, a|b, `code`, www.x",
        "each named as written in its cell; no image, link or broken table",
    )


def _scored() -> Scored:
    score = {
        "accuracy": 0.9,
        "num_images": 10,
        "per_class": {},
        "confusion_matrix": [],
        "class_names": [],
    }
    metrics = {
        "epochs": [{"epoch": 1, "train_loss": 0.5, "train_accuracy": 0.8, "images_per_sec": 10.0}],
        "world_size": 1,
        "images_per_sec": 10.0,
        "images_per_sec_per_worker": 10.0,
    }
    return Scored(metrics, score, [])


def test_names_in_the_run_summary_are_text() -> None:
    """The data version's root and name, the source line (a --set value), the decision's reason
    (which names data versions) and a picture left out (which names a class) in the summary."""
    from core.config import load_config

    config = load_config(ROOT / "configs" / "local.yaml")
    root = "images/[sign in](https://evil.example/login)"
    version = DataVersion("data", root, "v![x](https://tracker.example/v.png)", None, None, "named")
    decision = Decision(True, f"better than the champion trained on {root}", "", {})
    steps = [StepRecord("run-training", "ran", 1.0, {"epochs_run": [1], "data": root})]
    charts = Charts(
        left_out={"confusion.png": "ValueError: class ![c](https://tracker.example/c.png)"}
    )
    source = "the config file configs/local.yaml; --set training.extra_args=['<img src=x>']"
    markdown = summary_markdown(
        "run-1",
        steps,
        _scored(),
        decision,
        StagedData("abc", 10, 10, 0),
        config,
        source,
        None,
        charts,
        version,
    )
    rendered = _html(markdown)
    _assert_inert(rendered.split("<pre>", 1)[0])  # the config's YAML block is code, as meant
    text = html.unescape(re.sub(r"<[^>]+>", "", rendered))
    for shown in (root, "v![x](https://tracker.example/v.png)", "['<img src=x>']"):
        assert shown in text, shown
    report.record(
        "adversarial",
        "run summary: a data root, a version, a --set value and a class named as Markdown",
        "shown as written; no image or link",
    )


@pytest.mark.parametrize("text", ["plain", "a ``` b", "````yaml\nx: 1\n````", "`"])
def test_a_code_block_holds_any_text(text: str) -> None:
    """A config value with backticks cannot close the YAML block the summary shows."""
    rendered = _html("\n".join(code_fence(text, "yaml")))
    assert rendered.count("<pre>") == 1 and html.unescape(rendered).count(text) == 1


def test_markdown_text_round_trips_through_a_renderer() -> None:
    for name in [*HOSTILE, "a\\b", "x\n# heading", "$x^$", "&lt;b&gt;"]:
        rendered = _html(f"name: {markdown_text(name)}")
        assert html.unescape(re.sub(r"<[^>]+>", "", rendered)).strip() == (
            f"name: {name}".replace("\n", "\\n")
        ), (name, rendered)
