"""pr-verdict end to end on CPU: a real git repository, real worktrees and worker processes, the
timing stood in by the worker's host clock (``timing: host``). The judge is the suite under
test; the commits only supply an op. A hostile head that slows its op and rewrites the gate,
the thresholds, the harness and the worker of its own tree still gets REGRESSION."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import types
from pathlib import Path

import pytest

from rmsnorm_suite import cli, harness, pullrequest, results, sandbox, staging, worker
from tests.suite._fixtures import INIT, OPS, SLOW_S, BaseRounds, commit, git, pr_verdict

# Any of the head's suite files, if imported, leaves a marker and would judge everything a pass.
HOSTILE = (
    "import os, pathlib\n"
    "pathlib.Path(os.environ['RMSNORM_TEST_MARKER']).write_text(__name__)\n"
    "def judge(*args, **kwargs):\n    raise SystemExit(0)\n"
)
LOOSE = "[gate]\nmin_samples = 2\n[latency.large.forward]\nfactor = 1000.0\nalpha = 0.5\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """old: the op and the suite in one package (before the split), fast. main: the split layout,
    its op slow (main moved on). hostile: branched from old, slow op, and its own gate, harness,
    worker and thresholds rewritten to pass, in both layouts' places."""
    repo = tmp_path_factory.mktemp("prv") / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    op = "src/rmsnorm_kernel/"
    old = commit(
        repo,
        {op + "__init__.py": INIT, op + "ops.py": OPS.format(cost=0.0), op + "gate.py": HOSTILE,
         op + "bench.py": HOSTILE, "regression.toml": LOOSE},
        "old layout",
    )  # fmt: skip
    git(repo, "rm", "-q", op + "gate.py", op + "bench.py", "regression.toml")
    main = commit(
        repo,
        {op + "ops.py": OPS.format(cost=SLOW_S), "src/rmsnorm_suite/__init__.py": "",
         "src/rmsnorm_suite/regression.toml": LOOSE},
        "split layout, slower op",
    )  # fmt: skip
    git(repo, "checkout", "-q", "-b", "pr", old)
    suite = "src/rmsnorm_suite/"
    hostile = commit(
        repo,
        {op + "ops.py": OPS.format(cost=SLOW_S), op + "gate.py": HOSTILE, op + "bench.py": HOSTILE,
         op + "worker.py": HOSTILE, suite + "__init__.py": HOSTILE, suite + "gate.py": HOSTILE,
         suite + "bench.py": HOSTILE, suite + "harness.py": HOSTILE, suite + "timing.py": HOSTILE,
         suite + "providers.py": HOSTILE, suite + "worker.py": HOSTILE, suite + "regression.toml": LOOSE,
         "regression.toml": LOOSE},
        "slow op; the gate, harness and thresholds rewritten to pass",
    )  # fmt: skip
    git(repo, "checkout", "-q", "main")
    return repo, {"old": old, "main": main, "hostile": hostile}


def test_hostile_head_is_judged_by_the_trusted_gate(repo, host_timing, tmp_path):
    repo, shas = repo
    out = tmp_path / "verdict"
    assert pr_verdict(repo, shas["main"], shas["hostile"], out) == 1
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "regression", data["summary"]
    assert not host_timing.exists(), f"the head's suite was imported: {host_timing.read_text()}"
    assert data["thresholds"].endswith("thresholds-cpu.toml")
    flagged = {r["check"] for r in data["rows"] if r["verdict"] == "regression"}
    assert (
        "device 32768x4096-bfloat16 forward" in flagged and "latency 32768x4096-bfloat16 forward" in flagged
    )
    # compared with the merge-base (old, fast), not main's tip (as slow as head)
    assert (data["base_ref_sha"], data["base_sha"], data["head_sha"]) == (
        shas["main"], shas["old"], shas["hostile"]
    )  # fmt: skip
    assert data["pr"]["base"] == shas["old"] and data["pr"]["rounds"] == 3
    rows = [r for r in data["rows"] if r["kind"] == "latency"]
    # 3 ms of sleep on a µs call: every latency row flagged, its bound far above any factor (a
    # loaded machine stretches the base's times too, so the bound is not held to the ideal ratio)
    assert all(r["rounds"] == 3 and r["verdict"] == "regression" and r["ci_low"] > 2 for r in rows), rows
    head0 = json.loads((out / "rounds" / "head-0.json").read_text())  # written by the judge
    assert head0["label"] == "head" and head0["settings"]["timing"] == "host stand-in"
    assert git(repo, "worktree", "list").count("\n") == 0  # no worktree was made


