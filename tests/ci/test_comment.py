"""The PR comment script with hostile and broken artifacts, offline: its GitHub calls go to an
in-memory client, and the markdown it writes is rendered to HTML with markdown-it-py to show
that nothing from an artifact becomes a link, an image, HTML or a mention."""

from __future__ import annotations

import html as html_module
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.ci._fixtures import (
    BASE,
    EVIL,
    HEAD,
    OLD,
    ROWS,
    RUN_URL,
    SCRIPT,
    TITLE,
    dry,
    row,
    verdict,
    write,
)

if not SCRIPT.is_file():  # a checkout without it (the judge stages the tests alone for `-m gpu`)
    pytest.skip(".github/scripts/post_verdict_comment.py is not in this checkout", allow_module_level=True)
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))  # the scripts import each other, as when run from the job
_spec = importlib.util.spec_from_file_location("post_verdict_comment", SCRIPT)
pvc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pvc  # dataclasses look their module up by name
_spec.loader.exec_module(pvc)

REGRESSED = [r for r in ROWS if r["verdict"] != "error"]


def html(body: str) -> str:
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the comment")
    return markdown_it.MarkdownIt("commonmark").enable("table").render(body)


def shown(body: str) -> str:
    """The text a reader sees: the rendered HTML without its tags, entities decoded."""
    return html_module.unescape(re.sub(r"<[^>]+>", "", html(body)))


def assert_inert(body: str, pages: bool = False) -> None:
    """Rendered, the comment links only to the run (and with ``pages``, to benchmark histories of
    the one form HISTORY) and holds no artifact HTML, image or mention."""
    rendered = html(body)
    links = re.findall(r'<a href="([^"]*)"', rendered)
    history = {u for u in links if pages and HISTORY.fullmatch(html_module.unescape(u))}
    assert set(links) - history <= {RUN_URL}, links
    for tag in re.findall(r"<[a-z][^>]*>", rendered):
        assert not re.search(r"\b(src|on\w+|style)=", tag), tag
    tags = set(re.findall(r"<([a-z]+)[\s>]", rendered))
    assert tags <= {"h2", "h3", "p", "ul", "li", "strong", "code", "table", "thead", "tbody", "tr", "th", "td",
                    "details", "summary", "a", "em"}, tags  # fmt: skip
    text = shown(body)
    # what GitHub would link by itself: mentions, issue references, bare URLs
    assert not re.search(r"@[A-Za-z0-9]", text)
    assert not re.search(r"#\d", text) and "GH-5" not in text
    assert not re.search(r"https?://(?!github\.com/o/r/actions/runs/42)", text)
    assert "www.evil" not in text
    assert len(body) < 65_536


# ------------------------------------------------------------------------------------------------
# Presentation
# ------------------------------------------------------------------------------------------------


