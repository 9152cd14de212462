"""The GitHub workflows stay thin, pinned and least-privilege, and name only things that exist:
every nox session, script and requirements file a workflow mentions, every runner label it asks
for. The comment script renders a verdict without touching the network (--dry-run)."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.test_noxfile import noxfile_sessions

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_DIR = ROOT / ".github" / "workflows"
WORKFLOW_FILES = sorted(WORKFLOW_DIR.glob("*.yml"))
COMMENT_SCRIPT = ROOT / ".github" / "scripts" / "post_verdict_comment.py"
PUSH_SCRIPT = ROOT / ".github" / "scripts" / "push_results.sh"
BUILTIN_LABELS = {"self-hosted", "linux", "x64", "arm64", "ubuntu-latest"}
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


WORKFLOWS = {path.name: load(path) for path in WORKFLOW_FILES}


def steps():
    """(workflow, job id, job, step) for every step of every workflow."""
    for wf_name, wf in WORKFLOWS.items():
        for job_id, job in wf["jobs"].items():
            for step in job.get("steps", []):
                yield wf_name, job_id, job, step


def matrix_values(job: dict, key: str) -> list:
    matrix = job.get("strategy", {}).get("matrix", {})
    values = list(matrix.get(key, []))
    values += [entry[key] for entry in matrix.get("include", []) if key in entry and entry[key] not in values]
    return values


def resolve(word: str, step: dict, job: dict) -> list[str]:
    """Values a shell word can take: a literal, "$VAR" from the step's or job's env, and a
    ${{ matrix.KEY }} there resolved to the job's matrix values."""
    word = word.strip("\"'")
    var = re.fullmatch(r"\$\{?(\w+)\}?", word)
    if not var:
        return [word]
    value = {**job.get("env", {}), **step.get("env", {})}.get(var.group(1))
    assert value is not None, f"${var.group(1)} is not set in the step's or job's env"
    key = re.fullmatch(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", str(value))
    return [str(v) for v in matrix_values(job, key.group(1))] if key else [str(value)]


def test_there_are_the_four_workflows():
    assert set(WORKFLOWS) == {"ci.yml", "gpu.yml", "pr-comment.yml", "history.yml"}


@pytest.mark.parametrize("wf_name", sorted(WORKFLOWS))
def test_every_action_is_pinned_by_commit_sha_with_its_version(wf_name):
    text = (WORKFLOW_DIR / wf_name).read_text(encoding="utf-8")
    uses_lines = [line.strip() for line in text.splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert uses_lines, f"{wf_name} uses no action"
    for line in uses_lines:
        ref = line.split("uses:", 1)[1].split("#", 1)[0].strip()
        if ref.startswith("./"):
            continue
        assert SHA_PIN.match(ref), f"{wf_name}: {ref} is not pinned by a 40-hex commit SHA"
        assert re.search(r"#\s*v\d+(\.\d+)*\s*$", line), f"{wf_name}: {ref} has no '# vX.Y.Z' comment"


@pytest.mark.parametrize("wf_name", sorted(WORKFLOWS))
def test_permissions_are_least_privilege(wf_name):
    wf = WORKFLOWS[wf_name]
    assert "permissions" in wf, f"{wf_name}: no workflow-level permissions"
    top = wf["permissions"] or {}
    assert all(v in ("read", "none") for v in top.values()), f"{wf_name}: write access at workflow level"
    for job_id, job in wf["jobs"].items():
        assert "permissions" in job or top, f"{wf_name}/{job_id}: declares no permissions"


def test_write_permissions_are_where_they_are_needed_only():
    writes = {
        (wf_name, job_id, scope)
        for wf_name, wf in WORKFLOWS.items()
        for job_id, job in wf["jobs"].items()
        for scope, level in (job.get("permissions") or {}).items()
        if level == "write"
    }
    assert writes == {
        ("pr-comment.yml", "comment", "pull-requests"),
        ("history.yml", "publish", "contents"),
        ("history.yml", "deploy", "pages"),
        ("history.yml", "deploy", "id-token"),
    }


@pytest.mark.parametrize("wf_name", sorted(WORKFLOWS))
def test_bash_is_the_default_shell_and_jobs_have_timeouts(wf_name):
    wf = WORKFLOWS[wf_name]
    assert wf.get("defaults", {}).get("run", {}).get("shell") == "bash"
    for job_id, job in wf["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{wf_name}/{job_id}: no timeout-minutes"


def test_checkouts_do_not_persist_credentials():
    checkouts = [(w, j, s) for w, j, _, s in steps() if s.get("uses", "").startswith("actions/checkout@")]
    assert checkouts
    for wf_name, job_id, step in checkouts:
        assert step.get("with", {}).get("persist-credentials") is False, f"{wf_name}/{job_id}"


def test_run_steps_expand_no_expressions_inline():
    """Untrusted values (branch names, PR titles, SHAs) reach scripts through env: only."""
    for wf_name, job_id, _, step in steps():
        assert "${{" not in step.get("run", ""), f"{wf_name}/{job_id}: ${{{{ }}}} inside run:"


def nox_calls():
    """(workflow, job id, session name) for every `nox ... -s NAME` in a run: step."""
    for wf_name, job_id, job, step in steps():
        for match in re.finditer(r"\bnox\b(?:\s+--?[\w-]+)*\s+-s\s+(\S+)", step.get("run", "")):
            for name in resolve(match.group(1), step, job):
                yield wf_name, job_id, name


def test_every_nox_session_a_workflow_calls_exists():
    sessions = noxfile_sessions()
    calls = list(nox_calls())
    called = {name for _, _, name in calls}
    assert {"lint", "tests", "pr_verdict", "asv", "history"} <= called, called
    for wf_name, job_id, name in calls:
        assert name in sessions, f"{wf_name}/{job_id} calls `nox -s {name}`, which noxfile.py lacks"


def test_every_file_a_workflow_names_exists():
    named = set()
    for _, _, _, step in steps():
        text = step.get("run", "")
        named |= set(re.findall(r"(?<![\w/.-])((?:\.github|\.ci|requirements)/[\w./*-]+)", text))
    assert ".github/scripts/post_verdict_comment.py" in named
    assert "requirements/nox.txt" in named
    for path in named:
        assert list(ROOT.glob(path)), f"a workflow names {path}, which does not exist"
        run_directly = not path.endswith((".py", ".txt"))
        if run_directly:
            assert (ROOT / path).stat().st_mode & 0o100, f"{path} is run directly but not executable"


def test_ci_matrix_covers_python_versions_and_oldest_newest_torch():
    job = WORKFLOWS["ci.yml"]["jobs"]["cpu"]
    assert matrix_values(job, "python") == ["3.10", "3.11", "3.12", "3.13"]
    torches = {e["torch"]: e["torch_requirement"] for e in job["strategy"]["matrix"]["include"]}
    assert torches == {"oldest": "torch==2.6.0", "newest": "torch==2.13.0"}
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"torch>=2.6"' in pyproject, "the oldest torch of the matrix is the floor in pyproject.toml"
    assert job["env"]["RMSNORM_TORCH"] == "${{ matrix.torch_requirement }}"


def gpu_label_sets():
    for wf_name in ("gpu.yml", "history.yml"):
        for job_id, job in WORKFLOWS[wf_name]["jobs"].items():
            if job["runs-on"] == "${{ matrix.labels }}":
                yield wf_name, job_id, job


def test_gpu_runner_labels_are_declared_for_actionlint():
    declared = set(
        yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    )
    jobs = list(gpu_label_sets())
    assert len(jobs) == 2
    for wf_name, job_id, job in jobs:
        entries = job["strategy"]["matrix"]["include"]
        assert entries, f"{wf_name}/{job_id}: no GPU kinds"
        machines = [e["asv_machine"] for e in entries]
        assert len(set(machines)) == len(machines), f"{wf_name}: two kinds share an asv machine name"
        for entry in entries:
            assert (
                "self-hosted" in entry["labels"]
                and "gpu" in entry["labels"]
                and entry["kind"] in entry["labels"]
            )
            assert set(entry["labels"]) - BUILTIN_LABELS <= declared, f"{wf_name}: undeclared label"
        assert job["env"]["RMSNORM_ASV_MACHINE"] == "${{ matrix.asv_machine }}"


def test_gpu_workflow_is_one_cancellable_run_per_pr_behind_an_approval_for_forks():
    wf = WORKFLOWS["gpu.yml"]
    assert list(wf["on"]) == ["pull_request"]
    assert "pull_request.number" in wf["concurrency"]["group"]
    assert wf["concurrency"]["cancel-in-progress"] is True
    job = wf["jobs"]["verdict"]
    assert "head.repo.full_name != github.repository" in job["environment"]
    assert job["permissions"] == {"contents": "read"}
    uploads = [
        s["with"]["name"] for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert uploads == ["verdict-${{ matrix.kind }}", "results-${{ matrix.kind }}"]
    summary = next(s for s in job["steps"] if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    assert "verdict.md" in summary["run"]


def test_comment_workflow_follows_the_gpu_workflow_and_runs_no_pr_code():
    gpu_name = WORKFLOWS["gpu.yml"]["name"]
    wf = WORKFLOWS["pr-comment.yml"]
    assert wf["on"]["workflow_run"]["workflows"] == [gpu_name]
    job = wf["jobs"]["comment"]
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert "ref" not in checkout.get("with", {}), "the comment job must check out the default branch only"
    download = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"]["pattern"] == "verdict-*"
    assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"


# ----------------------------------------------------------------------------------------------
# The comment script, rendered locally (--dry-run)
# ----------------------------------------------------------------------------------------------

SAMPLE_ROWS = [
    {"check": "latency large/forward", "base": 0.0412, "head": 0.0409, "ratio": 0.993, "threshold": 1.05,
     "verdict": "pass"},
    {"check": "latency small/forward_backward", "base": 0.012, "head": 0.0151, "ratio": 1.258,
     "threshold": 1.05, "verdict": "regression", "kind": "latency"},
    {"check": "error bfloat16 dx | @someone <b>", "base": 1.6e-3, "head": None, "ratio": None,
     "threshold": 1.8e-3, "verdict": "pass"},
]  # fmt: skip


def write_verdict(folder: Path, status: str, rows=SAMPLE_ROWS, summary="1 regression in 3 checks", pr=7):
    folder.mkdir(parents=True)
    verdict = {"status": status, "summary": summary, "rows": rows}
    (folder / "verdict.json").write_text(json.dumps(verdict), encoding="utf-8")
    (folder / "verdict.md").write_text("# verdict\n", encoding="utf-8")
    (folder / "pr.json").write_text(json.dumps({"number": pr, "base_sha": "b" * 40, "head_sha": "a" * 40}))


def dry_run(verdicts: Path, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, str(COMMENT_SCRIPT), "--verdicts", str(verdicts), "--dry-run", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_comment_dry_run_renders_the_sample_verdict(tmp_path):
    write_verdict(tmp_path / "verdict-h200", "regression")
    body = dry_run(tmp_path, "--head-sha", "a" * 40, "--run-url", "https://example.invalid/run/1")
    lines = body.splitlines()
    assert lines[0] == "<!-- rmsnorm-kernel:gpu-verdict -->"
    assert lines[1] == "## GPU verdict: ❌ regression"
    assert "### h200: ❌ regression" in lines
    assert "1 regression in 3 checks" in lines
    assert "| check | base | head | ratio | threshold | verdict |" in lines
    # latency medians arrive in ms and are shown in µs
    assert "| latency small/forward_backward | 12.0 µs | 15.1 µs | 1.258 | 1.05 | regression |" in lines
    assert (
        "head `aaaaaaaaaaaa` · base `bbbbbbbbbbbb` · [workflow run](https://example.invalid/run/1)" in lines
    )
    # cells from the artifact cannot break the table, mention anyone or inject HTML
    escaped = next(line for line in lines if line.startswith("| error bfloat16 dx"))
    assert (
        "\\|" in escaped and "@\u200bsomeone" in escaped and "&lt;b&gt;" in escaped and "<b>" not in escaped
    )
    assert "| – |" in escaped


@pytest.mark.parametrize(
    ("statuses", "title"),
    [
        (["pass"], "✅ pass"),
        (["pass", "regression"], "❌ regression"),
        (["regression", "error"], "⚠️ error"),
        (["pass", None], "⚠️ error"),  # a kind whose job wrote no verdict.json
        ([], "⚠️ error"),  # no artifact at all
    ],
)
def test_comment_title_is_the_worst_kind(tmp_path, statuses, title):
    for i, status in enumerate(statuses):
        folder = tmp_path / f"verdict-kind{i}"
        if status is None:
            folder.mkdir()
        else:
            write_verdict(folder, status)
    body = dry_run(tmp_path)
    assert body.splitlines()[1] == f"## GPU verdict: {title}"
    if not statuses:
        assert "No verdict artifact was uploaded" in body
    if None in statuses:
        assert "no verdict.json" in body


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not readable JSON"),
        (json.dumps({"status": "green", "rows": []}), "no status in"),
        (json.dumps({"status": "pass", "rows": "none"}), "'rows' is not a list"),
    ],
)
def test_comment_reports_a_broken_verdict_as_error(tmp_path, content, message):
    folder = tmp_path / "verdict-h200"
    folder.mkdir()
    (folder / "verdict.json").write_text(content, encoding="utf-8")
    body = dry_run(tmp_path)
    assert "## GPU verdict: ⚠️ error" in body and message in body


def test_comment_reads_a_local_pr_verdict_folder(tmp_path):
    write_verdict(tmp_path / "out", "pass", summary="all 3 checks pass")
    body = dry_run(tmp_path / "out")
    assert "## GPU verdict: ✅ pass" in body and "all 3 checks pass" in body


def test_comment_refuses_to_post_without_token_or_head(tmp_path):
    write_verdict(tmp_path / "verdict-h200", "pass")
    result = subprocess.run(
        [sys.executable, str(COMMENT_SCRIPT), "--verdicts", str(tmp_path), "--repo", "o/r"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2 and "posting needs GH_TOKEN" in result.stderr


class FakeGitHub(http.server.BaseHTTPRequestHandler):
    """The four REST calls the comment script makes, on loopback: a PR whose head is HEAD_SHA."""

    pulls = {7: "a" * 40, 8: "c" * 40}
    comments: list[dict] = []
    calls: list[str] = []

    def _reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def do_GET(self):
        self.calls.append(f"GET {self.path}")
        if m := re.fullmatch(r"/repos/o/r/pulls/(\d+)", self.path):
            return self._reply(200, {"number": int(m[1]), "head": {"sha": self.pulls[int(m[1])]}})
        if re.fullmatch(r"/repos/o/r/issues/\d+/comments\?per_page=100&page=1", self.path):
            return self._reply(200, self.comments)
        return self._reply(404, {})

    def do_POST(self):
        self.calls.append(f"POST {self.path}")
        self.comments.append({"id": 100 + len(self.comments), "body": self._body()["body"]})
        self._reply(201, self.comments[-1])

    def do_PATCH(self):
        self.calls.append(f"PATCH {self.path}")
        comment_id = int(self.path.rsplit("/", 1)[1])
        comment = next(c for c in self.comments if c["id"] == comment_id)
        comment["body"] = self._body()["body"]
        self._reply(200, comment)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_github():
    FakeGitHub.comments = [{"id": 1, "body": "an unrelated comment"}]
    FakeGitHub.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeGitHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def post(verdicts: Path, api: str, head_sha: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(COMMENT_SCRIPT),
            "--verdicts",
            str(verdicts),
            "--repo",
            "o/r",
            "--head-sha",
            head_sha,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "GH_TOKEN": "t", "GITHUB_API_URL": api},
    )


def test_comment_is_created_once_then_updated_in_place(tmp_path, fake_github):
    write_verdict(tmp_path / "v1" / "verdict-h200", "regression", pr=7)
    write_verdict(tmp_path / "v2" / "verdict-h200", "pass", pr=7)
    first = post(tmp_path / "v1", fake_github, "a" * 40)
    assert first.returncode == 0, first.stderr
    assert "created the verdict comment on #7" in first.stdout
    second = post(tmp_path / "v2", fake_github, "a" * 40)
    assert second.returncode == 0, second.stderr
    assert "updated the verdict comment 101 on #7" in second.stdout
    ours = [c for c in FakeGitHub.comments if c["body"].startswith("<!-- rmsnorm-kernel:gpu-verdict -->")]
    assert len(ours) == 1 and "## GPU verdict: ✅ pass" in ours[0]["body"]
    assert FakeGitHub.comments[0]["body"] == "an unrelated comment"


def test_comment_ignores_a_pr_number_whose_head_is_another_commit(tmp_path, fake_github):
    write_verdict(tmp_path / "verdict-h200", "pass", pr=8)  # PR 8's head is c..c, the run's is a..a
    result = post(tmp_path, fake_github, "a" * 40)
    assert result.returncode != 0 and "nothing posted" in result.stderr
    assert not [call for call in FakeGitHub.calls if not call.startswith("GET")]


# ----------------------------------------------------------------------------------------------
# The results-branch script, against a local bare repository
# ----------------------------------------------------------------------------------------------


def git(*args: str, cwd: Path) -> str:
    identity = [
        "-c",
        "user.name=test",
        "-c",
        "user.email=test@example.invalid",
        "-c",
        "init.defaultBranch=main",
    ]
    return subprocess.run(
        ["git", *identity, *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_push_results_appends_a_commit_to_the_results_branch(tmp_path):
    remote, seed, work = tmp_path / "remote.git", tmp_path / "seed", tmp_path / "work"
    git("init", "--bare", "-q", str(remote), cwd=tmp_path)
    git("init", "-q", str(seed), cwd=tmp_path)
    git("commit", "-q", "--allow-empty", "-m", "asv results", cwd=seed)
    git("push", "-q", str(remote), "HEAD:refs/heads/asv-results", cwd=seed)
    git("clone", "-q", "--branch", "asv-results", str(remote), str(work), cwd=tmp_path)

    (work / "h200").mkdir()
    (work / "h200" / "abcd1234-existing.json").write_text("{}")
    run = [str(PUSH_SCRIPT), str(work), "asv-results", "asv results of abcd1234"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert first.returncode == 0, first.stderr
    assert git("log", "-1", "--format=%s", "asv-results", cwd=remote) == "asv results of abcd1234"
    assert git("ls-tree", "-r", "--name-only", "asv-results", cwd=remote) == "h200/abcd1234-existing.json"

    again = subprocess.run(run, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert again.returncode == 0 and "no new results" in again.stdout
    assert git("rev-list", "--count", "asv-results", cwd=remote) == "2"


# ----------------------------------------------------------------------------------------------
# The linters themselves, where installed (the lint session always runs them)
# ----------------------------------------------------------------------------------------------

LINTERS = [
    ("actionlint", ["actionlint"]),
    ("zizmor", ["zizmor", "--offline", ".github/workflows"]),
    ("check-jsonschema", ["check-jsonschema", "--builtin-schema", "vendor.github-workflows",
                          *[str(p.relative_to(ROOT)) for p in WORKFLOW_FILES]]),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "argv"), LINTERS, ids=[t for t, _ in LINTERS])
def test_workflow_linters_report_nothing(tool, argv):
    exe = shutil.which(tool) or shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed here (nox -s lint installs and runs it)")
    result = subprocess.run([exe, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
