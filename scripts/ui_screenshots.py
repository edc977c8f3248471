"""Screenshots of the Prefect UI, taken by headless Chromium: what a person sees of a run.

Against a running Prefect server (``--api-url``, default ``$PREFECT_API_URL``), saves PNGs of
the latest completed ``retrain`` flow run's page, its artifacts tab, its summary artifact (with
the loss/accuracy curves and the confusion matrix embedded in it), the confusion matrix's own
image artifact (the picture comes from the outputs gateway), the page its outputs link
opens (clicked through to the outputs gateway, which must be running: a 403 or a refused
connection fails the script) and, when the
``retrain/manual`` deployment exists, its custom-run form. Run it against ``make service``:

    python scripts/ui_screenshots.py --api-url http://127.0.0.1:4200/api

(its API's auth string from ``PREFECT_API_AUTH_STRING``, which the checkout's ``.env`` sets
while the service runs; the gateway's from ``RETRAIN_GATEWAY_AUTH_STRING``:
``RETRAIN_GATEWAY_AUTH_STRING=$(cat .service/credentials/gateway)``)

(``make setup`` installs Chromium as root; elsewhere ``apt-get install -y chromium``). The test
suite drives the same browser through :class:`DevTools` (tests/deployments/test_service.py).

The UI is a single-page app: each page gets a few seconds (``--settle``) to fetch and render
before the shot. Chromium is driven over its DevTools protocol (the ``websockets`` client that
Prefect already installs), which can also click the flow run page's Artifacts tab.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@dataclass(frozen=True)
class Page:
    name: str  # the screenshot's file name, without .png
    url: str
    height: int  # the window's height: what the screenshot shows
    click: str | None = None  # the text of a tab to click first
    images: int = 0  # embedded (data: URI) images the page must show, decoded
    follow: str | None = None  # a link the page must show, which is then opened and shot
    expect: str = ""  # text the opened link's page must hold
    picture: str | None = None  # the address of an image the page must show, decoded


def api(base: str, path: str, body: dict[str, Any] | None = None, auth: str | None = None) -> Any:
    """One Prefect REST call (POST with ``body``, else GET); None for a 404. ``auth``: the
    server's auth string (default: Prefect's ``PREFECT_API_AUTH_STRING`` setting, when set)."""
    if auth is None:
        from prefect.settings import PREFECT_API_AUTH_STRING

        auth = PREFECT_API_AUTH_STRING.value()
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(
        f"{base.rstrip('/')}/{path.lstrip('/')}",
        data=data,
        headers=headers,
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def pages(api_url: str, flow_run_id: str | None) -> list[Page]:
    """The pages to shoot: found through the API, addressed as the UI addresses them."""
    ui = api_url.rstrip("/").removesuffix("/api")
    if flow_run_id is None:
        runs = api(
            api_url,
            "flow_runs/filter",
            {
                "flows": {"name": {"any_": ["retrain"]}},
                "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
                "sort": "START_TIME_DESC",
                "limit": 1,
            },
        )
        if not runs:
            raise SystemExit(
                f"no completed run of the retrain flow on {api_url}: run it once first"
            )
        flow_run_id = str(runs[0]["id"])
    shots = [
        Page("flow-run", f"{ui}/runs/flow-run/{flow_run_id}", 1400),
        Page("flow-run-artifacts", f"{ui}/runs/flow-run/{flow_run_id}", 1400, "Artifacts"),
    ]
    summary = api(
        api_url,
        "artifacts/filter",
        {
            "artifacts": {
                "flow_run_id": {"any_": [flow_run_id]},
                "key": {"any_": ["retrain-summary"]},
            },
            "limit": 1,
        },
    )
    if summary:
        shown = summary[0]["data"].count("](data:image/png;base64,")
        if not shown:
            print("the summary has no embedded pictures", file=sys.stderr)
        url = f"{ui}/artifacts/artifact/{summary[0]['id']}"
        shots.append(Page("summary", url, 3200, images=shown))
    else:
        print(f"flow run {flow_run_id} has no retrain-summary artifact", file=sys.stderr)
    chart = api(
        api_url,
        "artifacts/filter",
        {
            "artifacts": {
                "flow_run_id": {"any_": [flow_run_id]},
                "key": {"any_": ["chart-confusion"]},
            },
            "limit": 1,
        },
    )
    if chart and chart[0]["type"] == "image":  # its own artifact, the copy the gateway serves
        url = f"{ui}/artifacts/artifact/{chart[0]['id']}"
        shots.append(Page("chart-artifact", url, 800, picture=chart[0]["data"]))
    folder = api(
        api_url,
        "artifacts/filter",
        {
            "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["outputs"]}},
            "limit": 1,
        },
    )
    if folder:  # the run's outputs folder: its link opens through the outputs gateway
        href = folder[0]["data"].rsplit("](", 1)[-1].rstrip(")")
        url = f"{ui}/artifacts/artifact/{folder[0]['id']}"
        shots.append(Page("link-opens", url, 900, follow=href, expect="model.pt"))
    else:
        print(f"flow run {flow_run_id} has no outputs link artifact", file=sys.stderr)
    deployment = api(api_url, "deployments/name/retrain/manual")
    if deployment:
        shots.append(Page("run-form", f"{ui}/deployments/deployment/{deployment['id']}/run", 2400))
    else:
        print("no retrain/manual deployment: the run form is not shot", file=sys.stderr)
    return shots


def browser(name: str | None) -> str:
    for candidate in (name,) if name else BROWSERS:
        found = shutil.which(candidate)
        if found:
            return found
    raise SystemExit(
        f"no {name or ' / '.join(BROWSERS)} on PATH: `apt-get install -y chromium` (Debian)"
    )


class DevTools:
    """Headless Chromium driven over its DevTools protocol: navigate, wait, click, shoot.

    The command-line ``--screenshot`` cannot click, and the flow run page picks its tab only
    once the run has loaded, so the artifacts tab needs a click."""

    def __init__(self, chromium: str, profile: Path, offline: bool = False) -> None:
        """``offline``: nothing but 127.0.0.1 is reached (no host name resolves), as on a
        machine without internet: a page that needs a CDN shows it."""
        self.proc = subprocess.Popen(
            [
                chromium,
                "--headless=new",
                "--disable-gpu",
                "--disable-dev-shm-usage",  # a container's small /dev/shm crashes the tab
                "--no-sandbox",  # running as root, e.g. in a container
                "--hide-scrollbars",
                "--remote-debugging-port=0",  # any free port: Chromium writes it in the profile
                f"--user-data-dir={profile}",
                *(["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"] if offline else []),
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"{chromium} did not start its DevTools endpoint")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            target = next(t for t in json.loads(r.read()) if t["type"] == "page")
        from websockets.sync.client import connect

        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events arrive in between: skip them
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def navigate(self, url: str, width: int = 1400, height: int = 1400) -> None:
        """Open ``url`` in a window of that size and wait for the document to load."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", f"{url} to load")

    def wait_for(self, expression: str, what: str, seconds: float = 180) -> Any:
        """The value of ``expression`` once it is truthy (a single-page app renders late).
        ``seconds`` only bounds a hang: on a loaded 2-core machine the UI's run form took
        longer than 30 s to render while the test suite ran beside it."""
        deadline = time.monotonic() + seconds
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                shown = self.evaluate(
                    "location.href + ' | ' + (document.body ? document.body.innerText : '')"
                )
                raise TimeoutError(f"timed out waiting for {what}; the page: {str(shown)[:400]!r}")
            time.sleep(0.25)
        return value

    def click(self, text: str) -> None:
        """Click the button, tab or link whose text is ``text``."""
        clicked = self.evaluate(
            "(() => { const e = [...document.querySelectorAll('button, [role=tab], .p-tab, a')]"
            f".find(e => e.textContent.trim() === {json.dumps(text)});"
            " if (e) { e.click(); return true; } return false; })()"
        )
        if not clicked:
            raise LookupError(f"nothing to click named {text!r}")

    def type_into(self, selector: str, text: str) -> None:
        """Focus the first element matching ``selector`` and type ``text`` as a person would
        (the page's own input events follow)."""
        if not self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " if (e) { e.focus(); return true; } return false; })()"
        ):
            raise LookupError(f"no {selector} on the page")
        self.call("Input.insertText", text=text)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def shoot(self, page: Page, width: int, settle: float) -> bytes:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=page.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", url=page.url)
        deadline = time.monotonic() + 30
        while self.evaluate("document.readyState") != "complete" and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(settle)  # the app's own requests, then its transitions
        if page.click:
            try:
                self.click(page.click)
            except LookupError as exc:
                raise SystemExit(f"{page.url}: {exc}") from None
            time.sleep(settle)
        if page.follow:
            self.open_link(page, settle)
        shot = self.call("Page.captureScreenshot", format="png")
        decoded = int(
            self.evaluate(
                "[...document.images].filter(i => i.src.startsWith('data:image/')"
                " && i.complete && i.naturalWidth > 0).length"
            )
            or 0
        )
        if decoded < page.images:
            raise SystemExit(
                f"{page.url}: {decoded} of the {page.images} embedded images were shown"
            )
        if page.picture and not self.evaluate(
            f"[...document.images].some(i => i.src === {json.dumps(page.picture)}"
            " && i.complete && i.naturalWidth > 0)"
        ):
            raise SystemExit(
                f"{page.url}: {page.picture} was not shown (is the outputs gateway running?)"
            )
        return base64.b64decode(shot["data"])

    def open_link(self, page: Page, settle: float) -> None:
        """The UI shows ``page.follow`` as a link; the browser opens it and gets a 200 page
        holding ``page.expect`` (a link that only looks right is not enough)."""
        shown = self.evaluate(
            f"[...document.querySelectorAll('a')].some(a => a.href === {json.dumps(page.follow)})"
        )
        if not shown:
            raise SystemExit(f"{page.url}: no link to {page.follow} on the page")
        self.call("Page.navigate", url=page.follow)
        time.sleep(settle)
        status = self.evaluate("performance.getEntriesByType('navigation')[0]?.responseStatus")
        text = self.evaluate("document.body ? document.body.innerText : ''") or ""
        if status != 200 or page.expect not in text:
            raise SystemExit(
                f"{page.follow} did not open: HTTP {status}, {page.expect!r} not on the page "
                "(is `python -m cli.models --config <the config> serve` running?)"
            )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def sign_in(chrome: DevTools, shots: list[Page], credential: str | None) -> None:
    """Give the browser the gateway's ``user:password`` once, as a person answers its prompt:
    it then sends them with the gateway's links and pictures."""
    from urllib.parse import urlsplit

    gateways = {urlsplit(u).netloc for p in shots for u in (p.follow, p.picture) if u}
    for netloc in sorted(gateways) if credential else []:
        chrome.navigate(f"http://{credential}@{netloc}/")