def test_regressions_come_first_sorted_by_change_and_passing_rows_fold(tmp_path):
    body = dry(write(tmp_path / "verdict-h200", verdict()), "--run-title", TITLE, "--run-url", RUN_URL)
    lines = body.splitlines()
    assert lines[0] == f"<!-- rmsnorm-kernel:gpu-verdict head={HEAD} -->"
    assert lines[1] == "## GPU verdict: ⚠️ could not judge"  # the worst row: the GPU tests timed out
    assert f"head `{HEAD[:12]}`" in body and f"base `{BASE[:12]}`" in body and f"[job log]({RUN_URL})" in body
    summary = next(line for line in lines if line.startswith("- **h200**"))
    assert "2 regressed, 1 could not judge, 3 pass of 6 checks" in summary and "+32.0%" in summary
    attention = body.split("### h200: needs attention", 1)[1].split("<details>", 1)[0]
    order = [
        line.split(" | ")[0] for line in attention.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert order == ["| check", "| device 32768x4096-bfloat16 forward", "| device 4096x4096-bfloat16 forward",
                     "| gpu tests &#40;head&#41;"]  # fmt: skip
    flagged = next(line for line in attention.splitlines() if "32768x4096" in line)
    assert "+32.0%" in flagged and "p = 1e-06 (α 0.01)" in flagged and "> +5.0%" in flagged
    assert "40.0 µs → 52.8 µs" in flagged and "**regression**" in flagged
    folded = body.split("<details><summary>h200: 3 passing checks</summary>", 1)[1].split("</details>", 1)[0]
    assert "latency 4096x4096-bfloat16 forward" in folded and "error dx 4096x4096-float32" in folded
    assert "IGNORED SUMMARY" not in body  # the summary is rebuilt from the rows
    assert "Re-run jobs" in body and "pr_verdict" in body and "verdict-KIND" in body
    assert_inert(body)


def test_a_confidence_interval_is_shown_when_the_row_has_one(tmp_path):
    rows = [
        row(
            "device 4096x4096-bfloat16 forward",
            "regression",
            1.08,
            ci_low=1.06,
            ci_high=1.10,
            confidence=0.95,
        )
    ]
    body = dry(write(tmp_path / "verdict-h200", verdict(rows=rows)), "--run-title", TITLE)
    assert "95% CI +6.0% to +10.0%" in body and "CI low end > +5.0%" in body


def test_one_summary_line_per_gpu_kind_and_the_worst_in_the_title(tmp_path):
    write(tmp_path / "verdict-h200", verdict("pass", rows=[row("latency 1x4096-bfloat16 forward")]))
    write(tmp_path / "verdict-b200", verdict(rows=REGRESSED))
    body = dry(tmp_path, "--run-title", TITLE)
    assert body.splitlines()[1] == "## GPU verdict: ❌ regression"
    assert [line[:12] for line in body.splitlines() if line.startswith("- **")] == [
        "- **b200**: ",
        "- **h200**: ",
    ]


def test_the_comment_stays_under_the_size_limit_with_every_row_in_the_artifact(tmp_path):
    many = [row(f"latency {i}x4096-bfloat16 forward_backward", "regression" if i % 3 else "pass", 1.2 + i / 1e4,
                note=EVIL) for i in range(pvc.MAX_ROWS)]  # fmt: skip
    body = dry(
        write(tmp_path / "verdict-h200", verdict(rows=many)), "--run-title", TITLE, "--run-url", RUN_URL
    )
    assert len(body) <= pvc.MAX_BODY
    assert "every row is in the artifact" in body and body.rstrip().endswith("artifact.")
    assert body.count("<details>") == body.count("</details>")
    assert_inert(body)


# ------------------------------------------------------------------------------------------------
# Hostile artifacts
# ------------------------------------------------------------------------------------------------


def test_markdown_html_links_and_mentions_in_notes_are_neutralised(tmp_path):
    rows = [row("device 4096x4096-bfloat16 forward", "regression", 1.5, note=EVIL)]
    body = dry(
        write(tmp_path / "verdict-h200", verdict(rows=rows)), "--run-title", TITLE, "--run-url", RUN_URL
    )
    assert "octocat" in body and "evil" in body  # shown as text, so a reviewer sees what was there
    assert_inert(body)


@pytest.mark.parametrize(
    "check",
    ["latency <img src=x>", "latency [x](https://evil.example)", "@octocat", "x" * 200, "latency `x`", "#1"],
)
def test_a_check_name_outside_the_pattern_rejects_the_artifact(tmp_path, check):
    body = dry(write(tmp_path / "verdict-h200", verdict("pass", rows=[row(check)])), "--run-title", TITLE)
    assert "## GPU verdict: ⚠️ could not judge" in body and "check name does not match" in shown(body)
    assert_inert(body)


def test_a_backtick_breakout_in_base_sha_is_rejected(tmp_path):
    evil = verdict(base_sha="abc` [x](https://evil.example) `")
    body = dry(write(tmp_path / "verdict-h200", evil), "--run-title", TITLE, "--run-url", RUN_URL)
    assert "base_sha is not a 40-hex commit SHA" in shown(body) and "could not judge" in body.splitlines()[1]
    assert_inert(body)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "ratio": NaN}]}',
            "non-finite",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "ratio": Infinity}]}',
            "non-finite",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "ratio": 1e999}]}',
            "out of range",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "p_value": 2}]}',
            "out of range",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "base": -1}]}',
            "out of range",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "ratio": true}]}',
            "not a number",
        ),
        (
            b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "pass", "ratio": "1.0"}]}',
            "not a number",
        ),
        (b'{"status": "green", "rows": []}', "no status"),
        (b'{"status": "pass", "rows": "none"}', "'rows' is not a list"),
        (b'{"status": "pass", "rows": [{"check": "latency x", "verdict": "fine"}]}', "verdict or kind"),
        (b"[" * 100_000 + b"]" * 100_000, "not readable JSON"),
        (b"\xff\xfe not utf-8", "not readable JSON"),
    ],
)
def test_malformed_numbers_and_fields_become_could_not_judge(tmp_path, raw, message):
    body = dry(write(tmp_path / "verdict-h200", raw=raw), "--run-title", TITLE)
    assert body.splitlines()[1] == "## GPU verdict: ⚠️ could not judge"
    assert message in html(body).replace("&#39;", "'").replace("&amp;#39;", "'") or message in body.replace(
        "&#39;", "'"
    )


def test_a_pass_status_over_regressed_rows_is_shown_as_the_regression(tmp_path):
    body = dry(write(tmp_path / "verdict-h200", verdict("pass", rows=REGRESSED)), "--run-title", TITLE)
    assert body.splitlines()[1] == "## GPU verdict: ❌ regression"


def test_a_verdict_without_rows_is_not_a_pass(tmp_path):
    body = dry(write(tmp_path / "verdict-h200", verdict("pass", rows=[])), "--run-title", TITLE)
    assert body.splitlines()[1] == "## GPU verdict: ⚠️ could not judge"


def test_an_oversized_artifact_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    folder = tmp_path / "verdict-h200"
    folder.mkdir()
    with open(folder / "verdict.json", "wb") as f:  # sparse: a 2 GB file costs nothing here
        f.truncate(2_000_000_000)
    monkeypatch.setattr(pvc.json, "loads", lambda *a, **k: pytest.fail("parsed an oversized artifact"))
    entries = pvc.collect(tmp_path, pvc.Run(7, HEAD))
    assert entries[0].status == "error" and "over the limit" in entries[0].problem


