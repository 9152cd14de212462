"""Tags and the history page: only release tags reach ``asv publish``, and drift's baseline is the
release on the newest first-parent commit (src/rmsnorm_suite/history.py, ``tags`` and ``baseline``).

The page test publishes a real asv site from a small repository carrying the tag
``v1<img/src='x'/onerror=...>`` (git refuses spaces in a ref name, so ``/`` separates the
attributes, which HTML accepts) and opens, in headless Chromium, asv's own sink for tag names
(graphdisplay.js appends ``"<div ...>" + tag + "</div>"`` as HTML) fed with the site's
``index.json``. Without the filter the image is created and its handler runs; with it, neither.
Skipped with the reason where Chromium or asv is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rmsnorm_suite.history import RELEASE_TAG, drop_tags, release_baseline

EVIL = "v1<img/src='x'/onerror=document.title='pwned'>"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
ASV = shutil.which("asv") or str(Path(sys.executable).parent / "asv")


def git(cwd: Path, *args: str, env: dict | None = None) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "init.defaultBranch=main"]
    done = subprocess.run(
        ["git", *ident, *args], cwd=cwd, capture_output=True, text=True, check=True, env=env
    )
    return done.stdout.strip()


def commit(repo: Path, message: str, when: int) -> str:
    env = {
        "GIT_AUTHOR_DATE": f"@{when} +0000",
        "GIT_COMMITTER_DATE": f"@{when} +0000",
        "PATH": "/usr/bin:/bin",
    }
    git(repo, "commit", "--allow-empty", "-qm", message, env=env)
    return git(repo, "rev-parse", "HEAD")


def tag(repo: Path, name: str, rev: str, when: int) -> None:
    env = {"GIT_COMMITTER_DATE": f"@{when} +0000", "PATH": "/usr/bin:/bin"}
    git(repo, "tag", "-a", name, "-m", name, rev, env=env)


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    return root


def test_the_release_pattern():
    # the tag as first reported, with spaces, is not even a ref name; EVIL is its git-valid form
    spaced = subprocess.run(["git", "check-ref-format", "refs/tags/v1<img src=x onerror=alert(1)>"])
    assert spaced.returncode != 0
    assert subprocess.run(["git", "check-ref-format", f"refs/tags/{EVIL}"]).returncode == 0
    for name in ("v1", "v0.3.0", "v12.0.1.4"):
        assert RELEASE_TAG.fullmatch(name)
    for name in (EVIL, "v1.", "v1.0-rc1", "1.0", "V1.0", "v1..0", "v1.0\n", "release"):
        assert not RELEASE_TAG.fullmatch(name)


def test_tags_that_are_not_releases_are_dropped(repo):
    head = commit(repo, "one", 1_000)
    for name in ("v0.1.0", "v1", EVIL, "-d", "nightly"):
        git(repo, "tag", name, head) if name != "-d" else git(repo, "update-ref", "refs/tags/-d", head)
    assert sorted(drop_tags(repo)) == sorted([EVIL, "-d", "nightly"])
    assert git(repo, "tag", "-l").split() == ["v0.1.0", "v1"]


def test_the_tags_step_deletes_nothing_outside_ci_unless_forced(repo):
    head = commit(repo, "one", 1_000)
    git(repo, "tag", "nightly", head)
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_ACTIONS"}
    step = [sys.executable, "-m", "rmsnorm_suite.history", "tags"]
    refused = subprocess.run(step, cwd=repo, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and git(repo, "tag", "-l") == "nightly"
    done = subprocess.run([*step, "--force"], cwd=repo, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "dropped 1 tags" in done.stdout and git(repo, "tag", "-l") == ""


def test_the_baseline_is_the_newest_release_on_first_parent_history(repo):
    first = commit(repo, "one", 1_000)
    second = commit(repo, "two", 2_000)
    tag(repo, "v0.1.0", first, 1_500)
    tag(repo, "v0.2.0", second, 2_500)
    assert release_baseline(repo) == "v0.2.0"
    tag(repo, "v9.9.9", first, 9_000)  # a writer tags an old commit, later: the baseline stays
    assert release_baseline(repo) == "v0.2.0"
    tag(repo, "v0.2.1", second, 3_000)  # two releases of one commit: the newer one
    assert release_baseline(repo) == "v0.2.1"
    git(repo, "tag", "v1<x>", commit(repo, "three", 4_000))  # not a release: never a baseline
    assert release_baseline(repo) == "v0.2.1"
    # a release on a side branch merged into main is not on the first-parent history
    git(repo, "switch", "-qc", "side", first)
    side = commit(repo, "side", 5_000)
    tag(repo, "v5.0.0", side, 5_500)
    git(repo, "switch", "-q", "main")
    git(repo, "merge", "-q", "--no-ff", "-m", "merge", "side")
    assert release_baseline(repo) == "v0.2.1"


def test_no_release_no_baseline(repo):
    commit(repo, "one", 1_000)
    assert release_baseline(repo) == ""
    done = subprocess.run([sys.executable, "-m", "rmsnorm_suite.history", "baseline"], cwd=repo,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and done.stdout.strip() == ""


def publish(repo: Path) -> dict:
    """A real ``asv publish`` of one stored result at HEAD; the site's tags."""
    (repo / "asv.conf.json").write_text(json.dumps({
        "version": 1, "project": "p", "repo": ".", "dvcs": "git", "branches": ["main"],
        "environment_type": "existing", "benchmark_dir": "benchmarks", "results_dir": "results",
        "html_dir": "html"}))  # fmt: skip
    head = git(repo, "rev-parse", "HEAD")
    machine = repo / "results" / "m"
    machine.mkdir(parents=True, exist_ok=True)
    (repo / "results" / "benchmarks.json").write_text(json.dumps({"bench.track_x": {
        "code": "def track_x():\n    return 1.0", "name": "bench.track_x", "param_names": [], "params": [],
        "type": "track", "unit": "unit", "version": "1"}, "version": 2}))  # fmt: skip
    (machine / "machine.json").write_text(json.dumps({"machine": "m", "version": 1}))
    (machine / f"{head[:8]}-existing-py.json").write_text(json.dumps({
        "commit_hash": head, "env_name": "existing-py", "date": 1_000_000, "params": {"machine": "m"},
        "python": "3", "requirements": {}, "env_vars": {}, "result_columns": ["result", "params", "version"],
        "results": {"bench.track_x": [[1.0], [], "1"]}, "durations": {}, "version": 2}))  # fmt: skip
    done = subprocess.run([ASV, "publish"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((repo / "html" / "index.json").read_text())["tags"]


def sink_dom(tags: dict, tmp_path: Path) -> str:
    """asv's tag sink (graphdisplay.js, update_tags) run in Chromium on ``tags``; the DOM after."""
    page = tmp_path / "tags.html"
    script = (
        "var tags = " + json.dumps(tags) + ";"
        "for (var tag in tags) { document.getElementById('graph').insertAdjacentHTML('beforeend',"
        " \"<div class='asv-tag' style='position:absolute'>\" + tag + '</div>'); }"
    )
    page.write_text(f"<!doctype html><title>clean</title><div id=graph></div><script>{script}</script>")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--virtual-time-budget=3000", "--dump-dom"]  # fmt: skip
    done = subprocess.run([CHROMIUM, *flags, page.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")
@pytest.mark.skipif(shutil.which("asv") is None and not Path(ASV).exists(), reason="needs asv")
def test_a_hostile_tag_never_reaches_the_page(repo, tmp_path):
    tag(repo, "v0.1.0", commit(repo, "one", 1_000), 1_500)
    git(repo, "tag", EVIL)
    unfiltered = publish(repo)
    assert EVIL in unfiltered  # asv publishes any tag name as it is
    dom = sink_dom(unfiltered, tmp_path)
    assert "<title>pwned</title>" in dom and "<img" in dom  # the sink is live: the handler ran

    drop_tags(repo)  # what history.yml's publish job does before `nox -s history`
    shutil.rmtree(repo / "html")
    tags = publish(repo)
    assert list(tags) == ["v0.1.0"]
    dom = sink_dom(tags, tmp_path)
    assert "<title>clean</title>" in dom and "<img" not in dom and "v0.1.0" in dom


def test_accepted_regressions_are_read_from_first_parent_history(tmp_path):
    """A squashed PR's trailer and a merged PR's trailer are recorded at the first-parent commit
    that brought them; a malformed trailer and a quoted one are not."""
    from rmsnorm_suite import history

    repo = tmp_path / "repo"
    repo.mkdir()
    g = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]

    def git(*args):
        return subprocess.run(
            [*g, *args], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "start")
    trailer = "Accept-Regression: device 32768x4096-bfloat16 forward 1.08 two passes"
    git("commit", "-q", "--allow-empty", "-m", f"squashed PR\n\n{trailer}")
    squashed = git("rev-parse", "HEAD")
    git("switch", "-q", "-c", "pr")
    git(
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "pr work\n\nAccept-Regression: host 4096x4096-bfloat16 forward 1.2 why",
    )
    git("commit", "-q", "--allow-empty", "-m", "bad\n\nAccept-Regression: device nonsense")
    git("switch", "-q", "main")
    git("commit", "-q", "--allow-empty", "-m", f"quoted, not a trailer: {trailer}")
    git("merge", "-q", "--no-ff", "pr", "-m", "merge pr")
    merge = git("rev-parse", "HEAD")
    got = history.accepted_regressions(repo)
    assert [(r["commit"], r["check"], r["factor"]) for r in got] == [
        (squashed, "device 32768x4096-bfloat16 forward", 1.08),
        (merge, "host 4096x4096-bfloat16 forward", 1.2),
    ]
    assert got[1]["source"] != merge and got[0]["reason"] == "two passes"