def test_same_commit_passes(repo, host_timing, tmp_path):
    repo, shas = repo
    out = tmp_path / "verdict"
    assert pr_verdict(repo, shas["main"], shas["main"], out, features=True) == 0
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "pass" and data["base_sha"] == data["head_sha"] == shas["main"]
    # the stand-in op's rows are batch invariant: the worker's figure is judged, and passes
    assert [(r["verdict"], r["head"]) for r in data["rows"] if r["check"] == "batch invariance"] == [
        ("pass", 0)
    ]


def test_eps_on_the_command_line_reaches_the_harness_and_the_verdict(
    repo, host_timing, tmp_path, monkeypatch
):
    """--eps is in every round's spec; the worker builds the op and the oracle with it (both
    sides' results record it) and hands it to the harness (here a stand-in that records the call:
    host rounds time without the harness); verdict.json records it."""
    repo, shas = repo
    specs = []
    real_round = pullrequest.run_round

    def run_round(box, spec, *args, **kwargs):
        specs.append(copy.deepcopy(spec))
        return real_round(box, spec, *args, **kwargs)

    monkeypatch.setattr(pullrequest, "run_round", run_round)
    out = tmp_path / "verdict"
    pr_verdict(
        repo,
        shas["main"],
        shas["main"],
        out,
        "--eps",
        "1e-5",
        "--rounds",
        "2",
        "--modes",
        "forward",
        "--samples",
        "8",
    )
    assert [spec["eps"] for spec in specs] == [1e-5] * 4
    assert json.loads((out / "verdict.json").read_text())["pr"]["eps"] == 1e-5
    for side in ("base", "head"):
        assert results.load(out / f"{side}.json").settings["eps"] == 1e-5

    handed = []
    monkeypatch.setattr(harness, "run_benchmarks", lambda *args, **kwargs: handed.append(kwargs["eps"]))
    worker.run_round({**specs[0], "timing": "cuda"})
    assert handed == [1e-5]


def _answered_round(tmp_path, monkeypatch, edit):
    """run_round over a stand-in sandbox that answers with an honest host round's results, edited
    by ``edit`` (the worker's word), its ready line and one well-formed answer per block."""
    from rmsnorm_suite import exchange, providers, stopwatch

    def build(eps):
        return lambda x, w: x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w

    monkeypatch.setattr(providers, "get_provider", lambda name: types.SimpleNamespace(build=build))
    spec = {
        "cases": [harness.case_to_json(c) for c in harness.select_cases(["128x257-float32"])],
        "modes": ["forward"], "samples": 2, "eps": 1e-5, "timing": "host",
        "label": "head", "round": 0, "commit": "a" * 40,
    }  # fmt: skip
    run = worker.host_stand_in(spec)
    run = dataclasses.replace(
        run, label="head", round=0, settings={**run.settings, "calibration_ms": [1.0, 1.0]}
    )
    data = edit(run.to_json())
    blocks = stopwatch.plan(
        [harness.case_from_json(c) for c in spec["cases"]], spec["modes"], "host", worker.HOST_SHAPE
    )
    seeds = list(range(1, len(blocks) + 2))
    lines = [json.dumps(data), json.dumps({"ready": seeds[0]})] + [
        json.dumps({"go": s, "sums": [1.0] * (2 * stopwatch.outputs(b))}) for b, s in zip(blocks, seeds[1:])
    ]
    answer = exchange.Answer(0, "", "", lines, [0.001] * len(seeds))
    monkeypatch.setattr(exchange, "sandboxed", lambda *args, **kwargs: answer)
    return pullrequest.run_round(None, spec, tmp_path / "log", 60.0, (), seeds=seeds)