def test_an_artifact_about_another_commit_is_not_believed(tmp_path):
    write(tmp_path / "verdict-h200", verdict("pass", head_sha=OLD))
    assert "names another head commit" in shown(dry(tmp_path, "--run-title", TITLE))
    other = tmp_path / "second"
    write(other / "verdict-h200", verdict("pass", rows=ROWS[:1]), pr={"number": 9, "head_sha": OLD})
    assert "pr.json names another head commit" in shown(dry(other, "--run-title", TITLE))


def test_links_in_the_arguments_are_checked_too(tmp_path):
    write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1]))
    body = dry(
        tmp_path, "--run-title", TITLE, "--run-url", "javascript:alert(1)//github.com/o/r/actions/runs/1"
    )
    assert "javascript" not in body and "[job log]" not in body
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--verdicts", str(tmp_path), "--dry-run", "--run-title", "GPU verdict #7 at `x`"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "is not 'GPU verdict #N at SHA'" in bad.stderr


# ------------------------------------------------------------------------------------------------
# Posting, against an in-memory GitHub
# ------------------------------------------------------------------------------------------------


class FakeGitHub:
    """The REST calls the script makes: one open PR #7 whose head is ``head``."""

    def __init__(self, head=HEAD, comments=(), state="open"):
        self.head, self.state, self.calls, self.checks = head, state, [], []
        self.comments = [dict(c) for c in comments]

    def request(self, method, path, payload=None):
        self.calls.append(f"{method} {path}")
        if method == "GET" and path == "/repos/o/r/pulls/7":
            return {"number": 7, "state": self.state, "head": {"sha": self.head}}
        if method == "GET" and re.fullmatch(r"/repos/o/r/issues/7/comments\?per_page=100&page=1", path):
            return self.comments
        if method == "POST" and path == "/repos/o/r/issues/7/comments":
            self.comments.append({"id": 100 + len(self.comments), "body": payload["body"],
                                  "user": {"login": "github-actions[bot]"}})  # fmt: skip
            return self.comments[-1]
        if method == "PATCH" and (m := re.fullmatch(r"/repos/o/r/issues/comments/(\d+)", path)):
            comment = next(c for c in self.comments if c["id"] == int(m[1]))
            comment["body"] = payload["body"]
            return comment
        if method == "POST" and path == "/repos/o/r/check-runs":
            self.checks.append((payload["head_sha"], payload))
            return payload
        raise AssertionError(f"unexpected call {method} {path}")

    def bodies(self, login="github-actions[bot]"):
        return [c["body"] for c in self.comments if c["user"]["login"] == login]


def post(verdicts: Path, client: FakeGitHub, conclusion="failure", number=7, kinds="h200") -> int:
    """The script as the comment job runs it, after verify_trigger.py wrote what the API said."""
    trigger = Path(tempfile.mkdtemp()) / "trigger.json"
    facts = {"run_id": 42, "number": number, "head_sha": HEAD, "conclusion": conclusion, "url": RUN_URL}
    trigger.write_text(json.dumps(facts), encoding="utf-8")
    argv = ["--verdicts", str(verdicts), "--repo", "o/r", "--trigger", str(trigger), "--kinds", kinds]
    return pvc.main(argv, client=client)


def conclusions(gh: FakeGitHub) -> list[tuple[str, str]]:
    return [(sha, c["conclusion"]) for sha, c in gh.checks]


def ours(body: str) -> dict:
    return {"id": 5, "body": body, "user": {"login": "github-actions[bot]"}}


def test_the_comment_is_created_once_then_updated_in_place_with_a_check_run(tmp_path):
    gh = FakeGitHub(comments=[{"id": 1, "body": "an unrelated comment", "user": {"login": "someone"}}])
    assert post(write(tmp_path / "a" / "verdict-h200", verdict(rows=REGRESSED)), gh) == 0
    assert post(write(tmp_path / "b" / "verdict-h200", verdict("pass", rows=ROWS[:1])), gh, "success") == 0
    assert len(gh.bodies()) == 1 and "## GPU verdict: ✅ pass" in gh.bodies()[0]
    assert gh.comments[0]["body"] == "an unrelated comment"
    assert conclusions(gh) == [(HEAD, "failure"), (HEAD, "success")]
    assert {c["name"] for _, c in gh.checks} == {"GPU verdict"}
    assert gh.checks[0][1]["details_url"] == RUN_URL and gh.checks[0][1]["status"] == "completed"


def test_a_marked_comment_planted_by_another_user_is_never_edited(tmp_path):
    planted = {
        "id": 3,
        "body": f"{pvc.MARKER} head={HEAD} -->\n## GPU verdict: ✅ pass",
        "user": {"login": "mallory"},
    }
    gh = FakeGitHub(comments=[planted])
    post(write(tmp_path / "verdict-h200", verdict(rows=REGRESSED)), gh)
    assert gh.comments[0]["body"] == planted["body"]  # untouched
    assert not [c for c in gh.calls if c.startswith("PATCH")]
    assert len(gh.bodies()) == 1 and "❌ regression" in gh.bodies()[0]


