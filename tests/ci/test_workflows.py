"""The GitHub workflows stay thin, pinned and least-privilege, and name only things that exist:
every nox session, script and requirements file a workflow mentions, every runner scale set it
asks for (deploy/arc). Pull-request code never reaches a trusted runner or a write token; the
history keeps every commit and checks results before they are kept. The comment script has its
own tests (tests/ci/test_comment.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ci._fixtures import noxfile_sessions

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW_DIR = ROOT / ".github" / "workflows"
WORKFLOW_FILES = sorted(WORKFLOW_DIR.glob("*.yml"))
SCRIPTS = ROOT / ".github" / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))  # the scripts import each other, as when a job runs them
PUSH_SCRIPT = SCRIPTS / "push_results.sh"
ARC_DIR = ROOT / "deploy" / "arc"
HOSTED = {"ubuntu-latest"}
PR_TRIGGERS = {"pull_request", "pull_request_target"}  # events whose jobs run a pull request's code
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
    ours = {"ci.yml", "gpu.yml", "pr-comment.yml", "history.yml"}
    assert ours <= set(WORKFLOWS) <= ours | {"mutation.yml"}


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
        ("history.yml", "push", "contents"),
        ("history.yml", "drift-issue", "issues"),
        ("history.yml", "deploy", "pages"),
        ("history.yml", "deploy", "id-token"),
    }


@pytest.mark.parametrize("wf_name", sorted(WORKFLOWS))
def test_bash_is_the_default_shell_and_jobs_have_timeouts(wf_name):
    wf = WORKFLOWS[wf_name]
    assert wf.get("defaults", {}).get("run", {}).get("shell") == "bash"
    for job_id, job in wf["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{wf_name}/{job_id}: no timeout-minutes"


def test_no_workflow_restores_or_saves_an_actions_cache():
    """A job that runs a PR's code could write a cache entry that a trusted job restores
    (docs/ci.md): no `cache:` input and no cache action anywhere."""
    for wf_name, job_id, _, step in steps():
        uses = step.get("uses", "")
        assert not uses.startswith(("actions/cache@", "actions/cache/")), f"{wf_name}/{job_id}: {uses}"
        assert "cache" not in step.get("with", {}), f"{wf_name}/{job_id}: {uses} caches"


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


def scale_sets() -> dict[str, dict]:
    """runnerScaleSetName -> values, for every values file of deploy/arc."""
    values = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(ARC_DIR.glob("*.yaml"))]
    return {v["runnerScaleSetName"]: v for v in values}


def trusted(name: str) -> bool:
    return scale_sets()[name]["runnerGroup"] == "gpu-trusted"


def runners(job: dict) -> list[str]:
    """The runner names a job may ask for: its runs-on, resolved through its matrix."""
    runs_on = job["runs-on"]
    key = re.fullmatch(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", str(runs_on))
    return [str(v) for v in matrix_values(job, key.group(1))] if key else [str(runs_on)]


def test_each_scale_set_is_one_gpu_kind_at_one_trust_level_ephemeral_and_without_dind():
    sets = scale_sets()
    for path in sorted(ARC_DIR.glob("*.yaml")):
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
        name = values["runnerScaleSetName"]
        assert path.stem == name, f"{path.name}: the file is named after its scale set"
        level = name.rsplit("-", 1)[1]
        assert values["runnerGroup"] == f"gpu-{level}"
        spec = values["template"]["spec"]
        assert spec["nodeSelector"]["rmsnorm/gpu-pool"] == level  # trust levels share no node
        assert "containerMode" not in values and "initContainers" not in spec  # no docker-in-docker
        (runner,) = spec["containers"]
        assert runner["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert not runner["image"].endswith(":latest")
        assert isinstance(values["githubConfigSecret"], str), "credentials by secret name only"
    kinds = {name.rsplit("-", 1)[0] for name in sets}
    assert {f"{kind}-{level}" for kind in kinds for level in ("trusted", "untrusted")} == set(sets)
    declared = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"][
        "labels"
    ]
    assert set(declared) == set(sets), "actionlint knows exactly the scale sets of deploy/arc"


def test_every_runner_a_workflow_asks_for_exists_and_pr_jobs_never_get_a_trusted_one():
    sets = scale_sets()
    gpu_jobs = 0
    for wf_name, wf in WORKFLOWS.items():
        pr_code = bool(PR_TRIGGERS & set(wf["on"]))
        for job_id, job in wf["jobs"].items():
            for name in runners(job):
                if name in HOSTED:
                    continue
                gpu_jobs += 1
                assert name in sets, f"{wf_name}/{job_id}: runs-on {name}, not a scale set of deploy/arc"
                if pr_code:
                    assert not trusted(name), f"{wf_name}/{job_id}: pull-request code on trusted {name}"
    assert gpu_jobs >= 3
    history = WORKFLOWS["history.yml"]["jobs"]
    assert all(trusted(n) for job in ("benchmark", "drift") for n in runners(history[job]))
    assert not any(trusted(n) for n in runners(WORKFLOWS["gpu.yml"]["jobs"]["verdict"]))


def test_gpu_verdict_runs_from_the_default_branch_with_the_head_as_data():
    wf = WORKFLOWS["gpu.yml"]
    assert list(wf["on"]) == ["pull_request_target"]
    trigger = wf["on"]["pull_request_target"]
    assert "labeled" in trigger["types"] and trigger["branches"] == ["main"]
    assert wf["permissions"] == {}
    assert (
        "pull_request.number" in wf["concurrency"]["group"]
        and wf["concurrency"]["cancel-in-progress"] is True
    )
    job = wf["jobs"]["verdict"]
    assert job["permissions"] == {"contents": "read"}
    # forks: only with a maintainer's label, and each run behind the approval environment
    assert "contains(github.event.pull_request.labels.*.name, 'gpu-verdict')" in job["if"]
    assert "head.repo.full_name != github.repository && 'gpu-fork-approval'" in job["environment"]
    text = (WORKFLOW_DIR / "gpu.yml").read_text(encoding="utf-8")
    assert "secrets." not in text, "the GPU job holds no secret"
    checkouts = [s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@")]
    assert len(checkouts) == 1 and "ref" not in checkouts[0]["with"], "the judge is the default branch"
    fetch = next(s for s in job["steps"] if "refs/pull/" in s.get("run", ""))
    assert "git -c" in fetch["run"] and "fetch" in fetch["run"] and "checkout" not in fetch["run"]
    assert not any(re.search(r"git (checkout|switch|worktree)", s.get("run", "")) for s in job["steps"])
    uploads = [
        s["with"]["name"] for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert uploads == ["verdict-${{ matrix.kind }}", "results-${{ matrix.kind }}"]
    # only what the judge wrote (after validating the rounds) leaves the pod: no rounds/, no logs
    paths = [
        s["with"]["path"] for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    names = {line.strip().rsplit("/", 1)[-1] for text in paths for line in text.splitlines() if line.strip()}
    assert names == {"pr.json", "verdict.md", "verdict.json", "base.json", "head.json"}


def test_the_run_title_is_what_the_comment_script_reads():
    spec = importlib.util.spec_from_file_location("pvc_for_title", SCRIPTS / "post_verdict_comment.py")
    pvc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pvc
    spec.loader.exec_module(pvc)
    title = WORKFLOWS["gpu.yml"]["run-name"]
    filled = title.replace("${{ github.event.pull_request.number }}", "123").replace(
        "${{ github.event.pull_request.head.sha }}", "f" * 40
    )
    assert pvc.RUN_TITLE.fullmatch(filled).groups() == ("123", "f" * 40)
    verify = importlib.util.spec_from_file_location("vt_for_title", SCRIPTS / "verify_trigger.py")
    vt = importlib.util.module_from_spec(verify)
    verify.loader.exec_module(vt)
    assert vt.RUN_TITLE.fullmatch(filled).groups() == ("123", "f" * 40)
    assert vt.WORKFLOW == ".github/workflows/gpu.yml" and (ROOT / vt.WORKFLOW).is_file()
    assert vt.EVENT in WORKFLOWS["gpu.yml"]["on"]
    assert WORKFLOWS["gpu.yml"]["name"] == "GPU verdict"


def test_a_hang_becomes_an_error_verdict_before_the_job_limit():
    wf = WORKFLOWS["gpu.yml"]
    job = wf["jobs"]["verdict"]
    deadline = int(wf["env"]["DEADLINE_MINUTES"])
    # pr-verdict's deadline, then the `timeout` backstop (+5) and its kill grace (+2), then the uploads
    assert deadline + 5 + 2 + 5 <= job["timeout-minutes"]
    step = next(s for s in job["steps"] if "-s pr_verdict" in s.get("run", ""))
    assert '--deadline-s "$((DEADLINE_MINUTES * 60))"' in step["run"]
    assert 'timeout --kill-after=2m "$((DEADLINE_MINUTES + 5))m"' in step["run"]
    assert "deadline_verdict.py" in step["run"] and "124" in step["run"]
    assert '--base "$BASE_REF_SHA" --head "$HEAD_SHA"' in step["run"]  # the judge takes the merge-base


def test_deadline_verdict_is_an_error_the_comment_shows(tmp_path):
    out = tmp_path / "verdict-h200"
    script = [sys.executable, str(SCRIPTS / "deadline_verdict.py"), "--out", str(out), "--minutes", "75"]
    done = subprocess.run(
        [*script, "--base-ref", "b" * 40, "--head", "a" * 40], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "error" and data["head_sha"] == "a" * 40
    body = subprocess.run(
        [sys.executable, str(SCRIPTS / "post_verdict_comment.py"), "--verdicts", str(tmp_path), "--dry-run",
         "--head-sha", "a" * 40],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "## GPU verdict: ⚠️ could not judge" in body and "deadline of 75 min" in body
    bad = subprocess.run([*script, "--base-ref", "x`", "--head", "a" * 40], capture_output=True, text=True)
    assert bad.returncode == 2


def test_comment_workflow_runs_trusted_code_on_a_hosted_runner_after_the_gpu_run():
    wf = WORKFLOWS["pr-comment.yml"]
    assert wf["on"]["workflow_run"]["workflows"] == [WORKFLOWS["gpu.yml"]["name"]]
    job = wf["jobs"]["comment"]
    assert job["runs-on"] == "ubuntu-latest"
    assert "workflow_run.event == 'pull_request_target'" in job["if"] and "cancelled" not in job["if"]
    # the workflow's own token only reads; writes go through the App's token, minted in this job
    assert job["permissions"] == {"actions": "read", "contents": "read", "pull-requests": "read"}
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert "ref" not in checkout["with"], "the comment job checks out the default branch only"
    download = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"]["pattern"] == "verdict-*"
    assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"
    assert wf["concurrency"]["cancel-in-progress"] is False and wf["concurrency"]["queue"] == "max"


def test_the_comment_job_verifies_the_run_before_it_mints_the_app_token():
    job = WORKFLOWS["pr-comment.yml"]["jobs"]["comment"]
    names = [s.get("uses", "").split("@")[0] or s.get("run", "").split()[1] for s in job["steps"]]
    verify = names.index(".github/scripts/verify_trigger.py")
    mint = names.index("actions/create-github-app-token")
    assert verify < mint == len(names) - 2, "the token is minted after verification, for the last step only"
    assert job["steps"][verify]["env"] == {"GH_TOKEN": "${{ github.token }}", "REPOSITORY": "${{ github.repository }}",
                                           "RUN_ID": "${{ github.event.workflow_run.id }}"}  # fmt: skip
    app = job["steps"][mint]["with"]
    assert {k: v for k, v in app.items() if k.startswith("permission-")} == {
        "permission-checks": "write", "permission-pull-requests": "write"}  # fmt: skip
    post = job["steps"][-1]
    assert post["env"]["GH_TOKEN"] == "${{ steps.app.outputs.token }}" and job["steps"][mint]["id"] == "app"
    assert "--trigger" in post["run"] and "--run-title" not in post["run"] and "--kinds" in post["run"]
    assert not any("display_title" in json.dumps(s) for s in job["steps"]), (
        "nothing reads the title of the event"
    )
    text = (WORKFLOW_DIR / "pr-comment.yml").read_text(encoding="utf-8")
    assert text.count("secrets.") == 1 and "steps.app.outputs.token" in text
    # the key is an environment secret (deployment branch: main), not a repository secret
    assert job["environment"] == "verdict-app"
    # the only other job that could see the App's key: none
    for wf_name in WORKFLOWS:
        other = (WORKFLOW_DIR / wf_name).read_text(encoding="utf-8")
        assert wf_name == "pr-comment.yml" or "VERDICT_APP" not in other


def test_the_comment_reads_exactly_the_gpu_matrix_kinds():
    kinds = matrix_values(WORKFLOWS["gpu.yml"]["jobs"]["verdict"], "kind")
    assert kinds and WORKFLOWS["pr-comment.yml"]["jobs"]["comment"]["env"]["KINDS"] == ",".join(kinds)


def test_history_keeps_every_commit_and_only_a_push_job_writes():
    wf = WORKFLOWS["history.yml"]
    assert set(wf["on"]) == {"push", "workflow_dispatch"} and wf["on"]["push"]["branches"] == ["main"]
    assert wf["concurrency"] == {"group": "history", "cancel-in-progress": False, "queue": "max"}
    for job_id, job in wf["jobs"].items():
        assert "github.ref == 'refs/heads/main'" in job["if"], f"history.yml/{job_id} runs on main only"
    push = wf["jobs"]["push"]
    assert push["permissions"] == {"contents": "write"} and push["needs"] == "publish"
    commands = [s["run"] for s in push["steps"] if "run" in s]
    assert commands == ['.github/scripts/push_results.sh results "$RESULTS_BRANCH" "asv results of $COMMIT"']
    used = [s["uses"].split("@")[0] for s in push["steps"] if "uses" in s]
    assert used == ["actions/checkout", "actions/checkout", "actions/download-artifact"]
    assert push["steps"][2]["with"]["name"] == "asv-results-checked"
    publish = [s.get("run", "") for s in wf["jobs"]["publish"]["steps"]]
    check = next(i for i, r in enumerate(publish) if "check_asv_results.py incoming .asv/results" in r)
    assert check < next(i for i, r in enumerate(publish) if "nox -s history" in r)


def test_the_merged_verdict_job_alone_reads_other_runs_and_runs_no_installed_code():
    """merged_verdict.py (standard library only) finds and verifies the merged pull request's
    verdict run, and that run's verdict-* artifacts are handed on as this run's merged-verdicts:
    the read tokens it needs, checkout and the two artifact actions, no Python set up, no pip, no
    nox; publish gets plain data only (three outputs and the files)."""
    job = WORKFLOWS["history.yml"]["jobs"]["merged-verdict"]
    assert job["permissions"] == {"contents": "read", "actions": "read", "pull-requests": "read"}
    assert job["runs-on"] == "ubuntu-latest" and "needs" not in job
    used = [s["uses"].split("@")[0] for s in job["steps"] if "uses" in s]
    assert used == ["actions/checkout", "actions/download-artifact", "actions/upload-artifact"]
    checkout = job["steps"][0]["with"]
    assert checkout == {"persist-credentials": False, "sparse-checkout": ".github/scripts"}
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert runs == ['python3 .github/scripts/merged_verdict.py --repo "$REPOSITORY" --sha "$GITHUB_SHA"']
    find = next(s for s in job["steps"] if "run" in s)
    assert find["id"] == "merged" and find["env"]["GH_TOKEN"] == "${{ github.token }}"
    download, upload = job["steps"][2], job["steps"][3]
    assert download["with"] == {
        "pattern": "verdict-*", "path": "merged-verdicts", "run-id": "${{ steps.merged.outputs.run-id }}",
        "github-token": "${{ github.token }}"}  # fmt: skip
    assert upload["with"] == {"name": "merged-verdicts", "path": "merged-verdicts",
                              "if-no-files-found": "warn", "retention-days": 7}  # fmt: skip
    assert download["if"] == upload["if"] == "steps.merged.outputs.run-id != ''"
    assert job["outputs"] == {
        key: f"${{{{ steps.merged.outputs.{key} }}}}" for key in ("run-id", "pull", "head")
    }


def test_publish_records_the_merged_verdicts_accepted_rows_before_the_check():
    """publish reads the merged-verdict job's outputs and files as data: it downloads this run's
    merged-verdicts and runs record-accepted (which checks every file) into the results branch's
    accepted.json, which check_asv_results.py then re-checks with the rest. It holds only
    `contents: read`: it installs packages and runs nox."""
    jobs = WORKFLOWS["history.yml"]["jobs"]
    job = jobs["publish"]
    assert job["permissions"] == {"contents": "read"}
    assert job["needs"] == ["benchmark", "merged-verdict"]
    text = yaml.safe_dump(job)
    assert "merged_verdict.py" not in text and "github.token" not in text and "run-id:" not in text
    steps = job["steps"]
    download = next(i for i, s in enumerate(steps) if s.get("with", {}).get("path") == "merged-verdicts")
    record = steps[download + 1]
    # a plain pattern from this run: no artifact (a verdict run that uploaded none) is no error
    assert steps[download]["uses"].startswith("actions/download-artifact@") and steps[download]["with"] == {
        "pattern": "merged-verdicts", "path": "merged-verdicts", "merge-multiple": True}  # fmt: skip
    assert steps[download]["if"] == record["if"] == "needs.merged-verdict.outputs.run-id != ''"
    assert "history.py record-accepted --verdicts merged-verdicts" in record["run"]
    assert '--commit "$GITHUB_SHA"' in record["run"] and "--into .asv/results/accepted.json" in record["run"]
    # only the verdicts of the merged pull request's last head (merged_verdict.py's output),
    # passed through the environment, never into the script's text
    assert '--pull "$PULL"' in record["run"] and '--head "$MERGED_HEAD"' in record["run"]
    assert record["env"] == {
        "PULL": "${{ needs.merged-verdict.outputs.pull }}",
        "MERGED_HEAD": "${{ needs.merged-verdict.outputs.head }}",
    }
    check = next(i for i, s in enumerate(steps) if "check_asv_results.py" in s.get("run", ""))
    assert download < check and steps[check - 1] is record


def test_a_job_that_installs_packages_or_runs_nox_reads_nothing_but_contents():
    """Code a job installs (pip, setup-python, a nox session's packages) runs with the job's
    token: such a job holds `contents: read` at most, its own or the workflow's."""
    installing = 0
    for wf_name, wf in WORKFLOWS.items():
        for job_id, job in wf["jobs"].items():
            runs = " ".join(s.get("run", "") for s in job.get("steps", []))
            used = [s.get("uses", "").split("@")[0] for s in job.get("steps", [])]
            if not (re.search(r"\bpip install\b|\bnox\b", runs) or "actions/setup-python" in used):
                continue
            installing += 1
            held = job["permissions"] if "permissions" in job else wf.get("permissions") or {}
            granted = {scope: level for scope, level in (held or {}).items() if level != "none"}
            assert granted in ({}, {"contents": "read"}), f"{wf_name}/{job_id} holds {granted}"
    assert installing >= 5


def test_only_the_merged_verdict_job_of_the_history_reads_runs_or_pull_requests():
    held = {
        (job_id, scope)
        for job_id, job in WORKFLOWS["history.yml"]["jobs"].items()
        for scope, level in (job.get("permissions") or {}).items()
        if scope in ("actions", "pull-requests") and level != "none"
    }
    assert held == {("merged-verdict", "actions"), ("merged-verdict", "pull-requests")}


def test_drift_judges_main_and_reports_in_the_summary():
    job = WORKFLOWS["history.yml"]["jobs"]["drift"]
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "-m nox -s drift" in runs and "GITHUB_STEP_SUMMARY" in runs
    assert (
        '--deadline-s "$((DEADLINE_MINUTES * 60))"' in runs
        and int(job["env"]["DEADLINE_MINUTES"]) + 12 <= job["timeout-minutes"]
    )
    assert job["steps"][0]["with"]["fetch-tags"] is True
    # the tag judged against is named on the command line and recorded for the tracking issue
    assert '-m nox -s drift -- "${against[@]}"' in runs and '"$DRIFT_DIR/drift.json"' in runs


def test_the_drift_issue_job_holds_only_issues_write_and_runs_the_default_branch_script():
    job = WORKFLOWS["history.yml"]["jobs"]["drift-issue"]
    assert job["needs"] == ["drift", "changepoints", "bisect"] and job["runs-on"] == "ubuntu-latest"
    assert "!cancelled()" in job["if"] and "github.ref == 'refs/heads/main'" in job["if"]
    assert job["permissions"] == {"issues": "write"}
    used = [s["uses"].split("@")[0] for s in job["steps"] if "uses" in s]
    assert used == ["actions/checkout"] + ["actions/download-artifact"] * 3
    # one plain glob each: brace sets are not relied on in a pattern; steps/changepoints/ and
    # steps/bisect-KIND/ are the folders drift_issue.py --steps reads
    assert job["steps"][2]["with"] == {"name": "changepoints", "path": "steps/changepoints"}
    assert job["steps"][3]["with"] == {"pattern": "bisect-*", "path": "steps"}
    assert job["steps"][2]["continue-on-error"] is True and job["steps"][3]["continue-on-error"] is True
    checkout = job["steps"][0]["with"]
    assert "ref" not in checkout and checkout["sparse-checkout"] == ".github/scripts"
    assert job["steps"][1]["with"] == {"pattern": "drift-*", "path": "drift"}  # this run's artifacts only
    post = job["steps"][-1]
    assert post["run"].startswith("python3 .github/scripts/drift_issue.py --drift drift --steps steps")
    assert post["env"]["MAIN_SHA"] == "${{ github.sha }}" and '--sha "$MAIN_SHA"' in post["run"]
    upload = next(
        s
        for s in WORKFLOWS["history.yml"]["jobs"]["drift"]["steps"]
        if "upload-artifact" in s.get("uses", "")
    )
    assert upload["with"]["name"] == "drift-${{ matrix.kind }}"


@pytest.mark.parametrize(
    ("wf_name", "job_id"), [("pr-comment.yml", "comment"), ("history.yml", "drift-issue")]
)
def test_the_pages_url_is_built_from_the_repository_and_passes_the_scripts_pattern(wf_name, job_id):
    """The history links' base comes from github context: https://OWNER.github.io/REPO/, owner lowercased."""
    step = WORKFLOWS[wf_name]["jobs"][job_id]["steps"][-1]
    assert step["env"]["OWNER"] == "${{ github.repository_owner }}"
    assert step["env"]["REPO_NAME"] == "${{ github.event.repository.name }}"
    assert '--pages-url "https://${OWNER,,}.github.io/$REPO_NAME/"' in step["run"]
    spec = importlib.util.spec_from_file_location("pvc_for_pages", SCRIPTS / "post_verdict_comment.py")
    pvc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pvc
    spec.loader.exec_module(pvc)
    built = subprocess.run(
        ["bash", "-c", 'echo -n "https://${OWNER,,}.github.io/$REPO_NAME/"'],
        env={"OWNER": "Some-Owner", "REPO_NAME": "rmsnorm-kernel", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert built == "https://some-owner.github.io/rmsnorm-kernel/" and pvc.PAGES_URL.fullmatch(built)


def asv_tree(root: Path, name: str = "bench_rmsnorm.Forward.track_median_ms") -> Path:
    (root / "h200").mkdir(parents=True)
    (root / "benchmarks.json").write_text(json.dumps({name: {"name": name, "params": [["'4096x4096-bfloat16'"]],
                                                             "code": "def f(x):\n    return x < 1"}, "version": 2}))  # fmt: skip
    (root / "h200" / "machine.json").write_text(json.dumps({"machine": "h200", "cpu": "AMD EPYC 9654 (96)"}))
    results = {"commit_hash": "a" * 40, "results": {name: [[0.04], [["'4096x4096-bfloat16'"]]]},
               "durations": {"<build>": 1.0, "<setup_cache bench_rmsnorm:40>": 9.5}}  # fmt: skip
    (root / "h200" / "aaaaaaaa-existing-py_opt_rmsnorm_bin_python3.json").write_text(json.dumps(results))
    return root


def check_asv(incoming: Path, dest: Path) -> subprocess.CompletedProcess:
    script = [sys.executable, str(SCRIPTS / "check_asv_results.py"), str(incoming), str(dest)]
    return subprocess.run(script, capture_output=True, text=True, timeout=60)


def test_asv_results_are_checked_before_they_are_kept(tmp_path):
    done = check_asv(asv_tree(tmp_path / "ok"), tmp_path / "dest")
    assert done.returncode == 0, done.stdout
    assert (tmp_path / "dest" / "h200" / "machine.json").is_file()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda root: asv_tree(root, 'x<img src=x onerror="alert(1)">'),
        lambda root: (asv_tree(root) / "h200" / "machine.json").write_text('{"cpu": "<script>x</script>"}'),
        lambda root: (asv_tree(root) / "index.html").write_text("<html>"),
        lambda root: (asv_tree(root) / "h200" / "notes.json").write_text("{}"),
        lambda root: (asv_tree(root) / "h200" / "bbbbbbbb-env.json").write_text("not json"),
        lambda root: (asv_tree(root) / "h200" / "cccccccc-env.json").symlink_to("/etc/passwd"),
    ],
    ids=["html-name", "html-machine", "extra-file", "unknown-name", "not-json", "symlink"],
)
def test_asv_results_with_markup_or_foreign_files_are_refused_whole(tmp_path, spoil):
    spoil(tmp_path / "in")
    done = check_asv(tmp_path / "in", tmp_path / "dest")
    assert done.returncode == 1 and "::error::" in done.stdout
    assert not (tmp_path / "dest").exists(), "nothing is copied when anything fails"


@pytest.mark.parametrize(
    "plant",
    [
        lambda dest: (dest / "h200" / "machine.json").write_text('{"cpu": "<img src=x onerror=alert(1)>"}'),
        lambda dest: (dest / "index.html").write_text("<script>alert(1)</script>"),
        lambda dest: (dest / "h200" / "dddddddd-env.json").symlink_to("/etc/passwd"),
    ],
    ids=["markup-kept-file", "foreign-kept-file", "symlink-kept-file"],
)
def test_a_planted_file_on_the_results_branch_fails_the_next_publish(tmp_path, plant):
    """Every file already on the results branch is re-checked, not only the new ones."""
    dest = asv_tree(tmp_path / "dest")
    (dest / ".git").mkdir()
    (dest / ".git" / "HEAD").write_text("ref: refs/heads/asv-results <not checked>\n")  # git's own: skipped
    assert check_asv(asv_tree(tmp_path / "in"), dest).returncode == 0
    plant(dest)
    done = check_asv(asv_tree(tmp_path / "in2"), dest)
    assert done.returncode == 1 and "::error::results branch: " in done.stdout


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
    ("zizmor", ["zizmor", "--offline", "--pedantic", ".github/workflows"]),
    ("check-jsonschema", ["check-jsonschema", "--builtin-schema", "vendor.github-workflows",
                          *[str(p.relative_to(ROOT)) for p in WORKFLOW_FILES]]),
    ("check-jsonschema", ["check-jsonschema", "--schemafile", "deploy/arc/values.schema.json",
                          *[str(p.relative_to(ROOT)) for p in sorted(ARC_DIR.glob("*.yaml"))]]),
]  # fmt: skip
LINTER_IDS = ["actionlint", "zizmor", "zizmor-pedantic", "workflow-schema", "arc-schema"]


