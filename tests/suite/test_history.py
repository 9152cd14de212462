"""`nox -s history`'s first step from a clone: the asv-results branch fetched when the remote has
it, and a clear "no results yet" (exit 1) when it has not or cannot be reached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_suite import history
from tests.suite._fixtures import assert_every_graph_has_data


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