def test_a_cancelled_run_turns_the_previous_pass_into_no_verdict(tmp_path):
    gh = FakeGitHub(comments=[ours(f"{pvc.MARKER} head={HEAD} -->\n## GPU verdict: ✅ pass\n")])
    write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1]))  # a kind that finished before the cancel
    post(tmp_path, gh, "cancelled")
    body = gh.bodies()[0]
    assert "✅" not in body and "## GPU verdict: ⏹️ no verdict" in body and "was cancelled" in body
    assert conclusions(gh) == [(HEAD, "cancelled")]
    assert gh.checks[0][1]["output"]["title"] == "GPU verdict: no verdict: the run was cancelled"
    post(tmp_path, gh, "timed_out")
    assert "timed out" in gh.bodies()[0]


def test_a_fork_run_that_failed_before_pr_json_gets_a_no_verdict_comment(tmp_path):
    gh = FakeGitHub()
    post(tmp_path / "nothing-downloaded", gh, "failure")
    assert (
        "## GPU verdict: ⏹️ no verdict" in gh.bodies()[0]
        and "ended before it wrote a verdict" in gh.bodies()[0]
    )
    assert conclusions(gh) == [(HEAD, "failure")]


def test_a_skipped_run_posts_nothing(tmp_path):
    gh = FakeGitHub(comments=[ours(f"{pvc.MARKER} head={HEAD} -->\n## GPU verdict: ✅ pass\n")])
    post(tmp_path / "nothing-downloaded", gh, "success")
    assert gh.checks == [] and not [c for c in gh.calls if not c.startswith("GET")]


def test_a_verdict_for_an_old_head_only_retires_the_comment(tmp_path):
    gh = FakeGitHub(
        head="e" * 40, comments=[ours(f"{pvc.MARKER} head={HEAD} -->\n## GPU verdict: ✅ pass\n")]
    )
    post(write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1])), gh, "success")
    body = gh.bodies()[0]
    assert "## GPU verdict: ⏳ outdated" in body and "✅" not in body and f"`{'e' * 12}`" in body
    assert body.startswith(f"{pvc.MARKER} head={'e' * 40} -->")
    assert [s[0] for s in gh.checks] == [HEAD]  # the check belongs to the commit that was judged
    gh2 = FakeGitHub(head="e" * 40)
    post(write(tmp_path / "x" / "verdict-h200", verdict("pass", rows=ROWS[:1])), gh2, "success")
    assert gh2.bodies() == []  # no comment is created for a commit that is no longer the head


def test_a_closed_pull_request_gets_nothing(tmp_path):
    gh = FakeGitHub(state="closed")
    post(write(tmp_path / "verdict-h200", verdict()), gh)
    assert gh.calls == ["GET /repos/o/r/pulls/7"]


def test_posting_needs_a_verified_trigger_the_kinds_and_a_repository(tmp_path):
    gh = FakeGitHub()
    for argv in (
        ["--repo", "o/r", "--kinds", "h200"],
        ["--repo", "o/r", "--run-title", TITLE, "--kinds", "h200"],
    ):
        with pytest.raises(SystemExit) as exc:  # a title alone is never believed for posting
            pvc.main(["--verdicts", str(tmp_path), *argv], client=gh)
        assert exc.value.code == 2
    trigger = tmp_path / "trigger.json"
    trigger.write_text(json.dumps({"number": 7, "head_sha": HEAD, "conclusion": "failure"}), encoding="utf-8")
    for argv in (
        ["--repo", "o/r/../x", "--kinds", "h200"],
        ["--repo", "o/r"],
        ["--repo", "o/r", "--kinds", "H 200"],
    ):
        with pytest.raises(SystemExit):
            pvc.main(["--verdicts", str(tmp_path), "--trigger", str(trigger), *argv], client=gh)
    assert gh.calls == []
    good = ["--verdicts", str(tmp_path), "--trigger", str(trigger), "--repo", "o/r", "--kinds", "h200"]
    assert pvc.main(good, client=gh) == 0
    written = [c for c in gh.calls if not c.startswith("GET")]
    assert written == ["POST /repos/o/r/check-runs", "POST /repos/o/r/issues/7/comments"]
    for facts in ({"number": 7, "head_sha": "x", "conclusion": "success"},
                  {"number": "7", "head_sha": HEAD, "conclusion": "success"},
                  {"number": 7, "head_sha": HEAD, "conclusion": "passed"}):  # fmt: skip
        trigger.write_text(json.dumps(facts), encoding="utf-8")
        with pytest.raises(SystemExit):
            pvc.main(good, client=gh)
    assert [c for c in gh.calls if not c.startswith("GET")] == written


def test_a_pass_artifact_of_a_failed_or_cancelled_run_is_never_a_success(tmp_path):
    passing = write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1]))
    for conclusion, expected in [("failure", "failure"), ("cancelled", "cancelled"), ("timed_out", "timed_out"),
                                 ("startup_failure", "failure"), ("success", "success")]:  # fmt: skip
        gh = FakeGitHub()
        post(passing, gh, conclusion)
        assert conclusions(gh) == [(HEAD, expected)], conclusion
        assert ("## GPU verdict: ✅" in gh.bodies()[0]) == (conclusion == "success")


