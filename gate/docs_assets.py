"""The Data Docs' styles, scripts and fonts, shipped with the docs instead of fetched from CDNs.

Great Expectations writes pages that load Bootstrap, jQuery, bootstrap-table and Font Awesome
from public CDNs; without them the index is a blank page (its table of validations is drawn by
those scripts), so a run's docs were unreadable offline, on a machine without internet, or
wherever the CDNs are blocked. Here every page's CDN references are rewritten to copies placed
beside the docs under ``static/vendor/`` (from the npm packages ``make setup`` installs: the same
releases the pages name), so the outputs gateway, or a downloaded copy of the folder, serves them
whole. Where a page pins a file by Subresource Integrity, the local copy is checked against that
hash first; the attribute is then dropped, since the gateway serves every page sandboxed (an
opaque origin, for which an integrity check would need a CORS answer the gateway never gives).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODE_MODULES = ROOT / "node_modules"
VENDOR = "static/vendor"

# Each CDN address in Great Expectations 1.24's templates (render/view/templates/*.j2), and the
# file of the npm package release it names. The filter-control stylesheet is referenced at
# bootstrap-table 1.19.0 beside the scripts' 1.19.1: the 1.19.1 copy serves both.
ASSETS = {
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery/dist/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": (
        "popper.js-1.12.9/dist/umd/popper.min.js"
    ),
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": (
        "bootstrap/dist/js/bootstrap.min.js"
    ),
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": (
        "bootstrap/dist/css/bootstrap.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": (
        "bootstrap-table/dist/bootstrap-table.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": (
        "bootstrap-table/dist/bootstrap-table.min.js"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.js": (
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.js"
    ),
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.css": (
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.css": (
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.css"
    ),
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/"
    "bootstrap-datepicker.min.css": "bootstrap-datepicker/dist/css/bootstrap-datepicker.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/"
    "bootstrap-datepicker.min.js": "bootstrap-datepicker/dist/js/bootstrap-datepicker.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": (
        "@fortawesome/fontawesome-free/css/all.min.css"
    ),
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/"
    "bootstrap-prefers-dark.css": "@forevolve/bootstrap-dark/dist/css/bootstrap-prefers-dark.css",
}
# Vega draws the charts of profiling pages; a page of the gate's suites calls none of it, so
# its script tags are dropped from such a page (a page that draws a chart keeps them).
CHART_SCRIPTS = (
    "https://cdn.jsdelivr.net/npm/vega@5",
    "https://cdn.jsdelivr.net/npm/vega-lite@5",
    "https://cdn.jsdelivr.net/npm/vega-embed@6",
)
# The logo in the pages' header, which the site's own static/ folder holds too.
LOGO = re.compile(
    r"https://great-expectations-web-assets\.s3\.[a-z0-9-]+\.amazonaws\.com/([\w.-]+)"
)

_STATIC = re.compile(r"^(?:\.\./)*static/([^?#]+)$")
_TAG = re.compile(r"<(?:script|link|img)\b[^>]*>(?:\s*</script>)?", re.IGNORECASE)
_URL = re.compile(r'\b(src|href)="([^"]+)"')
_INTEGRITY = re.compile(r'\s+integrity="([^"]*)"')
_CROSSORIGIN = re.compile(r'\s+crossorigin="[^"]*"')
_CSS_URL = re.compile(r"url\((['\"]?)(?!data:)([^)'\"#?]+)[^)'\"]*\1\)")


class DocsAssetError(RuntimeError):
    """A local copy is missing or differs from what the page pins; the message names it."""


def _sri_matches(path: Path, integrity: str) -> bool:
    """Whether ``path`` has one of the hashes of an integrity attribute (``sha384-...``)."""
    data = path.read_bytes()
    for item in integrity.split():
        algorithm, _, expected = item.partition("-")
        if algorithm in ("sha256", "sha384", "sha512"):
            digest = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
            if digest == expected:
                return True
    return False


def _vendor_copy(package_file: str, docs_dir: Path, node_modules: Path) -> Path:
    """The asset, and the files its stylesheet loads (fonts), copied under static/vendor/."""
    source = node_modules / package_file
    if not source.is_file():
        raise DocsAssetError(
            f"{source} is missing: `make setup` (npm ci) installs the Data Docs' assets"
        )
    target = docs_dir / VENDOR / package_file
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        if source.suffix == ".css":
            for _, relative in _CSS_URL.findall(source.read_text(errors="replace")):
                font = (source.parent / relative).resolve()
                if font.is_file() and node_modules.resolve() in font.parents:
                    copy = target.parent / relative
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(font, copy)
    return target


def localize_page(page: Path, docs_dir: Path, node_modules: Path = NODE_MODULES) -> int:
    """Rewrite one page's CDN references to local copies (and a reference to the site's own
    static folder that misses it to one that finds it); the number rewritten."""
    html = page.read_text(encoding="utf-8")
    draws_charts = "vegaEmbed" in html
    rewritten = 0

    def relative(target: Path) -> str:
        return Path(os.path.relpath(target, page.parent)).as_posix()

    def rewrite(match: re.Match[str]) -> str:
        nonlocal rewritten
        tag = match.group(0)
        found = _URL.search(tag)
        if not found:
            return tag
        url = found.group(2)
        misplaced = _STATIC.match(url)
        if misplaced and not (page.parent / url).exists():
            # Great Expectations writes the validation pages' favicon one folder too shallow.
            own = docs_dir / "static" / misplaced.group(1)
            if own.is_file():
                rewritten += 1
                return tag.replace(found.group(0), f'{found.group(1)}="{relative(own)}"')
        if url in CHART_SCRIPTS and not draws_charts:
            rewritten += 1
            return ""
        logo = LOGO.match(url)
        if logo and (docs_dir / "static" / "images" / logo.group(1)).is_file():
            rewritten += 1
            local = relative(docs_dir / "static" / "images" / logo.group(1))
            return tag.replace(found.group(0), f'{found.group(1)}="{local}"')
        if url not in ASSETS:
            return tag
        target = _vendor_copy(ASSETS[url], docs_dir, node_modules)
        pinned = _INTEGRITY.search(tag)
        if pinned and not _sri_matches(target, pinned.group(1)):
            raise DocsAssetError(
                f"{node_modules / ASSETS[url]} is not the file {url} names (its integrity "
                "hash differs): reinstall it with `npm ci`"
            )
        tag = _CROSSORIGIN.sub("", _INTEGRITY.sub("", tag))
        rewritten += 1
        return tag.replace(found.group(0), f'{found.group(1)}="{relative(target)}"')

    html = _TAG.sub(rewrite, html)
    if rewritten:
        page.write_text(html, encoding="utf-8")
    return rewritten


def localize(docs_dir: Path, node_modules: Path = NODE_MODULES) -> int:
    """Every page of a Data Docs site made readable offline; the references rewritten."""
    return sum(localize_page(page, docs_dir, node_modules) for page in docs_dir.rglob("*.html"))
