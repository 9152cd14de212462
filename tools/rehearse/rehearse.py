"""The PR flow rehearsed offline with act: gpu.yml on a pull request, then pr-comment.yml on its run;
and history.yml's merged-verdict, publish, push, deploy, changepoints and bisect jobs on a push
to main with a synthetic, seeded history.

``Rehearsal`` builds GitHub's side locally: a bare repository holding this tree as ``main`` and
the pull requests' heads as ``refs/pull/N/head``; the fake API (fake_github.py); and, for act,
a folder whose workflows are this tree's (with the one key act's schema refuses, ``queue``,
removed). Each ``uses:`` is mapped to its stand-in (standins.py) with ``--local-repository``,
every job runs in act's host mode (``-P LABEL=-self-hosted``), and ``python3 -m nox`` is the stub
under stubs/. act does not chain runs, so the rehearsal does what GitHub does between them:
it records the GPU run (its workflow path, event, commit, evaluated title and conclusion) in the
fake API and sends pr-comment.yml the ``workflow_run`` event. For history.yml it keeps the six
rehearsed jobs (``needs`` on the others dropped), records the merged pull request and its verdict
run, pushes the results branch and two tags and gives the run the benchmark job's results artifact.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from fake_github import ACTIONS_APP_ID, Actor, State, serve  # noqa: E402

REPO = "rehearse/rmsnorm-kernel"
APP_ID, APP_SLUG, APP_KEY = 4242, "rmsnorm-verdict", "rehearsal-private-key"
JOB_TOKEN, WRITER_TOKEN = "ghs_job_token", "ghp_writer_token"
LABELS = {"h200-untrusted", "h200-trusted", "ubuntu-latest"}  # every runs-on of the rehearsed workflows
# history.yml's rehearsed jobs and their needs among them (the others' jobs are left out)
HISTORY_JOBS = {"merged-verdict": None, "publish": ["merged-verdict"], "push": ["publish"],
                "deploy": ["publish"], "changepoints": ["publish"], "bisect": ["changepoints"]}  # fmt: skip
MERGED_PULL, MERGED_CHECK = 9, "device 32768x4096-bfloat16 forward"  # the merged PR, its accepted row
# The synthetic history's two series (asv's names), the commit of each one's +8% step, and, for
# the second, the commits with no results (its step's range then holds four commits to bisect).
SERIES = ("bench_rmsnorm.Forward.track_gpu_median_ms", "bench_rmsnorm.ForwardBackward.track_gpu_median_ms")
PARAMS = [["'32768x4096-bfloat16'"], ["'kernel'"]]
ACCEPTED_STEP, BISECTED_STEP, NO_RESULTS, FIRST_BAD = 8, 18, (15, 16, 17), 16
# Tags on main (commit index: name): publish's tags step keeps the release, drops the other.
TAGS = {2: "v0.1.0", 5: "nightly-2026-01-01"}
# what asv publish reads of a results file beside the figures (changepoints reads the figures only)
ASV_RUN = {"params": {"machine": "h200", "python": "3.12"}, "requirements": {}, "python": "3.12",
           "env_name": "existing-py_python3"}  # fmt: skip
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # tarfile's filter, where it has it
IDENT = [
    "-c",
    "user.name=rehearsal",
    "-c",
    "user.email=rehearsal@example.invalid",
    "-c",
    "init.defaultBranch=main",
]


def act_binary() -> str | None:
    return shutil.which("act") or next(
        (str(p) for p in [Path(sys.executable).parent / "act"] if p.exists()), None
    )


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *IDENT, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def tree_files(root: Path) -> list[str]:
    """The tree as a fresh clone would have it, with what is not committed yet."""
    out = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=root)
    return [f for f in out.split("\0") if f and (root / f).is_file()]


class Rehearsal:
    def __init__(self, tmp: Path, source: Path = ROOT) -> None:
        self.tmp, self.act = tmp, act_binary()
        self.origin = tmp / "origin.git"
        self.work = tmp / "work"
        self.state = State(REPO, self.origin, APP_ID, APP_SLUG, APP_KEY)
        self.state.tokens.update({JOB_TOKEN: Actor("github-actions[bot]", ACTIONS_APP_ID),
                                  APP_KEY: Actor("app-jwt"), WRITER_TOKEN: Actor("mallory")})  # fmt: skip
        self.server, self.api = serve(self.state)
        self.runs = 100
        git("init", "-q", "--bare", str(self.origin), cwd=tmp)
        self.work.mkdir()
        git("init", "-q", cwd=self.work)
        for name in tree_files(source):
            (self.work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, self.work / name)
        git("add", "-A", cwd=self.work)
        git("commit", "-qm", "main as this tree has it", cwd=self.work)
        git("push", "-q", str(self.origin), "HEAD:refs/heads/main", cwd=self.work)
        self.main = git("rev-parse", "HEAD", cwd=self.work)
        self.actdir = self.act_folder(source)

    def close(self) -> None:
        self.server.shutdown()

    # GitHub's side ---------------------------------------------------------------------------

    def pull_request(self, number: int, mode: str, files: dict[str, str] | None = None) -> str:
        """Open PR ``number`` into main whose head asks the nox stub for ``mode``; its head SHA."""
        git("switch", "-q", "-C", f"pr-{number}", self.main, cwd=self.work)
        (self.work / "REHEARSE").write_text(mode + "\n")
        for name, text in (files or {}).items():
            (self.work / name).parent.mkdir(parents=True, exist_ok=True)
            (self.work / name).write_text(text)
        git("add", "-A", cwd=self.work)
        git("commit", "-qm", f"pull request {number}: {mode}", cwd=self.work)
        head = git("rev-parse", "HEAD", cwd=self.work)
        git("push", "-q", str(self.origin), f"HEAD:refs/pull/{number}/head", f"HEAD:refs/heads/pr-{number}",
            cwd=self.work)  # fmt: skip
        git("switch", "-q", "--detach", self.main, cwd=self.work)
        self.state.pulls[number] = {
            "number": number, "state": "open",
            "head": {"sha": head, "ref": f"pr-{number}", "repo": {"full_name": REPO}},
            "base": {"sha": self.main, "ref": "main", "repo": {"full_name": REPO}},
        }  # fmt: skip
        return head

    def record_run(self, path: str, event: str, commit: str, title: str, conclusion: str,
                   pulls: list[dict] | None = None) -> dict[str, Any]:  # fmt: skip
        """What GitHub would report for the run act just did (act reports nothing)."""
        run = {"id": self.runs, "name": "GPU verdict", "path": path, "event": event, "status": "completed",
               "conclusion": conclusion, "head_sha": commit, "display_title": title,
               "repository": {"full_name": REPO}, "pull_requests": pulls or [],
               "html_url": f"https://github.com/{REPO}/actions/runs/{self.runs}"}  # fmt: skip
        self.state.runs[self.runs] = run
        return run

    # act ------------------------------------------------------------------------------------

    def act_folder(self, source: Path) -> Path:
        folder = self.tmp / "act"
        (folder / ".github" / "workflows").mkdir(parents=True)
        for wf in sorted((source / ".github" / "workflows").glob("*.yml")):
            text = re.sub(r"(?m)^\s*queue: max\s*$\n", "", wf.read_text())  # act's schema lacks it
            (folder / ".github" / "workflows" / wf.name).write_text(text)
        git("init", "-q", cwd=folder)
        git("remote", "add", "origin", f"https://github.com/{REPO}", cwd=folder)
        git("add", "-A", cwd=folder)
        git("commit", "-qm", "workflows for act", cwd=folder)
        return folder

    def stand_ins(self, workflow: Path) -> list[str]:
        args = []
        for uses in sorted(set(re.findall(r"uses:\s*([\w.-]+/[\w.-]+@[0-9a-f]{40})", workflow.read_text()))):
            stand_in = HERE / "actions" / uses.split("@")[0].split("/", 1)[1]
            if not (stand_in / "action.yml").is_file():
                raise RuntimeError(f"no rehearsal stand-in for {uses}")
            args += ["--local-repository", f"{uses}={stand_in}"]
        return args

    def act_run(self, event: str, workflow: str, payload: dict, run_id: int,
                secrets: dict[str, str] | None = None, variables: dict[str, str] | None = None):  # fmt: skip
        """act on ``workflow`` with ``payload``; (exit status, log)."""
        path = self.actdir / ".github" / "workflows" / workflow
        event_file = self.tmp / f"event-{run_id}.json"
        event_file.write_text(json.dumps(payload))
        self.state.uploading_run = run_id
        argv = [self.act, event, "-W", str(path), "-e", str(event_file), "--no-skip-checkout",
                "--action-cache-path", str(self.tmp / "act-cache"), "--concurrent-jobs", "1", "--no-cache-server",
                *[f"-P{label}=-self-hosted" for label in sorted(LABELS)], *self.stand_ins(path),
                "--env", f"GITHUB_API_URL={self.api}", "--env", f"REHEARSE_ORIGIN=file://{self.origin}",
                "--env", f"REHEARSE_TOOLS={HERE}", "--env", f"PYTHONPATH={HERE / 'stubs'}",
                "--env", f"REHEARSE_PYTHON={sys.executable}",
                "--env", f"GITHUB_RUN_ID={run_id}", "-s", f"GITHUB_TOKEN={JOB_TOKEN}"]  # fmt: skip
        for name, value in (secrets or {}).items():
            argv += ["-s", f"{name}={value}"]
        for name, value in (variables or {}).items():
            argv += ["--var", f"{name}={value}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "RUNNER_", "ACTIONS_"))}
        home = self.tmp / "home"  # a runner's clean home: the person's own config and caches stay out
        home.mkdir(exist_ok=True)
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"))
        done = subprocess.run(argv, cwd=self.actdir, capture_output=True, text=True, timeout=300, env=env)
        return done.returncode, done.stdout + done.stderr

    def gpu_run(self, number: int) -> tuple[dict[str, Any], str]:
        """gpu.yml on PR ``number`` as pull_request_target; the run GitHub would record, and the log."""
        pull, run_id = self.state.pulls[number], self.runs
        payload = {"action": "synchronize", "number": number,
                   "pull_request": {**pull, "draft": False, "labels": []},
                   "repository": {"full_name": REPO, "name": REPO.split("/")[1], "default_branch": "main"}}  # fmt: skip
        status, log = self.act_run("pull_request_target", "gpu.yml", payload, run_id)
        template = yaml.safe_load((self.actdir / ".github/workflows/gpu.yml").read_text())["run-name"]
        title = template.replace("${{ github.event.pull_request.number }}", str(number)).replace(
            "${{ github.event.pull_request.head.sha }}", pull["head"]["sha"]
        )  # GitHub evaluates run-name
        run = self.record_run(".github/workflows/gpu.yml", "pull_request_target", self.main, title,
                              "success" if status == 0 else "failure",
                              [{"number": number, "head": {"sha": pull["head"]["sha"]}}])  # fmt: skip
        self.runs += 1
        return run, log

    def comment_run(self, run: dict[str, Any]) -> tuple[int, str]:
        """pr-comment.yml on the workflow_run event of ``run``: (exit status, log)."""
        keys = ("id", "name", "event", "conclusion", "display_title", "html_url", "head_sha")
        payload = {"action": "completed", "workflow_run": {k: run[k] for k in keys},
                   "repository": {"full_name": REPO, "name": REPO.split("/")[1], "default_branch": "main"}}  # fmt: skip
        self.runs += 1
        return self.act_run("workflow_run", "pr-comment.yml", payload, self.runs - 1,
                            secrets={"VERDICT_APP_PRIVATE_KEY": APP_KEY},
                            variables={"VERDICT_APP_CLIENT_ID": "Iv1.rehearsal"})  # fmt: skip

    def spoof_run(self, workflow: str, title: str, number: int, head: str) -> tuple[dict[str, Any], str]:
        """A writer's own workflow named "GPU verdict", on a branch of theirs, uploads a forged
        passing verdict for PR ``number``; the run GitHub would record for it, and the log."""
        forged = {"status": "pass", "head_sha": head,
                  "rows": [{"check": "latency 4096x4096-bfloat16 forward", "verdict": "pass", "ratio": 1.0}]}  # fmt: skip
        wf = {"name": "GPU verdict", "run-name": title, "on": {"pull_request_target": {}},
              "permissions": {}, "jobs": {"forge": {"runs-on": "ubuntu-latest", "steps": [
                  {"uses": "actions/checkout@de0fac2e4500dabe0009e67214ff5f5447ce83dd",
                   "with": {"ref": "spoof", "persist-credentials": False}},
                  {"uses": "actions/upload-artifact@043fb46d1a93c77aae656e7c1c64a875d1fc6a0a",
                   "with": {"name": "verdict-h200", "path": "forged"}}]}}}  # fmt: skip
        git("switch", "-q", "-C", "spoof", self.main, cwd=self.work)
        (self.work / "forged").mkdir(exist_ok=True)
        (self.work / "forged" / "verdict.json").write_text(json.dumps(forged))
        (self.work / "forged" / "pr.json").write_text(json.dumps({"number": number, "head_sha": head}))
        text = yaml.safe_dump(wf, sort_keys=False)
        (self.work / workflow).write_text(text)
        git("add", "-A", cwd=self.work)
        git("commit", "-qm", "a writer's branch", cwd=self.work)
        commit = git("rev-parse", "HEAD", cwd=self.work)
        git("push", "-q", "-f", str(self.origin), "HEAD:refs/heads/spoof", cwd=self.work)
        git("switch", "-q", "--detach", self.main, cwd=self.work)
        (self.actdir / ".github/workflows/spoof.yml").write_text(text)
        payload = {"action": "opened", "number": 99, "pull_request": {"number": 99},
                   "repository": {"full_name": REPO, "name": REPO.split("/")[1], "default_branch": "main"}}  # fmt: skip
        status, log = self.act_run("pull_request_target", "spoof.yml", payload, self.runs)
        run = self.record_run(
            workflow, "pull_request_target", commit, title, "success" if status == 0 else "failure"
        )
        self.runs += 1
        return run, log

    # history.yml -------------------------------------------------------------------------

    def history(self, commits: int = 24, seed: int = 49) -> list[str]:
        """Push ``commits`` commits onto main (each the nox stub's ``REHEARSE``: ``regression`` from
        FIRST_BAD on), the last one merging pull request MERGED_PULL, whose passing gpu.yml run
        accepted one row; per commit, both series (0.3% noise, seeded), each with a +8% step
        (SERIES): the last commit's as the next run's ``asv-results-h200`` artifact (the benchmark
        job's), the others on the results branch with its accepted.json approving the first
        series' step; main's new commits, oldest first."""
        shas = []
        for i in range(commits):
            (self.work / "REHEARSE").write_text("regression\n" if i >= FIRST_BAD else "pass\n")
            git("add", "-A", cwd=self.work)
            git(
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                f"main, commit {i} of the synthetic history",
                cwd=self.work,
            )
            shas.append(git("rev-parse", "HEAD", cwd=self.work))
        for index, name in TAGS.items():
            git("tag", name, shas[index], cwd=self.work)
        tags = [f"refs/tags/{name}" for name in TAGS.values()]
        git("push", "-q", str(self.origin), "HEAD:refs/heads/main", *tags, cwd=self.work)
        rng, files = random.Random(seed), {}
        files["h200/machine.json"] = {"machine": "h200", "version": 1}
        described = {"type": "track", "unit": "ms", "param_names": ["shape", "provider"], "params": PARAMS,
                     "timeout": 600, "version": "rehearsal", "code": "synthetic"}  # fmt: skip
        files["benchmarks.json"] = {"version": 2, **{name: {"name": name, **described} for name in SERIES}}
        for i, sha in enumerate(shas):
            values = [
                0.5 * (1.08 if i >= ACCEPTED_STEP else 1.0),
                1.5 * (1.08 if i >= BISECTED_STEP else 1.0),
            ]
            results = {
                name: [[v * (1 + rng.gauss(0, 0.003))], PARAMS]
                for name, v in zip(SERIES, values)
                if not (name == SERIES[1] and i in NO_RESULTS)
            }
            files[f"h200/{sha[:8]}-existing.json"] = {"commit_hash": sha, "date": 1_700_000_000 + i,
                                                      "result_columns": ["result", "params"],
                                                      "results": results, "version": 2, **ASV_RUN}  # fmt: skip
        files["accepted.json"] = {"accepted": [{"commit": shas[ACCEPTED_STEP], "check":
                                               "device 32768x4096-bfloat16 forward", "factor": 1.12,
                                               "reason": "two passes for accuracy", "approved_by": "maintainer",
                                               "pull": 7}]}  # fmt: skip
        tip = f"h200/{shas[-1][:8]}-existing.json"
        incoming = {name: files[name] for name in ("benchmarks.json", "h200/machine.json")}
        incoming[tip] = files.pop(tip)
        branch = self.tmp / "results-branch"
        branch.mkdir()
        git("init", "-q", cwd=branch)
        for name, data in files.items():
            (branch / name).parent.mkdir(parents=True, exist_ok=True)
            (branch / name).write_text(json.dumps(data))
        git("add", "-A", cwd=branch)
        git("commit", "-qm", "asv results", cwd=branch)
        git("push", "-q", str(self.origin), "HEAD:refs/heads/asv-results", cwd=branch)
        self.results_before = git("rev-parse", "HEAD", cwd=branch)
        self.merged_pull(MERGED_PULL, shas[-1])  # a run before the next one
        self.add_artifact(self.runs, "asv-results-h200", incoming)
        return shas

    def add_artifact(self, run_id: int, name: str, files: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for path, data in files.items():
                archive.writestr(path, json.dumps(data))
        self.state.artifacts.append({"id": 1000 + len(self.state.artifacts), "run_id": run_id,
                                     "name": name, "zip": buffer.getvalue()})  # fmt: skip

    def merged_pull(self, number: int, commit: str) -> dict[str, Any]:
        """Pull request ``number``, merged as main's ``commit`` (its head, fast-forwarded), and its
        passing gpu.yml run, whose ``verdict-h200`` accepted MERGED_CHECK with a maintainer's
        approval; the run."""
        self.state.pulls[number] = {
            "number": number, "state": "closed", "merged_at": "2026-01-01T00:00:00Z", "merge_commit_sha": commit,
            "head": {"sha": commit, "ref": f"pr-{number}", "repo": {"full_name": REPO}},
            "base": {"sha": self.main, "ref": "main", "repo": {"full_name": REPO}},
        }  # fmt: skip
        run = self.record_run(".github/workflows/gpu.yml", "pull_request_target", self.main,
                              f"GPU verdict #{number} at {commit}", "success",
                              [{"number": number, "head": {"sha": commit}}])  # fmt: skip
        self.runs += 1
        grant = {"check": MERGED_CHECK, "factor": 1.1, "reason": "a second pass for accuracy",
                 "approved_by": "maintainer"}  # fmt: skip
        verdict = {"status": "pass", "head_sha": commit, "acceptance": {"granted": [grant]},
                   "rows": [{"check": MERGED_CHECK, "verdict": "accepted", "ratio": 1.08}]}  # fmt: skip
        self.add_artifact(run["id"], "verdict-h200", {"verdict.json": verdict,
                                                      "pr.json": {"number": number, "head_sha": commit}})  # fmt: skip
        return run

    def history_run(self) -> tuple[int, str]:
        """history.yml's jobs of HISTORY_JOBS on a push of main's tip: (exit status, log). The
        other jobs are left out of act's copy, with the ``needs`` on them (the benchmark job's
        results are given to the run by ``history``)."""
        data = yaml.safe_load((self.actdir / ".github/workflows/history.yml").read_text())
        data["on"] = data.pop(True)  # YAML 1.1 reads the key `on` as true
        data["jobs"] = {name: data["jobs"][name] for name in HISTORY_JOBS}
        for name, needs in HISTORY_JOBS.items():
            data["jobs"][name].pop("needs", None)
            if needs:
                data["jobs"][name]["needs"] = needs
        (self.actdir / ".github/workflows/history-rehearsed.yml").write_text(
            yaml.safe_dump(data, sort_keys=False)
        )
        tip = git("rev-parse", "HEAD", cwd=self.work)
        payload = {"ref": "refs/heads/main", "before": self.main, "after": tip,
                   "repository": {"full_name": REPO, "name": REPO.split("/")[1], "default_branch": "main"}}  # fmt: skip
        self.runs += 1
        # act takes GITHUB_SHA from its folder's HEAD, not from the push event: point HEAD at the tip
        before = git("rev-parse", "HEAD", cwd=self.actdir)
        git("fetch", "-q", str(self.origin), "main", cwd=self.actdir)
        git("reset", "-q", "--soft", tip, cwd=self.actdir)
        try:
            return self.act_run("push", "history-rehearsed.yml", payload, self.runs - 1)
        finally:
            git("reset", "-q", "--soft", before, cwd=self.actdir)

    def artifact(self, run_id: int, name: str, into: Path) -> Path:
        """Unzip artifact ``name`` of run ``run_id`` into ``into``."""
        art = next(a for a in self.state.artifacts if a["run_id"] == run_id and a["name"] == name)
        zipfile.ZipFile(io.BytesIO(art["zip"])).extractall(into)
        return into

    def deployed_site(self, into: Path) -> dict[str, Any]:
        """Unpack the site of the one Pages deployment into ``into`` (its artifact.tar); the
        deployment as the fake recorded it."""
        (deployment,) = self.state.deployments
        art = next(a for a in self.state.artifacts if a["id"] == deployment["artifact_id"])
        site = zipfile.ZipFile(io.BytesIO(art["zip"])).read("artifact.tar")
        with tarfile.open(fileobj=io.BytesIO(site)) as tar:
            tar.extractall(into, **SAFE)
        return deployment

    def results_branch(self, into: Path) -> list[str]:
        """The results branch of GitHub's copy, its tree written into ``into``; its commits, newest
        first, as ``SHA subject``."""
        into.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", "asv-results"], cwd=self.origin,
                                 capture_output=True, check=True).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(into, **SAFE)
        return git("log", "--format=%H %s", "asv-results", cwd=self.origin).splitlines()

    # what a reader and the ruleset see -----------------------------------------------------

    def ruleset(self) -> dict[str, Any]:
        """The ruleset the project ships, with the verdict App's id as installing it sets it."""
        data = json.loads((ROOT / ".github" / "rulesets" / "main.json").read_text())
        for rule in data["rules"]:
            for check in rule.get("parameters", {}).get("required_status_checks", []):
                if check["context"] == "GPU verdict":
                    check["integration_id"] = APP_ID
                else:
                    rule["parameters"]["required_status_checks"] = [
                        c
                        for c in rule["parameters"]["required_status_checks"]
                        if c["context"] == "GPU verdict"
                    ]  # the CI checks are not rehearsed
        return data

    def comments(self, number: int) -> list[dict[str, Any]]:
        return [c for c in self.state.comments if c["issue"] == number]

    def checks(self, sha: str) -> list[tuple[str, int, str]]:
        return [(c["name"], c["app_id"], c["conclusion"]) for c in self.state.checks if c["head_sha"] == sha]


if __name__ == "__main__":  # a quick look by hand: one passing pull request through both workflows
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        r = Rehearsal(Path(tmp))
        r.pull_request(1, "pass")
        gpu, log = r.gpu_run(1)
        print(log[-3000:], gpu["conclusion"])
        status, log = r.comment_run(gpu)
        print(log[-3000:], status, r.state.comments, r.state.checks, sep="\n")
        r.close()