def test_only_the_matrix_kinds_are_read_and_each_must_be_there(tmp_path):
    write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1]))
    write(tmp_path / "verdict-b200", verdict(rows=REGRESSED))  # not in the matrix: never read
    gh = FakeGitHub()
    post(tmp_path, gh, "success")
    assert conclusions(gh) == [(HEAD, "success")] and "b200" not in gh.bodies()[0]
    gh = FakeGitHub()
    post(tmp_path, gh, "success", kinds="h200,mi300")  # a matrix kind without its artifact
    assert conclusions(gh) == [(HEAD, "failure")]
    assert "**mi300**" in gh.bodies()[0] and "no verdict artifact for this GPU kind" in gh.bodies()[0]


def test_an_artifact_naming_another_pull_request_is_not_believed(tmp_path):
    pr = {"number": 8, "head_sha": HEAD}
    write(tmp_path / "verdict-h200", verdict("pass", rows=ROWS[:1]), pr=pr)
    gh = FakeGitHub()
    post(tmp_path, gh, "success")
    assert conclusions(gh) == [(HEAD, "failure")] and "another pull request" in gh.bodies()[0]


# ------------------------------------------------------------------------------------------------
# Links to the history of each flagged benchmark
# ------------------------------------------------------------------------------------------------

PAGES = "https://o.github.io/r/"
# The only history links there can be: the Pages URL, an asv benchmark of bench_rmsnorm, a shape.
HISTORY = re.compile(
    re.escape(PAGES)
    + r"#bench_rmsnorm\.(Forward|ForwardBackward)\.track_(median_ms|gpu_median_ms|host_median_ms|error_y|"
    r"error_dx|error_dw)\?p-shape='[0-9]+x[0-9]+-(float32|float16|bfloat16)'"
)


def history_links(body: str) -> list[str]:
    links = re.findall(r'<a href="([^"]*)"', html(body))
    others = [u for u in links if u != RUN_URL]
    assert all(HISTORY.fullmatch(html_module.unescape(u)) for u in others), others
    return [html_module.unescape(u) for u in others]


def test_each_flagged_row_links_its_benchmark_history_at_its_shape(tmp_path):
    rows = [*ROWS, {"check": "error dw 4096x4096-float32", "base": 1e-7, "head": 9e-6, "ratio": 90.0,
                    "threshold": 2e-6, "verdict": "regression", "kind": "numerics"}]  # fmt: skip
    body = dry(write(tmp_path / "verdict-h200", verdict(rows=rows)), "--run-title", TITLE, "--run-url", RUN_URL,
               "--pages-url", PAGES)  # fmt: skip
    attention = body.split("### h200: needs attention", 1)[1].split("<details>", 1)[0]
    assert attention.splitlines()[2].endswith("| verdict | history |")
    links = {
        line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1] for line in attention.splitlines()[4:] if line
    }
    assert links == {
        "error dw 4096x4096-float32": f"[history]({PAGES}#bench_rmsnorm.ForwardBackward.track_error_dw"
        "?p-shape='4096x4096-float32') |",
        "device 32768x4096-bfloat16 forward": f"[history]({PAGES}#bench_rmsnorm.Forward.track_gpu_median_ms"
        "?p-shape='32768x4096-bfloat16') |",
        "device 4096x4096-bfloat16 forward": f"[history]({PAGES}#bench_rmsnorm.Forward.track_gpu_median_ms"
        "?p-shape='4096x4096-bfloat16') |",
        "gpu tests &#40;head&#41;": "– |",  # no benchmark behind it
    }
    assert len(history_links(body)) == 3  # the passing rows, folded, link nowhere
    assert_inert(body, pages=True)
    plain_body = dry(write(tmp_path / "x" / "verdict-h200", verdict(rows=rows)), "--run-title", TITLE)
    assert "history" not in plain_body and "github.io" not in plain_body  # no Pages URL, no links


def test_history_url_maps_every_check_the_gate_writes():
    assert pvc.history_url("latency 1x4096-float16 forward_backward", PAGES) == (
        f"{PAGES}#bench_rmsnorm.ForwardBackward.track_median_ms?p-shape='1x4096-float16'"
    )
    assert pvc.history_url("host 128x257-float32 forward", PAGES) == (
        f"{PAGES}#bench_rmsnorm.Forward.track_host_median_ms?p-shape='128x257-float32'"
    )
    assert pvc.history_url("error y 8192x16384-bfloat16", PAGES).endswith(
        "Forward.track_error_y?p-shape='8192x16384-bfloat16'"
    )
    assert pvc.history_url("latency 1x4096-float16 forward", "") == ""


@pytest.mark.parametrize(
    "check",
    [
        "latency https://evil.example/x forward",
        "latency 4096x4096-bfloat16 forward https://evil.example",
        "latency 4096x4096-bfloat16/../../evil forward",
        "device 4096x4096-bfloat16:evil.example forward",
        "latency //evil.example forward",
        "error y 4096x4096-bfloat16 ",
        "error y 4096x4096-int8",
        "latency 4096x4096-bfloat16' onmouseover=x forward",
        "latency 4096x4096-bfloat16) (https://evil.example forward",
        "error __class__ 4096x4096-bfloat16",
        "latency 4096x4096-bfloat16 __init__",
    ],
)
def test_a_hostile_check_name_links_nowhere(tmp_path, check):
    assert pvc.history_url(check, PAGES) == ""
    if pvc.CHECK.fullmatch(check):  # a name the validation lets through: the comment links no history
        rows = [row(check, "regression", 1.5, note=EVIL)]
        body = dry(
            write(tmp_path / "verdict-h200", verdict(rows=rows)), "--run-title", TITLE, "--pages-url", PAGES
        )
        assert history_links(body) == [] and "evil.example" not in re.findall(r'href="([^"]*)"', html(body))
        assert_inert(body, pages=True)


