"""The published asv history page, opened in headless Chromium as a person would.

Runs only where ``asv publish`` has written ``.asv/html/index.html`` (or the page in
``RMSNORM_HISTORY_HTML``: ``nox -s history -- --demo`` checks its demo page) and Chromium is installed
(Debian: ``apt-get install chromium``); skipped with the reason elsewhere, except under
``nox -s history`` (``RMSNORM_HISTORY_CHECK=1``), whose check this is: there it fails. The page is served
from a copy of ``.asv/html`` on a loopback HTTP server, Chromium renders the benchmark list and
one graph, and the screenshots are kept under ``outputs/asv-page/``.

asv's page loads jQuery, flot, bootstrap and a few small plugins from public CDNs. Where those
cannot be reached, point ``RMSNORM_ASV_JS`` at a folder holding local copies named as in the
CDN addresses (``jquery-3.3.1.min.js``, ``jquery.flot.min.js``, ...); the copy of the page then
loads them instead (docs/gate.md says where to get them). When neither loads, the test skips
(fails under ``nox -s history``) and says so.
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

from rmsnorm_suite.history import localise
from tests.suite._page_check import assert_every_graph_has_data

ROOT = Path(__file__).resolve().parents[2]
# the published page: .asv/html, or the folder `nox -s history` names (.asv/demo/html for --demo)
HTML = Path(os.environ.get("RMSNORM_HISTORY_HTML") or ROOT / ".asv" / "html")
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
    "bench_rmsnorm.Forward.track_min_ms",
    "bench_rmsnorm.Forward.track_max_ms",
    "bench_rmsnorm.Forward.track_error_y",
    "bench_rmsnorm.ForwardBackward.track_median_ms",
    "bench_rmsnorm.ForwardBackward.track_error_dw",
]
GRAPH = "bench_rmsnorm.Forward.track_median_ms"
# one shape's graph, as docs/gate.md links it: every provider at that shape, nothing else
SHAPE = "4096x4096-bfloat16"
SHAPE_GRAPH = f"{GRAPH}?p-shape=%27{SHAPE}%27"
# under `nox -s history` the page test is the check: it may not be skipped
REQUIRED = os.environ.get("RMSNORM_HISTORY_CHECK") == "1"


def cannot_run(reason: str):
    """Skip, or, where this test is the session's check, fail: a check that did not run is not a pass."""
    if REQUIRED:
        pytest.fail(f"the history page could not be checked: {reason}", pytrace=False)
    pytest.skip(reason)


pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def site():
    if not (HTML / "index.html").is_file():
        cannot_run("no published asv page (.asv/html/index.html): run `nox -s history` (asv publish) first")
    if CHROMIUM is None:
        cannot_run("headless Chromium is not installed (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="asv-page-") as tmp:
        root = Path(tmp) / "site"
        shutil.copytree(HTML, root)
        js_dir = os.environ.get("RMSNORM_ASV_JS")
        used = localise(root, Path(js_dir)) if js_dir else []
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
        cannot_run(
            "asv's page could not load its JavaScript (public CDNs unreachable here and no local copies "
            "in RMSNORM_ASV_JS: bash tools/fetch_asv_js.sh); see docs/gate.md"
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


def test_one_shape_per_graph_by_link(site):
    """The per-shape link of docs/gate.md: that shape alone selected, every provider a line of it."""
    url, _ = site
    dom = render(f"{url}#{SHAPE_GRAPH}", SHOTS / "shape.png")
    active = set(re.findall(r'class="btn btn-default btn-xs active" role="button">(\d+x\d+-\w+)<', dom))
    assert active == {SHAPE}, f"shapes selected: {sorted(active)}"
    series = re.findall(r'class="legendLabel">([^<]*)<', dom)
    assert series and all(f"shape-{SHAPE}" in s for s in series), series
    assert any("provider-kernel" in s for s in series), series


def test_every_graph_has_data_points():
    """A page whose graphs have no data point (every recorded value null) draws empty axes and
    passes the rendering tests: this check fails it (tests/suite/test_history.py feeds it such a page)."""
    if not (HTML / "index.html").is_file():
        cannot_run("no published asv page (.asv/html/index.html): run `nox -s history` (asv publish) first")
    assert_every_graph_has_data(HTML)


def test_the_accepted_rows_are_linked_from_the_page():
    """asv does not read accepted.json: `nox -s history` writes its rows to accepted.html
    (src/rmsnorm_suite/acceptedpage.py) and links it from the navigation bar; a page without it fails here."""
    if not (HTML / "index.html").is_file():
        cannot_run("no published asv page (.asv/html/index.html): run `nox -s history` (asv publish) first")
    if not (HTML / "accepted.html").is_file() and not REQUIRED:
        pytest.skip("no accepted.html: the page was published without `nox -s history`")
    assert "<h1>Accepted regressions</h1>" in (HTML / "accepted.html").read_text(encoding="utf-8")
    assert 'href="accepted.html"' in (HTML / "index.html").read_text(encoding="utf-8")
