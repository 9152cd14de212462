"""The PR comment opened in headless Chromium, as a reader's browser would show it.

tests/ci/test_comment.py renders the comment's markdown with markdown-it-py and reads the HTML; here
that HTML, with raw HTML allowed through (GitHub passes a subset of it, such as <details>), is
loaded by a real browser, and the DOM it builds is what is checked: what a reader can click,
which images load, what is folded. Skipped with the reason where Chromium is not installed
(Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import html as html_module
import re
import shutil
import subprocess

import pytest

from tests.ci._fixtures import EVIL, HEAD, RUN_URL, SCRIPT, TITLE, dry, row, verdict, write

if not SCRIPT.is_file():  # a checkout without it (the judge stages the tests alone for `-m gpu`)
    pytest.skip(".github/scripts/post_verdict_comment.py is not in this checkout", allow_module_level=True)

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--dump-dom",
         # no network: a hostile image or frame must not stall the page (it would show in the DOM)
         "--host-resolver-rules=MAP * ~NOTFOUND"]  # fmt: skip

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")


def browser_dom(body: str, tmp_path) -> str:
    """The DOM Chromium builds from the comment rendered as GitHub would (tables, raw HTML on)."""
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the comment")
    rendered = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(body)
    page = tmp_path / "comment.html"
    # no scripts run (an injected alert() would block the page); what the DOM holds is checked
    csp = "<meta http-equiv=Content-Security-Policy content=\"script-src 'none'\">"
    page.write_text(f"<!doctype html><meta charset=utf-8>{csp}<body>{rendered}</body>", encoding="utf-8")
    done = subprocess.run(
        [CHROMIUM, *FLAGS, page.as_uri()], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert done.returncode == 0 and "<body>" in done.stdout, done.stderr[-2000:]
    return done.stdout


def hostile_comment(tmp_path) -> str:
    rows = [
        row("device 32768x4096-bfloat16 forward", "regression", 1.32, p_value=1e-6, note=EVIL),
        row("device 4096x4096-bfloat16 forward", "regression", 1.081, p_value=1e-4),
        row("latency 4096x4096-bfloat16 forward", note=EVIL),
        row("latency 1x4096-bfloat16 forward", "pass", 0.97),
    ]
    folder = write(tmp_path / "artifacts" / "verdict-h200", verdict(rows=rows))
    return dry(folder, "--run-title", TITLE, "--run-url", RUN_URL)


def test_the_browser_shows_no_link_image_or_script_from_the_artifact(tmp_path):
    dom = browser_dom(hostile_comment(tmp_path), tmp_path)
    links = {html_module.unescape(u) for u in re.findall(r'<a [^>]*href="([^"]*)"', dom)}
    assert links == {RUN_URL}, links  # the job log only: nothing from the artifact is clickable
    for tag in ("img", "script", "iframe", "style", "form", "input"):
        assert f"<{tag}" not in dom, tag
    assert not re.search(r"<[a-z][^>]*\son\w+=", dom)  # no event handler on any element
    text = html_module.unescape(re.sub(r"<[^>]+>", "", dom))
    # what GitHub would link by itself in the text: bare URLs, mentions
    assert not re.search(r"https?://(?!github\.com/o/r/actions/runs/42)", text)
    assert "www.evil" not in text and "@octocat" not in text


def test_the_browser_folds_passing_rows_and_shows_the_worst_regression_first(tmp_path):
    dom = browser_dom(hostile_comment(tmp_path), tmp_path)
    assert dom.count("<details>") == 1 and "<summary>h200: 2 passing checks</summary>" in dom
    before_fold = dom.split("<details>", 1)[0]
    first, second = (before_fold.index(s) for s in ("32768x4096", "device 4096x4096"))
    assert first < second  # +32% above +8.1%
    assert "latency 1x4096-bfloat16 forward" not in before_fold  # passing rows are folded
    assert f"head={HEAD}" not in html_module.unescape(re.sub(r"<!--.*?-->", "", dom, flags=re.S))