def test_a_round_is_taken_with_the_eps_of_its_spec(tmp_path, monkeypatch):
    run, problem = _answered_round(tmp_path, monkeypatch, lambda data: data)
    assert problem is None and run.settings["eps"] == 1e-5


@pytest.mark.parametrize("eps", [1e-6, None, "1e-5"])
def test_a_round_that_reports_another_eps_is_refused(tmp_path, monkeypatch, eps):
    """The eps verdict.json records (pr.eps) is the spec's; results that name another one, or
    none, are not that round's."""

    def edit(data):
        if eps is None:
            del data["settings"]["eps"]
        else:
            data["settings"]["eps"] = eps
        return data

    run, problem = _answered_round(tmp_path, monkeypatch, edit)
    assert run is None and "eps" in problem, problem


@pytest.mark.parametrize("approved_by", [None, "maintainer"])
def test_accept_regression_is_read_from_git_and_needs_approval(
    repo, host_timing, shared_base, tmp_path, approved_by
):
    """A trailer in the judged commits is a request; only the caller's approval grants it, and a
    grant bounds the row at the accepted factor (this head is far past it: still a regression)."""
    repo, shas = repo
    git(repo, "checkout", "-q", "-b", f"accept-{approved_by}", shas["old"])
    trailer = "Accept-Regression: latency 32768x4096-bfloat16 forward 1.10 a slower, fixed variance"
    head = commit(repo, {"src/rmsnorm_kernel/ops.py": OPS.format(cost=SLOW_S)}, f"slower\n\n{trailer}")
    git(repo, "checkout", "-q", "main")
    out = tmp_path / "verdict"
    extra = ["--modes", "forward"] + (["--accept-approved-by", approved_by] if approved_by else [])
    assert pr_verdict(repo, shas["old"], head, out, *extra) == 1
    data = json.loads((out / "verdict.json").read_text())
    acceptance = data["acceptance"]
    assert [r["check"] for r in acceptance["requested"]] == ["latency 32768x4096-bfloat16 forward"]
    if approved_by is None:
        assert acceptance["granted"] == [] and acceptance["refused"][0]["why"] == "no maintainer approval"
    else:
        assert [r["approved_by"] for r in acceptance["granted"]] == ["maintainer"]
        row = next(r for r in data["rows"] if r["check"] == "latency 32768x4096-bfloat16 forward")
        assert row["verdict"] == "regression" and row["threshold"] == 1.10, row


def test_deadline_turns_a_hang_into_an_error_verdict(repo, host_timing, tmp_path):
    repo, shas = repo
    out = tmp_path / "verdict"
    assert pr_verdict(repo, shas["main"], shas["hostile"], out, "--deadline-s", "0.5") == 2
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "error"
    deadline = next(r for r in data["rows"] if r["check"] == "deadline")
    assert "deadline passed" in deadline["note"] and data["pr"]["deadline_s"] == 0.5


@pytest.mark.parametrize(
    "commit, staged",
    [
        ("old", ["__init__.py", "ops.py"]),  # the suite in the op's package: the op modules only
        ("hostile", ["__init__.py", "bench.py", "gate.py", "ops.py", "worker.py"]),  # the op's package
    ],
)
def test_stage_op_takes_the_op_alone(repo, tmp_path, commit, staged):
    repo, shas = repo
    path = staging.stage_op(repo, shas[commit], tmp_path / "path")
    assert sorted(p.name for p in (path / "rmsnorm_kernel").iterdir()) == staged
    assert [p.name for p in path.iterdir()] == ["rmsnorm_kernel"]  # never the commit's suite


