"""`nox -s history`'s first step from a clone: the asv-results branch fetched when the remote has
it, and a clear "no results yet" (exit 1) when it has not or cannot be reached."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_suite import acceptedpage, history
from tests.suite._page_check import assert_every_graph_has_data


def git(cwd: Path, *args: str) -> str:
    env = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    return subprocess.run(["git", *env, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def remote(tmp_path) -> Path:
    """A bare repository with a main branch, as a clone's origin."""
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    (work / "README.md").write_text("project\n")
    git(work, "add", "README.md")
    git(work, "commit", "-q", "-m", "main")
    bare = tmp_path / "remote.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return bare


def push_results(remote: Path, tmp_path: Path) -> None:
    """An asv-results branch as CI keeps it: benchmarks.json and a machine folder at the top."""
    branch = tmp_path / "results-branch"
    branch.mkdir()
    git(branch, "init", "-q")
    git(branch, "checkout", "-q", "--orphan", history.RESULTS_BRANCH)
    (branch / "benchmarks.json").write_text(json.dumps({"version": 2}))
    (branch / "h200").mkdir()
    (branch / "h200" / "machine.json").write_text(json.dumps({"machine": "h200"}))
    git(branch, "add", "-A")
    git(branch, "commit", "-q", "-m", "asv results")
    git(branch, "push", "-q", str(remote), history.RESULTS_BRANCH)


def clone(remote: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(remote), str(dest))
    return dest


def test_a_clone_fetches_the_results_branch(remote, tmp_path):
    push_results(remote, tmp_path)
    root = clone(remote, tmp_path)
    said = []
    assert history.fetch_results(root, log=said.append) is True
    assert (root / ".asv/results/benchmarks.json").is_file()
    assert json.loads((root / ".asv/results/h200/machine.json").read_text()) == {"machine": "h200"}
    assert any("fetched origin/asv-results" in line for line in said), said


def test_no_results_branch_says_so_and_how_to_get_results(remote, tmp_path):
    root = clone(remote, tmp_path)
    said = []
    assert history.fetch_results(root, log=said.append) is False
    text = "\n".join(said)
    assert "origin has no asv-results branch" in text
    assert "there are no asv results yet" in text and "nox -s asv" in text


def test_unreachable_remote_uses_the_results_already_here(remote, tmp_path):
    root = clone(remote, tmp_path)
    git(root, "remote", "set-url", "origin", str(tmp_path / "gone.git"))
    said = []
    assert history.fetch_results(root, log=said.append) is False
    assert any("could not ask origin" in line for line in said), said
    (root / ".asv/results/h200").mkdir(parents=True)
    (root / ".asv/results/benchmarks.json").write_text("{}")
    assert history.fetch_results(root, log=said.append) is True


def test_localise_points_the_page_at_local_copies(tmp_path):
    site, js = tmp_path / "html", tmp_path / "js"
    site.mkdir()
    js.mkdir()
    (js / "jquery-3.3.1.min.js").write_text("/* jquery */")
    (site / "index.html").write_text(
        '<script src="https://cdn.example/jquery-3.3.1.min.js" integrity="sha384-x" crossorigin="anonymous"></script>\n'
        '<script src="https://cdn.example/other.js"></script>\n'
    )
    assert history.localise(site, js) == ["jquery-3.3.1.min.js"]
    assert (site / "vendor/jquery-3.3.1.min.js").read_text() == "/* jquery */"
    assert history.cdn_tags(site) == ["https://cdn.example/other.js"]
    assert 'src="vendor/jquery-3.3.1.min.js"' in (site / "index.html").read_text()
    assert history.localise(site, js) == []  # already localised: nothing left to change


def test_blank_graphs_are_found_and_graphs_with_data_are_not(tmp_path):
    """The page check's blank-results fixture: every value null fails it; one value passes."""
    from rmsnorm_suite.history import blank_graphs

    graphs = tmp_path / "graphs" / "branch-main" / "machine-h200"
    graphs.mkdir(parents=True)
    (graphs / "bench.Forward.track_median_ms.json").write_text(json.dumps([[1, None], [2, [None, None]]]))
    (graphs / "bench.Forward.track_min_ms.json").write_text(json.dumps([]))
    (graphs / "bench.Forward.track_max_ms.json").write_text(json.dumps([[1, None], [2, [None, 0.12]]]))
    (graphs / "bench.Backward.track_median_ms.json").write_text(json.dumps([[1, 0.5]]))
    assert blank_graphs(tmp_path) == [
        "graphs/branch-main/machine-h200/bench.Forward.track_median_ms.json",
        "graphs/branch-main/machine-h200/bench.Forward.track_min_ms.json",
    ]


