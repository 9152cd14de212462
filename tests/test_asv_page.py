"""The published asv history page, opened in headless Chromium as a person would.

Runs only where ``asv publish`` has written ``.asv/html/index.html`` and Chromium is installed
(Debian: ``apt-get install chromium``); skipped with the reason elsewhere. The page is served
from a copy of ``.asv/html`` on a loopback HTTP server, Chromium renders the benchmark list and
one graph, and the screenshots are kept under ``outputs/asv-page/``.

asv's page loads jQuery, flot, bootstrap and a few small plugins from public CDNs. Where those
cannot be reached, point ``RMSNORM_ASV_JS`` at a folder holding local copies named as in the
CDN addresses (``jquery-3.3.1.min.js``, ``jquery.flot.min.js``, ...); the copy of the page then
loads them instead (docs/gate.md says where to get them). When neither loads, the test skips
and says so.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / ".asv" / "html"
SHOTS = ROOT / "outputs" / "asv-page"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--window-size=1400,1000",
    "--virtual-time-budget=15000",  # let the page's scripts fetch the JSON and draw
]
LOAD_FAILURE = "continental origin of swallow"  # asv's error page when its JS did not load
# benchmark (as asv names it) that must be listed, and the one whose graph must render
EXPECTED = [
    "bench_rmsnorm.Forward.track_median_ms",
    "bench_rmsnorm.Forward.track_bandwidth",
    "bench_rmsnorm.Forward.track_error_y",
    "bench_rmsnorm.ForwardBackward.track_median_ms",
    "bench_rmsnorm.ForwardBackward.track_error_dw",
]
GRAPH = "bench_rmsnorm.Forward.track_median_ms"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (HTML / "index.html").is_file(),
        reason="no published asv page (.asv/html/index.html): run `asv publish` (nox -s history) first",
    ),
    pytest.mark.skipif(
        CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"
    ),
]


def _localise(site: Path, js_dir: Path) -> list[str]:
    """Point the page's CDN tags at local copies found in ``js_dir`` (by file name); returns
    the names substituted. Integrity attributes go with them: the copies are the local ones."""
    index = site / "index.html"
    text = index.read_text(encoding="utf-8")
    used = []

    def swap(match: re.Match) -> str:
        tag, url = match.group(0), match.group(2)
        name = url.rsplit("/", 1)[-1]
        if not (js_dir / name).is_file():
            return tag
        (site / "vendor").mkdir(exist_ok=True)
        shutil.copyfile(js_dir / name, site / "vendor" / name)
        used.append(name)
        tag = tag.replace(url, f"vendor/{name}")
        return re.sub(r'\s(integrity|crossorigin|referrerpolicy)="[^"]*"', "", tag)

    text = re.sub(r'<(script|link)[^>]*(?:src|href)="(https://[^"]+)"[^>]*>', swap, text)
    index.write_text(text, encoding="utf-8")
    return used


@pytest.fixture(scope="module")
def site():
    with tempfile.TemporaryDirectory(prefix="asv-page-") as tmp:
        root = Path(tmp) / "site"
        shutil.copytree(HTML, root)
        js_dir = os.environ.get("RMSNORM_ASV_JS")
        used = _localise(root, Path(js_dir)) if js_dir else []
        handler = functools.partial(_QuietHandler, directory=str(root))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/index.html", used
        finally:
            server.shutdown()
            server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def chromium(url: str, *args: str) -> str:
    """Run headless Chromium on ``url`` with a fresh profile; returns its standard output."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def render(url: str, shot: Path) -> str:
    """The DOM after the scripts ran, and a screenshot of the same page."""
    dom = chromium(url, "--dump-dom")
    if LOAD_FAILURE in dom:
        pytest.skip(
            "asv's page could not load its JavaScript (public CDNs unreachable here and no local copies "
            "in RMSNORM_ASV_JS); see docs/gate.md"
        )
    SHOTS.mkdir(parents=True, exist_ok=True)
    chromium(url, f"--screenshot={shot}")
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return dom


def test_benchmarks_are_listed(site):
    url, _ = site
    dom = render(url, SHOTS / "index.png")
    missing = [name for name in EXPECTED if name not in dom]
    assert not missing, f"not listed on the page: {missing}"


def test_a_graph_renders(site):
    url, _ = site
    dom = render(f"{url}#{GRAPH}", SHOTS / "graph.png")
    assert GRAPH in dom
    # flot draws into <canvas class="flot-base">, with the axis tick labels as elements beside it
    assert re.search(r'<canvas[^>]*class="flot-base"', dom), "no flot canvas: the graph did not render"
    assert "flot-tick-label" in dom or "tickLabel" in dom, "the graph has no axis labels"
