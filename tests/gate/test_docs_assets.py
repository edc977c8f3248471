"""The gate's Data Docs carry their own styles, scripts and fonts (gate/docs_assets.py): a real
site built by Great Expectations, rewritten, references nothing outside its own folder."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from core.config import ValidationConfig
from gate.docs_assets import ASSETS, NODE_MODULES, DocsAssetError, localize
from tests.gate_helpers import valid_manifest_rows

ASSET_TAG = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site as the gate builds it, untouched."""
    from gate.suites import run_expectations

    docs = tmp_path_factory.mktemp("site") / "data_docs"
    rules = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)
    passed, _ = run_expectations(valid_manifest_rows(), rules, docs)
    assert passed
    return docs


def test_every_page_loads_its_assets_from_its_own_folder(built: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(built, docs)
    pages = sorted(docs.rglob("*.html"))
    before = {p: ASSET_TAG.findall(p.read_text()) for p in pages}
    assert any(url in ASSETS for urls in before.values() for url in urls), "no CDN to rewrite"

    assert localize(docs) > 0
    for page in pages:
        html = page.read_text()
        for url in ASSET_TAG.findall(html):
            assert "://" not in url, f"{page.relative_to(docs)} still loads {url}"
            target = (page.parent / url).resolve()
            assert target.is_file() and docs.resolve() in target.parents, (page, url)
        assert "integrity=" not in html and "crossorigin=" not in html
    # Font Awesome's stylesheet finds its fonts where it looks for them.
    css = next(docs.rglob("all.min.css"))
    assert (css.parent.parent / "webfonts" / "fa-solid-900.woff2").is_file()
    # Run again (a retried gate over the same folder): nothing left to rewrite.
    assert localize(docs) == 0


def test_a_local_copy_that_is_not_the_pinned_file_is_refused(built: Path, tmp_path: Path) -> None:
    """The pages pin Popper and Bootstrap's script by Subresource Integrity: a copy that differs
    from the release they name is not served in its place."""
    modules = tmp_path / "node_modules"
    for package_file in ASSETS.values():
        (modules / package_file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(NODE_MODULES / package_file, modules / package_file)
    popper = modules / "popper.js-1.12.9/dist/umd/popper.min.js"
    popper.write_bytes(popper.read_bytes() + b"\n// changed")
    docs = tmp_path / "docs"
    shutil.copytree(built, docs)
    with pytest.raises(DocsAssetError, match=r"popper\.min\.js is not the file"):
        localize(docs, modules)


def test_a_missing_package_is_named(built: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(built, docs)
    with pytest.raises(DocsAssetError, match=r"is missing: `make setup` \(npm ci\)"):
        localize(docs, tmp_path / "empty")


def test_a_dollar_in_the_site_folder_is_a_folder_name(tmp_path: Path) -> None:
    """Great Expectations expands $NAME in its config; a work_dir named with a $ failed the gate
    with MissingConfigVariableError, or would have put the site at the variable's value."""
    from gate.suites import run_expectations

    docs = tmp_path / "$HOME ${PATH} $(id)" / "data_docs"
    rules = ValidationConfig(min_images_per_class=2, min_side=8, max_side=64)
    passed, _ = run_expectations(valid_manifest_rows(), rules, docs)
    assert passed
    assert (docs / "index.html").is_file()