def _publish_demo(tmp_path: Path, blank: bool) -> Path:
    """The demo page of `nox -s history -- --demo`, published into tmp_path (asv needed)."""
    pytest.importorskip("asv")
    root = Path(__file__).resolve().parents[2]
    config = history.write_demo(root, tmp_path / "demo", commits=4, blank=blank, log=lambda line: None)
    done = subprocess.run(
        [sys.executable, "-m", "asv", "--config", str(config), "publish"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return tmp_path / "demo" / "html"


def test_the_demo_page_has_data_in_every_graph_and_a_blank_one_fails_the_check(tmp_path):
    """`--demo`'s seeded figures fill every graph of the real benchmarks; the same page with every
    value None is what the page check (tests/suite/test_asv_page.py) must fail."""
    site = _publish_demo(tmp_path / "filled", blank=False)
    graphs = list((site / "graphs").rglob("*.json"))
    assert len(graphs) > 17, graphs  # one per benchmark at least, and the per-parameter ones
    assert history.blank_graphs(site) == []
    assert_every_graph_has_data(site)  # the page check passes on the demo page

    blank = _publish_demo(tmp_path / "blank", blank=True)
    assert sorted(history.blank_graphs(blank)), "a page of None values has blank graphs"
    with pytest.raises(AssertionError, match="have no data point"):
        assert_every_graph_has_data(blank)


def test_the_demo_figures_are_seeded_and_plausible():
    """The same seed, the same figures; a time grows with the shape; errors follow the dtype."""
    import random

    def figures(seed):
        rng = random.Random(seed)
        names = ("bench_rmsnorm.Forward.track_median_ms", "bench_rmsnorm.Forward.track_error_y")
        shapes = ("4096x4096-bfloat16", "32768x4096-bfloat16", "4096x4096-float32")
        return [history._demo_value(rng, n, s, "kernel", False) for n in names for s in shapes]

    assert figures(46) == figures(46) and figures(46) != figures(47)
    small, large, _, bf16_error, _, fp32_error = figures(46)
    assert 0 < small < large and fp32_error < bf16_error


def _asv_site(tmp_path: Path) -> Path:
    """A published page's folder holding asv's own index.html (its navigation bar), nothing else."""
    asv = pytest.importorskip("asv")
    site = tmp_path / "html"
    site.mkdir()
    (site / "index.html").write_bytes((Path(asv.__file__).parent / "www" / "index.html").read_bytes())
    return site


def _verdict(check: str, factor: float, reason: str, who: str) -> dict:
    grant = {"check": check, "factor": factor, "reason": reason, "approved_by": who}
    return {"rows": [{"check": check, "verdict": "accepted"}], "acceptance": {"granted": [grant]}}


def test_the_page_lists_the_accepted_rows_newest_first_and_links_them(tmp_path):
    """Two merged pull requests' accepted rows, recorded as the publish job records them, are on
    accepted.html newest first (commit, pull request, row, factor, approver, reason), linked once."""
    site, results = _asv_site(tmp_path), tmp_path / "results"
    ledger = results / "accepted.json"
    old, new = "1" * 40, "2" * 40
    for commit, pull, verdict in (
        (old, 3, _verdict("device 4096x4096-bfloat16 forward", 1.08, "fused the epilogue", "alice")),
        (new, 5, _verdict("device 32768x4096-float16 backward", 1.15, "two-pass dw", "bob")),
    ):
        (tmp_path / f"v{pull}.json").write_text(json.dumps(verdict))
        history.record_accepted(ledger, [tmp_path / f"v{pull}.json"], commit, pull=pull)
    argv = ["--site", str(site), "--ledger", str(ledger)]
    assert acceptedpage.main(argv) == 0 and acceptedpage.main(argv) == 0  # a second run links it once
    page = (site / "accepted.html").read_text()
    rows = [re.findall(r"<td>([^<]*)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", page)[1:]]
    assert rows == [
        [new, "#5", "device 32768x4096-float16 backward", "x1.15", "bob", "two-pass dw"],
        [old, "#3", "device 4096x4096-bfloat16 forward", "x1.08", "alice", "fused the epilogue"],
    ]
    index = (site / "index.html").read_text()
    assert index.count('href="accepted.html"') == 1
    assert index.index('id="nav-li-regressions"') < index.index('id="nav-li-accepted"')


def test_a_hostile_reason_is_inert_on_the_page(tmp_path):
    """accepted.json's strings come from a pull request (the reason) and are escaped, whatever
    wrote the file: no tag, attribute or script of theirs reaches the page."""
    site, ledger = _asv_site(tmp_path), tmp_path / "accepted.json"
    reason = "</td><script>alert(\"x\")</script><img src=x onerror='alert(1)'>"
    row = {"commit": "3" * 40, "check": 'device <b>1x1</b> "forward"', "factor": 1.1, "reason": reason,
           "approved_by": "<i>m</i>", "pull": "<script>"}  # fmt: skip
    ledger.write_text(json.dumps({"accepted": [row]}))
    assert acceptedpage.write(site, ledger) == 1
    page = (site / "accepted.html").read_text()
    assert "<script" not in page.lower() and "<img" not in page and "<b>" not in page and "<i>" not in page
    assert "&lt;/td&gt;&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "onerror=&#x27;alert(1)&#x27;" in page and "#&lt;script&gt;" in page
    assert page.count("<td>") == 6  # the row's six cells, none closed early by the reason
    assert "default-src 'none'" in page  # and the browser runs no script there regardless


@pytest.mark.parametrize("ledger", [None, "", '{"accepted": []}', "{", '{"accepted": 3}'])
def test_no_accepted_rows_says_none(tmp_path, ledger):
    """An absent, empty or odd accepted.json: the page says none were accepted; one that does not
    read (not JSON), that it could not be read."""
    site, path = _asv_site(tmp_path), tmp_path / "accepted.json"
    if ledger is not None:
        path.write_text(ledger)
    assert acceptedpage.write(site, path) == 0
    page = (site / "accepted.html").read_text()
    said = "None listed: accepted.json could not be read." if ledger == "{" else "None: no regression"
    assert said in page and "<td>" not in page
    assert 'href="accepted.html"' in (site / "index.html").read_text()


def _record(tmp_path: Path, verdict: dict) -> tuple[int, list]:
    """record-accepted as the publish job runs it, on one verdict-h200/verdict.json."""
    head = "a" * 40
    (tmp_path / "v" / "verdict-h200").mkdir(parents=True, exist_ok=True)
    (tmp_path / "v" / "verdict-h200" / "verdict.json").write_text(json.dumps({**verdict, "head_sha": head}))
    ledger = tmp_path / "accepted.json"
    argv = ["record-accepted", "--verdicts", str(tmp_path / "v"), "--commit", "c" * 40, "--head", head]
    status = history.main([*argv, "--pull", "7", "--into", str(ledger)])
    return status, json.loads(ledger.read_text())["accepted"] if ledger.is_file() else []


def test_a_huge_integer_factor_neither_stops_the_publish_job_nor_the_page(tmp_path):
    """A verdict is the pull request run's artifact: a factor written as a 400-digit integer made
    math.isfinite raise OverflowError, which stopped record-accepted and so the publish job. It is
    passed over; a ledger row with one gives an empty factor cell."""
    assert _record(tmp_path, _verdict("device 1x1-a forward", 10**400, "r", "m")) == (0, [])
    site, ledger = _asv_site(tmp_path), tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"accepted": [{"commit": "3" * 40, "check": "c", "factor": 10**400}]}))
    assert acceptedpage.write(site, ledger) == 1


