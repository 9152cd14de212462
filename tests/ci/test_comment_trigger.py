"""The comment job believes a run only as the API describes it (.github/scripts/verify_trigger.py):
a run of another workflow file, event, repository or definition, or for a pull request into
another branch, is refused before any token is minted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / ".github" / "scripts"
if not (
    SCRIPTS / "verify_trigger.py"
).is_file():  # a checkout without it (the judge stages the tests alone for `-m gpu`)
    pytest.skip(".github/scripts/verify_trigger.py is not in this checkout", allow_module_level=True)
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
_spec = importlib.util.spec_from_file_location("verify_trigger", SCRIPTS / "verify_trigger.py")
vt = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = vt
_spec.loader.exec_module(vt)

HEAD, MAIN, BRANCH = "a" * 40, "c" * 40, "d" * 40
RUN = {
    "id": 42,
    "path": ".github/workflows/gpu.yml",
    "event": "pull_request_target",
    "repository": {"full_name": "o/r"},
    "status": "completed",
    "conclusion": "success",
    "head_sha": MAIN,
    "display_title": f"GPU verdict #7 at {HEAD}",
    "html_url": "https://github.com/o/r/actions/runs/42",
    "pull_requests": [],
}


class FakeAPI:
    """GET-only: run 42, the repository (default branch main), compare and PR #7 into ``base``."""

    def __init__(self, base="main", **run):
        self.run, self.base, self.calls = {**RUN, **run}, base, []

    def request(self, method, path, payload=None):
        assert method == "GET", "verification only reads"
        self.calls.append(path)
        if path == "/repos/o/r/actions/runs/42":
            return self.run
        if path == "/repos/o/r":
            return {"default_branch": "main"}
        if path.startswith("/repos/o/r/compare/"):
            # main's history holds MAIN; BRANCH is a writer's branch off it
            return {"status": "identical" if path.split("/")[-1].startswith(f"{MAIN}...") else "diverged"}
        if path == "/repos/o/r/pulls/7":
            return {
                "number": 7,
                "base": {"ref": self.base, "repo": {"full_name": "o/r"}},
                "head": {"sha": HEAD},
            }
        raise AssertionError(path)


def test_a_run_of_gpu_yml_from_main_is_believed_with_the_pr_from_its_title(tmp_path):
    out = tmp_path / "trigger.json"
    assert vt.main(["--repo", "o/r", "--run-id", "42", "--out", str(out)], client=FakeAPI()) == 0
    assert json.loads(out.read_text()) == {
        "run_id": 42, "number": 7, "head_sha": HEAD, "conclusion": "success",
        "url": "https://github.com/o/r/actions/runs/42"}  # fmt: skip


@pytest.mark.parametrize(
    "spoof, why",
    [
        ({"path": ".github/workflows/evil.yml"}, "not .github/workflows/gpu.yml"),  # a writer's "GPU verdict"
        ({"path": ".github/workflows/gpu.yml.bak"}, "not .github/workflows/gpu.yml"),
        ({"event": "push"}, "not pull_request_target"),
        ({"event": "pull_request"}, "not pull_request_target"),
        ({"repository": {"full_name": "fork/r"}}, "another repository"),
        ({"status": "in_progress", "conclusion": None}, "not completed"),
        ({"head_sha": BRANCH}, "not on main's history"),  # gpu.yml as a writer's branch has it
        ({"display_title": "GPU verdict #8"}, "not 'GPU verdict #N at SHA'"),
        ({"display_title": f"GPU verdict #7 at {HEAD} "}, "not 'GPU verdict #N at SHA'"),
        ({"pull_requests": [{"number": 9, "head": {"sha": HEAD}}]}, "do not include #7"),
        ({"pull_requests": [{"number": 7, "head": {"sha": BRANCH}}]}, "another head"),
        ({"id": 41}, "another run"),
    ],
)
def test_a_spoofed_run_is_refused_and_nothing_is_written(tmp_path, spoof, why, capsys):
    out = tmp_path / "trigger.json"
    assert vt.main(["--repo", "o/r", "--run-id", "42", "--out", str(out)], client=FakeAPI(**spoof)) == 1
    assert not out.exists() and why in capsys.readouterr().out


def test_a_pull_request_into_another_branch_is_refused(tmp_path, capsys):
    out = tmp_path / "trigger.json"
    assert vt.main(["--repo", "o/r", "--run-id", "42", "--out", str(out)], client=FakeAPI(base="evil")) == 1
    assert not out.exists() and "not a pull request into main" in capsys.readouterr().out