@pytest.mark.parametrize(("tool", "argv"), LINTERS, ids=LINTER_IDS)
def test_workflow_linters_report_nothing(tool, argv):
    exe = shutil.which(tool) or shutil.which(tool, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{tool} is not installed here (nox -s lint installs and runs it)")
    result = subprocess.run([exe, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_change_points_run_hosted_on_the_checked_results_with_read_access_only():
    job = WORKFLOWS["history.yml"]["jobs"]["changepoints"]
    assert job["needs"] == "publish" and job["runs-on"] == "ubuntu-latest"
    assert job["permissions"] == {"contents": "read"}
    download = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"] == {"name": "asv-results-checked", "path": ".asv/results"}
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert [r for r in runs if "nox" in r and "pip" not in r] == [
        "nox -s changepoints -- --machine h200 --out outputs/changepoints"
    ]
    assert job["steps"][-1]["with"]["name"] == "changepoints"


def test_the_bisection_runs_main_commits_on_the_trusted_runner_bounded_and_without_a_token():
    job = WORKFLOWS["history.yml"]["jobs"]["bisect"]
    assert job["needs"] == ["drift", "changepoints"]  # never beside drift on the GPU node
    assert (
        "github.ref == 'refs/heads/main'" in job["if"]
        and "needs.changepoints.result == 'success'" in job["if"]
    )
    assert all(trusted(n) for n in runners(job)) and runners(job) == runners(
        WORKFLOWS["history.yml"]["jobs"]["drift"]
    )
    assert (
        job["permissions"] == {"contents": "read"} and job["steps"][0]["with"]["persist-credentials"] is False
    )
    (run,) = [s["run"] for s in job["steps"] if "run" in s]
    assert "python3 -m nox -s bisect -- --steps changepoints/steps.json" in run
    assert '--within "$GITHUB_SHA"' in run and "--max-calls 4" in run  # main's first-parent line only
    assert '--budget-s "$((BUDGET_MINUTES * 60))"' in run and "timeout --kill-after=2m" in run
    assert int(job["env"]["BUDGET_MINUTES"]) + 15 + 2 < job["timeout-minutes"]
    assert not any("secrets." in str(v) or "github.token" in str(v) for v in job.get("env", {}).values())


def test_only_release_tags_reach_asv_and_drift_takes_the_first_parent_release():
    jobs = WORKFLOWS["history.yml"]["jobs"]
    runs = [s.get("run", "") for s in jobs["publish"]["steps"]]
    drop = runs.index("python3 src/rmsnorm_suite/history.py tags")
    assert drop < runs.index("nox -s history"), "tags are dropped before asv publish reads them"
    drift = next(s["run"] for s in jobs["drift"]["steps"] if "-s drift" in s.get("run", ""))
    assert "history.py baseline" in drift and "git describe" not in drift


DEPLOY = ROOT / "deploy"


def test_untrusted_pods_reach_only_dns_and_the_github_proxy():
    docs = list(
        yaml.safe_load_all((DEPLOY / "network" / "untrusted-egress.yaml").read_text(encoding="utf-8"))
    )
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    untrusted = yaml.safe_load((ARC_DIR / "h200-untrusted.yaml").read_text(encoding="utf-8"))
    assert policy["metadata"]["namespace"] == "arc-untrusted" and policy["spec"]["podSelector"] == {}
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["ingress"] == []
    targets = [(rule["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                sorted(p["port"] for p in rule["ports"])) for rule in policy["spec"]["egress"]]  # fmt: skip
    assert targets == [("kube-system", [53, 53]), ("egress-proxy", [3128])]
    assert all(len(rule["to"]) == 1 and "ipBlock" not in rule["to"][0] for rule in policy["spec"]["egress"])
    env = {e["name"]: e["value"] for e in untrusted["template"]["spec"]["containers"][0]["env"]}
    assert env["HTTPS_PROXY"] == "http://github-proxy.egress-proxy.svc.cluster.local:3128"
    allow = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["squid.conf"]
    assert allow.strip().splitlines()[-2:] == ["http_access deny all", "http_port 3128"]


def test_the_runner_image_has_no_sudo():
    text = (DEPLOY / "runner-image" / "Dockerfile").read_text(encoding="utf-8")
    last_user = re.findall(r"(?m)^USER (\S+)", text)[-1]
    assert last_user == "runner"
    assert (
        "apt-get purge -y sudo" in text and "rm -f /etc/sudoers.d/*" in text and "! command -v sudo" in text
    )
    assert "NOPASSWD" not in text


def test_the_fallback_runner_resets_home_and_keeps_the_token_off_command_lines():
    text = (DEPLOY / "single-machine" / "ephemeral-runner.sh").read_text(encoding="utf-8")
    clean = text[text.index("clean() {") : text.index("\n}\n", text.index("clean() {"))]
    for needed in ('rm -rf "$home"', "cp -a /etc/skel", "crontab -r -u", "pkill -KILL -u", "atrm"):
        assert needed in clean, needed
    assert "--token" not in text and "RUNNER_TOKEN_COMMAND" not in text and "bash -c" not in text
    assert 'ACTIONS_RUNNER_INPUT_TOKEN=$(<"$RUNNER_TOKEN_FILE")' in text and '"0 600"' in text
    unit = (DEPLOY / "single-machine" / "ephemeral-runner.service").read_text(encoding="utf-8")
    assert "RUNNER_TOKEN_FILE=" in unit


@pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("runuser") is None, reason="needs bash, runuser"
)
def test_the_fallback_refuses_a_token_file_others_can_read(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret")
    token.chmod(0o644)
    env = {"PATH": "/usr/bin:/bin", "RUNNER_HOME": str(tmp_path / "none"), "RUNNER_URL": "https://github.com/o",
           "RUNNER_LABEL": "h200-untrusted", "RUNNER_USER": "nobody-such-user-xyz", "RUNNER_TOKEN_FILE": str(token)}  # fmt: skip
    done = subprocess.run(["bash", str(DEPLOY / "single-machine" / "ephemeral-runner.sh")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "must be owned by root with mode 0600" in done.stderr


def test_download_patterns_are_plain_globs():
    """A download-artifact pattern holds no brace set or extglob: what it matches must not depend
    on the matcher's options. Two names are two steps."""
    for name, wf in WORKFLOWS.items():
        for job_id, job in wf["jobs"].items():
            for step in job.get("steps", []):
                if step.get("uses", "").startswith("actions/download-artifact@"):
                    pattern = str(step.get("with", {}).get("pattern", ""))
                    assert not set(pattern) & set("{}()!+@,"), (name, job_id, pattern)