@pytest.mark.parametrize(
    "check",
    ["::add-mask::x device forward", "device " + "1" * 1000 + "x1-a forward", "device 1x1-a forward;rm"],
)
def test_a_recorded_check_is_a_check_name(tmp_path, check):
    """record-accepted prints each check at the start of a log line (after spaces, which the
    runner skips: a workflow command), and check_asv_results.py refuses a string over 1000
    characters in accepted.json (the publish job fails). Only a check name as the comment's
    validator allows it (post_verdict_comment.CHECK) is recorded."""
    assert _record(tmp_path, _verdict(check, 1.1, "r", "m")) == (0, [])
    assert _record(tmp_path, _verdict("device 1x1-a forward", 1.1, "r", "m"))[1][0]["check"] == (
        "device 1x1-a forward"
    )


def test_a_verdict_records_no_more_than_the_gate_grants(tmp_path):
    """The trusted [accept] table (regression.toml) grants at most max_rows rows up to max_factor:
    a verdict listing more (thousands of rows would grow accepted.json towards the 20 MB that
    check_asv_results.py refuses, failing every later publish), or a larger factor, is not believed
    past that bound."""
    import tomllib

    bound = tomllib.loads((Path(history.__file__).parent / "regression.toml").read_text())["accept"]
    rows = [{"check": f"device {n}x1-a forward", "verdict": "accepted"} for n in range(1, 200)]
    grants = [{"check": r["check"], "factor": 1.1, "reason": "r" * 200, "approved_by": "m"} for r in rows]
    _, added = _record(tmp_path, {"rows": rows, "acceptance": {"granted": grants}})
    assert len(added) == bound["max_rows"]
    (tmp_path / "accepted.json").unlink()
    over = _verdict("device 1x1-a forward", bound["max_factor"] + 1, "r", "m")
    assert _record(tmp_path, over) == (0, [])