def test_every_failed_conclusion_is_passed_on_as_it_is(tmp_path):
    for conclusion in ("failure", "cancelled", "timed_out", "startup_failure"):
        out = tmp_path / f"{conclusion}.json"
        api = FakeAPI(conclusion=conclusion)
        assert vt.main(["--repo", "o/r", "--run-id", "42", "--out", str(out)], client=api) == 0
        assert json.loads(out.read_text())["conclusion"] == conclusion


def test_bad_arguments_are_refused():
    for argv in (["--repo", "o/r/x", "--run-id", "42"], ["--repo", "o/r", "--run-id", "4 2"]):
        with pytest.raises(SystemExit):
            vt.main([*argv, "--out", "x.json"], client=FakeAPI())


_mspec = importlib.util.spec_from_file_location("merged_verdict", SCRIPTS / "merged_verdict.py")
mv = importlib.util.module_from_spec(_mspec)
_mspec.loader.exec_module(mv)  # imports verify_trigger: the module loaded above
MERGE = "e" * 40


class MergedAPI(FakeAPI):
    """FakeAPI, and: commit MERGE merged PR #7 (head HEAD) into ``merged_into``; gpu.yml's successful
    runs are ``runs`` (run 42 among them, as FakeAPI describes it)."""

    def __init__(self, runs, merged_into="main", pull=None, **run):
        super().__init__(**run)
        self.runs, self.merged_into, self.pull = runs, merged_into, pull or {}

    def request(self, method, path, payload=None):
        if path == f"/repos/o/r/commits/{MERGE}/pulls":
            self.calls.append(path)
            return [{"number": 7, "merged_at": "2026-12-04T00:00:00Z", "merge_commit_sha": MERGE,
                     "base": {"ref": self.merged_into, "repo": {"full_name": "o/r"}}, "head": {"sha": HEAD},
                     **self.pull}]  # fmt: skip
        if path.startswith(
            "/repos/o/r/actions/workflows/gpu.yml/runs?event=pull_request_target&status=success"
        ):
            self.calls.append(path)
            return {"workflow_runs": self.runs}
        if path.startswith("/repos/o/r/actions/runs/") and path != "/repos/o/r/actions/runs/42":
            self.calls.append(path)
            return {**self.run, "id": int(path.rsplit("/", 1)[1]), "path": ".github/workflows/evil.yml"}
        return super().request(method, path, payload)


def test_the_merged_pull_requests_verdict_run_is_found_and_verified(tmp_path, monkeypatch):
    """Push MERGE merged PR #7: its verdict is run 42, the newest successful gpu.yml run titled for
    #7 at its last head that verifies; a newer run of another file with that title, a run for an
    older head, or a push that merged nothing into main gives none."""
    out = tmp_path / "output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    title = f"GPU verdict #7 at {HEAD}"
    runs = [{"id": 40, "display_title": f"GPU verdict #7 at {'b' * 40}"}, {"id": 42, "display_title": title},
            {"id": 50, "display_title": title}]  # fmt: skip
    api = MergedAPI(runs)
    assert mv.main(["--repo", "o/r", "--sha", MERGE], client=api) == 0
    assert out.read_text() == f"run-id=42\npull=7\nhead={HEAD}\n"
    assert "/repos/o/r/actions/runs/50" in api.calls and "/repos/o/r/actions/runs/40" not in api.calls
    out.unlink()
    for api in (
        MergedAPI(runs[:1]),
        MergedAPI(runs, merged_into="release"),
        MergedAPI(runs[1:], conclusion="failure"),
        # the push's commit is in a pull request that was not merged, or merged as another commit
        # (an open pull request built on it), or into another repository's branch of that name
        MergedAPI(runs, pull={"merged_at": None}),
        MergedAPI(runs, pull={"merge_commit_sha": "f" * 40}),
        MergedAPI(runs, pull={"base": {"ref": "main", "repo": {"full_name": "fork/r"}}}),
        MergedAPI(runs, pull={"head": {"sha": "--all"}}),
    ):
        assert mv.main(["--repo", "o/r", "--sha", MERGE], client=api) == 0
        assert not out.exists()
    with pytest.raises(SystemExit):
        mv.main(["--repo", "o/r", "--sha", "main"], client=MergedAPI(runs))