def test_base_rounds_serve_the_base_alone_and_a_copy_each_time(monkeypatch, tmp_path):
    """BaseRounds: each verdict draws the same seeds; a base round with the spec and seeds of
    one already run is served, as a copy whose change reaches no later verdict; a head's round,
    a base round on other seeds and a failed base round always run."""
    ran = []

    def judge():
        return [pullrequest.secrets.randbits(62) for _ in range(4)]

    def real_round(box, spec, log_path, timeout, hidden, watch=None, seeds=(0,)):
        ran.append((spec["label"], tuple(seeds)))
        log_path.write_text(f"{spec['label']} {seeds}", encoding="utf-8")
        return (results.Run((), settings={"seeds": list(seeds)}), None) if box else (None, "failed")

    monkeypatch.setattr(pullrequest, "_judge_pr", judge)
    monkeypatch.setattr(pullrequest, "run_round", real_round)
    store = BaseRounds()
    store.install(monkeypatch)
    first, second = pullrequest._judge_pr(), pullrequest._judge_pr()
    assert first == second and len(set(first)) == 4
    log = tmp_path / "log"
    played = [
        pullrequest.run_round(box, {"label": side, "round": 0}, log, 60, [], None, seeds)
        for box, side, seeds in [(1, "base", (1, 2)), (1, "head", (1, 2)), (1, "base", (1, 2)), (1, "head", (1, 2)),
                                 (1, "base", (1, 3)), (0, "base", (1, 4)), (0, "base", (1, 4))]
    ]  # fmt: skip
    assert ran == [("base", (1, 2)), ("head", (1, 2)), ("head", (1, 2)), ("base", (1, 3)), ("base", (1, 4)),
                   ("base", (1, 4))]  # fmt: skip
    assert store.served == 1 and played[2][0] == played[0][0] and played[2][0] is not played[0][0]
    played[2][0].settings["seeds"].append(0)  # a verdict changes what it was served
    served, _ = pullrequest.run_round(1, {"label": "base", "round": 0}, log, 60, [], None, (1, 2))
    assert served.settings == {"seeds": [1, 2]} and log.read_text() == "base (1, 2)"


def test_stage_op_reads_git_objects_not_the_worktree(tmp_path):
    """The split layout's whole package comes along (csrc/ and nested folders: the compiled host
    path), from git's objects: an untracked or modified file in the worktree is not staged, and a
    link anywhere in the package is refused."""
    repo = tmp_path / "repo"
    package = repo / "src" / "rmsnorm_kernel"
    (package / "csrc" / "nested").mkdir(parents=True)
    (repo / "src" / "rmsnorm_suite").mkdir()
    (repo / "src" / "rmsnorm_suite" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "csrc" / "host.cpp").write_text("// the host path")
    (package / "csrc" / "nested" / "more.cpp").write_text("// nested")
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "op")
    sha = git(repo, "rev-parse", "HEAD")
    (package / "csrc" / "host.cpp").write_text("// modified, not committed")
    (package / "untracked.py").write_text("")
    staged = staging.stage_op(repo, sha, tmp_path / "path") / "rmsnorm_kernel"
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file()) == [
        "__init__.py", "csrc/host.cpp", "csrc/nested/more.cpp"
    ]  # fmt: skip
    assert (staged / "csrc" / "host.cpp").read_text() == "// the host path"
    (package / "csrc" / "link.cpp").symlink_to(tmp_path / "secret.txt")
    linked = commit(repo, {}, "a link")
    with pytest.raises(ValueError, match=r"csrc/link.cpp \(a link\)"):
        staging.stage_op(repo, linked, tmp_path / "elsewhere")


def test_the_staged_op_finds_its_host_source(tmp_path):
    """This checkout's op, staged as pr-verdict stages it: host's SOURCE is there to build."""
    root = Path(__file__).resolve().parents[2]
    path = staging.stage_op(root, "HEAD", tmp_path / "path")
    committed = subprocess.run(["git", "show", "HEAD:src/rmsnorm_kernel/host/csrc/host.cpp"], cwd=root,
                               capture_output=True, check=True).stdout  # fmt: skip
    assert (path / "rmsnorm_kernel" / "host" / "csrc" / "host.cpp").read_bytes() == committed