def test_any_check_name_gives_no_link_or_one_of_the_history_form():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    words = st.sampled_from(["latency", "device", "error", "y", "dx", "forward", "forward_backward", "4096x4096-bfloat16",
                             "1x1-float32", "https://evil.example", "'", ")", "x", "", "#", "?p-shape="])  # fmt: skip

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(st.one_of(st.text(max_size=60), st.lists(words, max_size=5).map(" ".join)))
    def check(name):
        url = pvc.history_url(name, PAGES)
        assert url == "" or HISTORY.fullmatch(url), url

    check()


@pytest.mark.parametrize(
    "pages",
    [
        "https://evil.example/r/",
        "https://o.github.io.evil.example/r/",
        "https://evil.example/o.github.io/r/",
        "http://o.github.io/r/",
        "javascript:alert(1)//o.github.io/r/",
        "https://o.github.io/r",
        "https://o.github.io/../",
        "https://o.github.io/r/x/",
        "https://o.github.io/r/#x",
        "https://O.github.io/r/",
        "https://o.github.io/r/\n",
    ],
)
def test_a_pages_url_outside_the_pattern_is_refused(tmp_path, pages):
    write(tmp_path / "verdict-h200", verdict(rows=ROWS))
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--verdicts", str(tmp_path), "--dry-run", "--run-title", TITLE,
         "--pages-url", pages],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--pages-url must match" in bad.stderr and bad.stdout == ""


# ------------------------------------------------------------------------------------------------
# The drift tracking issue, against an in-memory GitHub
# ------------------------------------------------------------------------------------------------

DRIFT_SCRIPT = SCRIPT.parent / "drift_issue.py"
_dspec = importlib.util.spec_from_file_location("drift_issue", DRIFT_SCRIPT)
drift_issue = importlib.util.module_from_spec(_dspec)
_dspec.loader.exec_module(drift_issue)  # imports post_verdict_comment: the module loaded above

MAIN = "f" * 40
DRIFTED = [
    row("device 4096x4096-bfloat16 forward", "regression", 1.081, ci_low=1.062, ci_high=1.101, confidence=0.98),
    row("latency 4096x4096-bfloat16 forward"),
    row("latency 32768x4096-bfloat16 forward_backward", "regression", 1.12, ci_low=1.07, ci_high=1.18,
        confidence=0.98),
]  # fmt: skip


def drift_artifact(folder: Path, status="regression", rows=DRIFTED, baseline="v0.3.0", **extra) -> Path:
    write(folder, {**verdict(status, rows=rows, head_sha=MAIN), **extra})
    if baseline is not None:
        (folder / "drift.json").write_text(json.dumps({"baseline": baseline}), encoding="utf-8")
    return folder.parent


class FakeIssues:
    """The issue calls of drift_issue.py: list the open `perf-drift` issues, open, update, close."""

    def __init__(self, issues=()):
        self.issues, self.calls = [dict(i) for i in issues], []

    def request(self, method, path, payload=None):
        self.calls.append(f"{method} {path}")
        if method == "GET" and path.startswith("/repos/o/r/issues?labels=perf-drift&state=open&"):
            return [i for i in self.issues if i["state"] == "open" and "perf-drift" in i["labels"]]
        if method == "POST" and path == "/repos/o/r/issues":
            number = 100 + len(self.issues)
            self.issues.append({"number": number, "state": "open", "user": {"login": "github-actions[bot]"},
                                "title": payload["title"], "body": payload["body"], "labels": payload["labels"]})  # fmt: skip
            return self.issues[-1]
        if method == "PATCH" and (m := re.fullmatch(r"/repos/o/r/issues/(\d+)", path)):
            issue = next(i for i in self.issues if i["number"] == int(m[1]))
            issue.update(payload)
            return issue
        raise AssertionError(f"unexpected call {method} {path}")

    def writes(self):
        return [c for c in self.calls if not c.startswith("GET")]


def drift(folder: Path, client: FakeIssues, sha=MAIN) -> int:
    argv = ["--drift", str(folder), "--repo", "o/r", "--sha", sha, "--run-url", RUN_URL, "--pages-url", PAGES]
    return drift_issue.main(argv, client=client)


PLANTED = {"number": 3, "state": "open", "user": {"login": "mallory"}, "labels": ["perf-drift"],
           "title": "Performance drift of main", "body": "## Drift of main: ✅ gone"}  # fmt: skip


