"""The browser tier: the built guide, served on 127.0.0.1, opened in headless Debian Chromium.

The site is built once per session (``mkdocs build --strict``) and served by a real HTTP server
process (``python -m http.server``). Chromium is Debian's package (``/usr/bin/chromium``, installed
by ``make test`` on CI), driven through Playwright's Python client; Playwright's own browser
downloads are never used. Every request that leaves 127.0.0.1 is aborted and reported: CI has no
internet, and the guide must not need it.

On a failure, screenshots of three pages (the failing page, the home page and the benchmarks page)
are written under ``<pytest tmp>/browser-screenshots`` (or ``$WCACHE_ARTIFACTS_DIR``) and their paths
are attached to the test's report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from guide_pages import DOCS, ROOT
from procs import free_port

CHROMIUM = Path("/usr/bin/chromium")
MERMAID_JS = DOCS / "javascripts" / "mermaid.min.js"
# No sandbox: CI runs as root in a container, where Chromium's sandbox cannot start. The rest keeps
# Chromium from phoning home (there is no network to reach) or probing a GPU that is not there.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
VIEWPORT = {"width": 1280, "height": 900}
# Pages screenshot on any failure, besides the failing page itself.
SCREENSHOT_PAGES = ["", "benchmarks.html"]

# mkdocs-material draws each Mermaid diagram into a *closed* shadow root, which no script (and so no
# test) can look into. Opening them changes nothing in how the diagram is drawn.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, Object.assign({}, init, {mode: "open"})); };
"""


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    if not CHROMIUM.exists():
        reason = f"browser tier: {CHROMIUM} is missing (apt-get install -y chromium; make test installs it on CI)"
        print(reason)
        pytest.skip(reason)
    return CHROMIUM


@pytest.fixture(scope="session")
def site(tmp_path_factory, chromium_path) -> Path:
    """The guide, built in strict mode into a temporary directory."""
    if not MERMAID_JS.is_file():
        pytest.fail(f"{MERMAID_JS.relative_to(ROOT)} is missing: run `make docs-assets` (make test does)")
    out = tmp_path_factory.mktemp("site") / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def base_url(site):
    """http://127.0.0.1:PORT/ of a real HTTP server process serving the built site."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"the HTTP server for the site did not answer on {url}")
            time.sleep(0.1)
    yield url
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="session")
def browser(chromium_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tier: the playwright package (dev extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium_path), args=CHROMIUM_ARGS)
        yield b
        b.close()


class Visit:
    """One page opened at 1280 px (or another viewport): its console errors, failed and external requests."""

    def __init__(self, browser, base_url: str, path: str, viewport: dict | None = None):
        self.base_url, self.path = base_url, path
        self.context = browser.new_context(viewport=viewport or VIEWPORT)
        self.context.add_init_script(OPEN_SHADOW_ROOTS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.external: list[str] = []
        local = re.compile(r"^(?!" + re.escape(base_url) + ")(https?|wss?)://")
        self.page.route(local, self._block)
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("requestfailed", lambda r: self.errors.append(f"request failed: {r.url} ({r.failure})"))

    def _block(self, route):
        self.external.append(route.request.url)
        route.abort()

    def open(self):
        response = self.page.goto(self.base_url + self.path, wait_until="load")
        assert response is not None and response.status == 200, f"{self.path}: HTTP {response and response.status}"
        return self.page

    def close(self):
        self.context.close()


@pytest.fixture
def visit(browser, base_url):
    opened: list[Visit] = []

    def open_page(path: str, viewport: dict | None = None) -> Visit:
        v = Visit(browser, base_url, path, viewport)
        opened.append(v)
        v.open()
        return v

    yield open_page
    for v in opened:
        v.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or "base_url" not in item.funcargs:
        return
    shots = screenshots(item)
    if shots:
        report.sections.append(("browser screenshots", "\n".join(str(s) for s in shots)))
        print("browser screenshots:\n" + "\n".join(str(s) for s in shots))


def screenshots(item) -> list[Path]:
    """Full-page PNGs of the failing page and two fixed ones; what could not be taken is skipped."""
    browser, base_url = item.funcargs.get("browser"), item.funcargs["base_url"]
    if browser is None:
        return []
    root = os.environ.get("WCACHE_ARTIFACTS_DIR")
    out = Path(root) if root else item.config._tmp_path_factory.getbasetemp() / "browser-screenshots"
    out.mkdir(parents=True, exist_ok=True)
    failing = getattr(item, "callspec", None) and item.callspec.params.get("path")
    paths = list(dict.fromkeys([failing] + SCREENSHOT_PAGES if isinstance(failing, str) else SCREENSHOT_PAGES + ["how-it-works.html"]))
    shots = []
    for path in paths[:3]:
        v = Visit(browser, base_url, path)
        try:
            v.open()
            name = re.sub(r"[^\w-]+", "_", f"{item.name}-{path or 'index'}").strip("_") + ".png"
            v.page.screenshot(path=str(out / name), full_page=True)
            shots.append(out / name)
        except Exception as e:  # a screenshot must not hide the failure it illustrates
            print(f"screenshot of {path or 'index'} failed: {e}")
        finally:
            v.close()
    return shots