def test_worker_refuses_a_suite_from_elsewhere(repo, tmp_path):
    """Run as pr-verdict runs it, but with another suite than the one it was told to expect."""
    repo, shas = repo
    trusted = staging.stage_trusted_suite(tmp_path / "trusted")
    op = staging.stage_op(repo, shas["old"], tmp_path / "op")
    box = sandbox.Sandbox(
        pullrequest._empty(tmp_path / "root"), {"/judge/suite": op, "/judge/op": op}, tmp_path / "st"
    )
    spec = {"label": "head", "round": 0, "commit": shas["old"], "cases": [], "modes": [], "samples": 1,
            "timing": "host"}  # fmt: skip
    run, problem = pullrequest.run_round(box, spec, tmp_path / "s.log", 120, [tmp_path])
    assert run is None and (
        "import rmsnorm_suite failed" in problem or "rmsnorm_suite imported from" in problem
    )
    box = dataclasses.replace(box, readonly={"/judge/suite": trusted, "/judge/op": op})
    run, problem = pullrequest.run_round(box, spec, tmp_path / "s.log", 120, [tmp_path])
    assert problem is None and run.label == "head"


def test_a_commit_without_the_op_cannot_be_judged(repo, host_timing, tmp_path):
    repo, shas = repo
    git(repo, "checkout", "-q", "--detach", shas["main"])
    git(repo, "rm", "-q", "src/rmsnorm_kernel/__init__.py")
    no_op = commit(repo, {}, "no op")
    git(repo, "checkout", "-q", "main")
    out = tmp_path / "verdict"
    assert pr_verdict(repo, shas["main"], no_op, out) == 2
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "error" and "no src/rmsnorm_kernel/__init__.py" in data["summary"]
    assert (data["base_sha"], data["head_sha"]) == (shas["main"], no_op)


def test_no_merge_base_is_named(repo, host_timing, tmp_path):
    repo, shas = repo
    lone = tmp_path / "lone"
    lone.mkdir()
    git(lone, "init", "-q")
    other = commit(lone, {"x.txt": "x"}, "unrelated")
    git(repo, "fetch", "-q", str(lone), other)
    try:
        with pytest.raises(ValueError, match="no merge-base"):
            pr_verdict(repo, other, shas["main"], tmp_path / "v")
    finally:
        git(repo, "gc", "-q", "--prune=now")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "1"], "--rounds"),
        (["--samples", "0"], "--samples"),
        (["--deadline-s", "0"], "--deadline-s"),
        (["--eps=-1e-6"], "--eps"),
        (["--eps", "inf"], "--eps"),
        (["--eps", "nan"], "--eps"),
        (["--eps", "0"], "--eps"),
        (["--eps", "1e-320"], "--eps"),
        (["--eps", "1e300"], "--eps"),
    ],
)
def test_pr_verdict_rejects_bad_arguments(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["pr-verdict", "--base", "HEAD", "--head", "HEAD", "--out", str(tmp_path), *argv])


def test_pr_verdict_names_a_bad_commit(repo, host_timing, tmp_path):
    repo, shas = repo
    argv = ["pr-verdict", "--repo", str(repo), "--base", "no-such-rev", "--head", shas["main"]]
    with pytest.raises(ValueError, match="--base: 'no-such-rev' is not a commit"):
        cli.main([*argv, "--out", str(tmp_path / "v")])


GPU_TEST = """import pytest, time
@pytest.mark.gpu
def test_it():
    {body}
"""


@pytest.mark.parametrize(
    "body, timeout, verdict, note",
    [
        ("assert True", 120, "pass", "exit 0"),
        ("assert False", 120, "regression", "exit 1"),
        ("time.sleep(60)", 3, "error", "timed out"),
    ],
)
def test_head_gpu_tests_row(tmp_path, body, timeout, verdict, note):
    """Head's own `pytest -m gpu`, sandboxed: failures regress, a hang is cut at its limit."""
    staged = tmp_path / "staged"
    (staged / "tests").mkdir(parents=True)
    (staged / "src").mkdir()
    (staged / "tests" / "test_gpu_stand_in.py").write_text(GPU_TEST.format(body=body))
    (staged / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["gpu: CUDA"]\n')
    box = sandbox.Sandbox(pullrequest._empty(tmp_path / "root"), {"/judge/head": staged}, tmp_path / "state")
    row = pullrequest.run_gpu_tests(box, "staged", tmp_path / "log", timeout, [tmp_path])
    assert (row.check, row.verdict) == ("gpu tests (head)", verdict) and note in row.note