def test_drift_opens_one_issue_with_main_the_baseline_and_the_regressed_rows(tmp_path):
    gh = FakeIssues([PLANTED])
    assert drift(drift_artifact(tmp_path / "a" / "drift-h200"), gh) == 0
    assert gh.issues[0] == PLANTED  # another user's issue with the label is never touched
    ours = [i for i in gh.issues if i["user"]["login"] == "github-actions[bot]"]
    assert len(ours) == 1 and ours[0]["labels"] == ["perf-drift"]
    assert ours[0]["title"] == "Performance drift of main against v0.3.0"
    body = ours[0]["body"]
    assert f"main at `{MAIN[:12]}`" in body and f"baseline `v0.3.0` at `{BASE[:12]}`" in body
    assert (
        "## Drift of main: ❌ regression" in body
        and "2 regressed, 0 could not judge, 1 pass of 3 checks" in body
    )
    flagged = [line for line in body.splitlines() if "**regression**" in line]
    assert [line.split(" | ")[0] for line in flagged] == [
        "| latency 32768x4096-bfloat16 forward&#95;backward", "| device 4096x4096-bfloat16 forward"]  # fmt: skip
    assert "+12.0%" in flagged[0] and "98% CI +7.0% to +18.0%" in flagged[0]
    assert "+8.1%" in flagged[1] and "98% CI +6.2% to +10.1%" in flagged[1]
    assert "latency 4096x4096-bfloat16 forward |" not in body  # passing rows are in the artifact only
    assert len(history_links(body)) == 2
    assert_inert(body, pages=True)
    # the next push, still drifting: the same issue is updated, the planted one still ignored
    drift(drift_artifact(tmp_path / "b" / "drift-h200", rows=DRIFTED[:2]), gh)
    assert len(gh.issues) == 2 and gh.issues[0] == PLANTED and "1 regressed" in gh.issues[1]["body"]
    assert gh.writes()[-1] == "PATCH /repos/o/r/issues/101"
    # drift gone: the bot's issue is closed, saying where; the planted one stays open
    drift(drift_artifact(tmp_path / "c" / "drift-h200", "pass", rows=DRIFTED[1:2]), gh)
    assert gh.issues[1]["state"] == "closed" and "## Drift of main: ✅ gone" in gh.issues[1]["body"]
    assert f"`{MAIN[:12]}`" in gh.issues[1]["body"] and gh.issues[0] == PLANTED


def test_drift_on_one_kind_is_shown_even_where_another_could_not_be_judged(tmp_path):
    drift_artifact(tmp_path / "drift-h200")
    drift_artifact(tmp_path / "drift-b200", "error", rows=[{"check": "deadline", "verdict": "error", "kind": "run",
                                                             "note": "the deadline passed"}])  # fmt: skip
    gh = FakeIssues()
    drift(tmp_path, gh)
    body = gh.issues[0]["body"]
    assert "## Drift of main: ❌ regression" in body and "- **b200**: ⚠️ could not judge" in body
    assert "| deadline |" in body and "could not judge: the deadline passed" in body


def test_no_drift_and_no_issue_writes_nothing_and_a_planted_issue_is_not_closed(tmp_path):
    gh = FakeIssues([PLANTED])
    drift(drift_artifact(tmp_path / "drift-h200", "pass", rows=DRIFTED[1:2]), gh)
    assert gh.writes() == [] and gh.issues == [PLANTED]


@pytest.mark.parametrize(
    "spoil",
    [
        {"rows": [row("latency <img src=x> forward", "regression", 1.5)]},  # check name outside the pattern
        {"rows": [row("latency 4096x4096-bfloat16 forward", "regression", float("inf"))]},
        {"head_sha": OLD},  # a verdict about another commit than the run's
        {"base_sha": "abc` [x](https://evil.example) `"},
        {"status": "error", "rows": [DRIFTED[1], {"check": "deadline", "verdict": "error", "kind": "run"}]},
    ],
)
def test_a_drift_verdict_that_fails_validation_leaves_the_issue_as_it_is(tmp_path, spoil):
    ours = {**PLANTED, "number": 4, "user": {"login": "github-actions[bot]"}, "body": "earlier drift"}
    gh = FakeIssues([ours])
    folder = tmp_path / "drift-h200"
    folder.mkdir()
    (folder / "verdict.json").write_text(
        json.dumps({**verdict("regression", rows=DRIFTED, head_sha=MAIN), **spoil}), encoding="utf-8"
    )
    drift(tmp_path, gh)
    assert gh.writes() == [] and gh.issues == [ours]
    drift(tmp_path / "nothing-downloaded", gh)  # the drift job failed before its artifact
    assert gh.writes() == []


def test_hostile_notes_and_baseline_are_neutralised_in_the_issue(tmp_path):
    rows = [row("device 4096x4096-bfloat16 forward", "regression", 1.3, note=EVIL)]
    folder = drift_artifact(tmp_path / "drift-h200", rows=rows, baseline="v1` [x](https://evil.example) `")
    gh = FakeIssues()
    drift(folder, gh)
    body = gh.issues[0]["body"]
    assert "baseline: not recorded" in body and gh.issues[0]["title"].endswith("against the last release")
    assert "octocat" in body and "evil" in body  # shown as text
    assert_inert(body, pages=True)
    big = tmp_path / "big" / "drift-h200"
    drift_artifact(big)
    (big / "drift.json").write_bytes(b'{"baseline": "v1", "x": "' + b"a" * 5000 + b'"}')
    assert "baseline: not recorded" in drift_dry(big.parent)


def test_the_issue_stays_under_the_size_limit(tmp_path):
    many = [
        row(f"latency {i}x4096-bfloat16 forward", "regression", 1.2, note=EVIL) for i in range(pvc.MAX_ROWS)
    ]
    body = drift_dry(drift_artifact(tmp_path / "drift-h200", rows=many))
    assert len(body) <= pvc.MAX_BODY and pvc.CUT in body
    assert_inert(body, pages=True)