def small_png(png: bytes) -> bytes:
    """An 8-bit palette PNG at most 1000 px wide: screenshots that stay small in the repo."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as shot:
        image = shot.convert("RGB")
    if image.width > 1000:
        size = (1000, round(image.height * 1000 / image.width))
        image = image.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"), help="Prefect API")
    p.add_argument("--flow-run", help="flow run id (default: the latest completed retrain run)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    p.add_argument("--browser", help=f"Chromium binary (default: first of {', '.join(BROWSERS)})")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--settle", type=float, default=5.0, help="seconds a page gets to render")
    args = p.parse_args(argv)
    if not args.api_url:
        p.error("no Prefect API: pass --api-url or set PREFECT_API_URL")
    chromium = browser(args.browser)
    args.out.mkdir(parents=True, exist_ok=True)
    shots = pages(args.api_url, args.flow_run)
    with tempfile.TemporaryDirectory(prefix="ui-shots-", ignore_cleanup_errors=True) as profile:
        chrome = DevTools(chromium, Path(profile))
        try:
            sign_in(chrome, shots, os.environ.get("RETRAIN_GATEWAY_AUTH_STRING"))
            for page in shots:
                path = args.out / f"{page.name}.png"
                path.write_bytes(small_png(chrome.shoot(page, args.width, args.settle)))
                print(f"{path}  ({path.stat().st_size // 1024} KiB)  {page.url}")
        finally:
            chrome.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