def drift_dry(folder: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(DRIFT_SCRIPT), "--drift", str(folder), "--sha", MAIN, "--dry-run", "--pages-url", PAGES],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_issue_script_runs_standalone_and_refuses_bad_arguments(tmp_path):
    body = drift_dry(drift_artifact(tmp_path / "drift-h200"))
    assert body.startswith(drift_issue.MARKER) and "baseline `v0.3.0`" in body
    for args in (["--sha", "main"], ["--sha", MAIN, "--pages-url", "https://evil.example/r/"]):
        bad = subprocess.run([sys.executable, str(DRIFT_SCRIPT), "--drift", str(tmp_path), "--dry-run", *args],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert bad.returncode == 2
    with pytest.raises(SystemExit):
        drift_issue.main(["--drift", str(tmp_path), "--sha", MAIN, "--repo", "o/r/../x"], client=FakeIssues())


def test_the_drift_issue_names_each_steps_commit_range_and_the_bisection(tmp_path):
    """Steps (changepoints' steps.json) and a bisection: each slowdown with its range, accepted
    ones marked, oldest first; a step with a forged commit or markup is left out or made inert."""
    a, b, c, d = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)
    step = {"series": "bench_rmsnorm.Forward.track_gpu_median_ms('32768x4096-bfloat16', 'kernel')",
            "index": 20, "commit_index": 20, "first_commit": b, "last_before": a, "ratio": 1.06,
            "direction": "slowdown", "accepted": ""}  # fmt: skip
    steps = [{**step, "index": 30, "commit_index": 30, "first_commit": d, "last_before": c,
              "accepted": "x1.08: two passes"}, step,
             {**step, "first_commit": "--all"}, {**step, "index": 5, "series": "[x](https://evil) @someone"}]  # fmt: skip
    folder = tmp_path / "steps"
    (folder / "changepoints").mkdir(parents=True)
    (folder / "changepoints" / "steps.json").write_text(json.dumps({"steps": steps}))
    (folder / "bisect-h200").mkdir()
    (folder / "bisect-h200" / "bisect.json").write_text(
        json.dumps({"good": a, "bad": b, "stopped": "narrowed", "first_bad": b, "probes": []})
    )
    gh = FakeIssues([])
    argv = ["--drift", str(drift_artifact(tmp_path / "a" / "drift-h200")), "--steps", str(folder),
            "--repo", "o/r", "--sha", MAIN, "--run-url", RUN_URL, "--pages-url", PAGES]  # fmt: skip
    assert drift_issue.main(argv, client=gh) == 0
    body = gh.issues[0]["body"]
    rows = [line for line in body.splitlines() if "track&#95;gpu&#95;median&#95;ms" in line or "evil" in line]
    assert len(rows) == 3 and f"`{c[:12]}`..`{d[:12]}`" in rows[2] and "accepted" in rows[2]
    assert f"`{a[:12]}`..`{b[:12]}`" in rows[0] and "+6.0%" in rows[0] and rows[0].endswith("| slowdown |")
    assert f"Bisection on h200 (`{a[:12]}`..`{b[:12]}`): narrowed, first bad commit `{b[:12]}`." in body
    assert_inert(body, pages=True)


def test_the_drift_issue_lists_steps_oldest_first_by_their_commit_in_the_history(tmp_path):
    """Steps arrive in any order (series by series, newest first, shuffled): the issue lists them by
    their commit's place in main's history (``commit_index``), oldest first, across series; where
    there are more than it shows, it keeps the newest and says how many older ones it left out."""
    rng = __import__("random").Random(7)
    names = ["Forward.track_gpu_median_ms('4096x4096-bfloat16', 'kernel')",
             "ForwardBackward.track_gpu_median_ms('32768x4096-bfloat16', 'kernel')"]  # fmt: skip
    # a series' own ``index`` says nothing of the order across series: here it runs against it
    steps = [{"series": names[i % 2], "index": (5 * i) % 7 + 3, "commit_index": 3 * i + 4,
              "first_commit": f"{i:02x}" * 20, "last_before": f"{i + 100:02x}" * 20, "ratio": 1.05,
              "direction": "slowdown", "accepted": ""} for i in range(14)]  # fmt: skip
    shuffled = steps[:]
    rng.shuffle(shuffled)
    assert shuffled != steps
    folder = tmp_path / "steps"
    (folder / "changepoints").mkdir(parents=True)
    (folder / "changepoints" / "steps.json").write_text(json.dumps({"steps": shuffled}))
    loaded, _ = drift_issue.load_steps(folder)
    assert [s["first"] for s in loaded] == [s["first_commit"] for s in steps]
    lines = drift_issue.steps_section(loaded, [])
    rows = [line for line in lines if "track&#95;gpu" in line]
    shown = steps[-drift_issue.MAX_STEPS_SHOWN :]
    assert [f"`{s['first_commit'][:12]}` |" in row for s, row in zip(shown, rows)] == [True] * len(shown)
    assert len(rows) == len(shown) and "| 4 older in the `changepoints` artifact | | | |" in lines
