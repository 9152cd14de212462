"""Rehearse the trusted judge and the gate's statistics on a GPU, one command each.

    PYTHONPATH=src python tools/gate_rehearsal.py WHAT [--shapes large] [--rounds R] [--samples S]

WHAT: hostile (a slowed head that rewrites gate, thresholds and harness: REGRESSION), aa
(``--aa-runs`` A/A runs: pass), ab (a slower head: every large device row of the slowed pass
flagged; ``--slow forward|backward --percent P``), host (no compiled host path: host rows flagged,
device rows not), catalogue and features (tests/suite/hostile_catalogue.py's heads: REGRESSION or
error, nothing left behind), overhead (seconds a sandbox adds). Commits are built in a temporary
repository; verdicts go under ``outputs/rehearsal/``; exit 0 only when every verdict is as
expected. docs/gate.md gives each rehearsal's purpose and results.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "rehearsal"

HOSTILE_OP = """
_rms_norm = rms_norm


def rms_norm(x, *args, **kwargs):  # rehearsal: an extra fp32 pass over x before every call
    x.float().sum()
    return _rms_norm(x, *args, **kwargs)
"""
EXTRA_ROWS_OP = """
_rms_norm = rms_norm


def rms_norm(x, *args, **kwargs):  # rehearsal: an extra forward over 1/{k} of the rows
    _rms_norm(x.detach()[: max(1, x.shape[0] // {k})], *args, **kwargs)
    return _rms_norm(x, *args, **kwargs)
"""
# ab --slow forward --percent P: before every call, a forward over P% of the rows (at least one):
# P% more forward device work, plus one launch.
SLOW_FORWARD_OP = """
_rms_norm = rms_norm


def rms_norm(x, *args, **kwargs):  # rehearsal: a forward over {percent}% more rows
    _rms_norm(x.detach()[: max(1, round(x.shape[0] * {fraction!r}))], *args, **kwargs)
    return _rms_norm(x, *args, **kwargs)
"""
# ab --slow backward --percent P: the output goes through an identity whose backward redoes the
# op's forward and backward over a share q of the rows. The forward moves 2 tensors the size of x
# (x read, y written), the backward 3 (x and dy read, dx written), so q = P/100 * 3/5 makes the
# extra bytes P% of the backward's; the forward is unchanged (no extra launch, no extra bytes).
SLOW_BACKWARD_OP = """
import torch as _torch

_rms_norm = rms_norm
_SLOW_SHARE = {fraction!r} * 3 / 5  # of the rows: P% of the backward's bytes (tools/gate_rehearsal.py)


class _SlowBackward(_torch.autograd.Function):  # rehearsal: the backward does {percent}% more work
    @staticmethod
    def forward(ctx, y, x, args, kwargs):
        ctx.x, ctx.args, ctx.kwargs = x.detach(), args, kwargs
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        n = max(1, round(ctx.x.shape[0] * _SLOW_SHARE))
        with _torch.enable_grad():
            xs = ctx.x[:n].clone().requires_grad_()
            _torch.autograd.grad(_rms_norm(xs, *ctx.args, **ctx.kwargs), xs, dy[:n])
        return dy, None, None, None


def rms_norm(x, *args, **kwargs):
    y = _rms_norm(x, *args, **kwargs)
    if not (_torch.is_grad_enabled() and isinstance(y, _torch.Tensor) and y.requires_grad):
        return y
    return _SlowBackward.apply(y, x, args, kwargs)
"""
SLOW_OPS = {"forward": SLOW_FORWARD_OP, "backward": SLOW_BACKWARD_OP}


def slow_patch(which: str, percent: float) -> str:
    """The text ``ab --slow WHICH --percent P`` appends to rmsnorm_kernel/__init__.py."""
    if which not in SLOW_OPS or not 0 < percent <= 100:
        raise ValueError(f"--slow {which} --percent {percent}: forward or backward, 0 < P <= 100")
    return SLOW_OPS[which].format(percent=f"{percent:g}", fraction=percent / 100)


PYTHON_HOST = """


def mode():  # rehearsal: the compiled host path lost, the Python host path serves every call
    return "python"
"""
HOSTILE_GATE = """

def _verdict(rows, base, head, th):  # rehearsal: every verdict a pass
    return Verdict("pass", "PASS: all checks pass", rows, {}, {}, th.source)
"""
HOSTILE_HARNESS = """

def time_cuda(call, samples, **kwargs):  # rehearsal: constant timings
    return [1e-3] * samples


def time_graph(graph, reps, samples, flush=None):
    return [1e-3] * samples
"""


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=rehearsal", "-c", "user.email=rehearsal@example.com", *args],
        cwd=repo, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def make_repo(tmp: Path) -> tuple[Path, str]:
    """A repository whose one commit holds this tree's op and suite."""
    repo = tmp / "repo"
    for package in ("rmsnorm_kernel", "rmsnorm_suite"):
        shutil.copytree(
            ROOT / "src" / package, repo / "src" / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base: this tree")
    return repo, git(repo, "rev-parse", "HEAD")


def commit_on(repo: Path, base: str, edits: dict[str, str], message: str) -> str:
    """A commit on top of ``base`` with text appended to files, or a file's text replaced ("=" key prefix)."""
    git(repo, "checkout", "-q", "--detach", base)
    for name, text in edits.items():
        path = repo / name.removeprefix("=")
        path.write_text(text if name.startswith("=") else path.read_text() + text)
    git(repo, "commit", "-q", "-am", message)
    return git(repo, "rev-parse", "HEAD")


def pr_verdict(args, repo: Path, base: str, head: str, name: str, gpu_tests: bool = False) -> dict:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rmsnorm_suite", "pr-verdict", "--repo", str(repo), "--base", base]
    t0 = time.time()
    run = [
        "--shapes",
        *args.shapes,
        "--rounds",
        str(args.rounds),
        "--samples",
        str(args.samples),
        *([] if gpu_tests else ["--skip-gpu-tests"]),
    ]
    done = subprocess.run([*cmd, "--head", head, "--out", str(out), *run], cwd=ROOT)
    data = json.loads((out / "verdict.json").read_text()) if (out / "verdict.json").is_file() else {}
    data["exit"], data["wall_s"] = done.returncode, round(time.time() - t0)
    base_path, head_path = host_paths(data)
    print(f"== {name}: exit {done.returncode}, {data['wall_s']} s: {data.get('summary')}", flush=True)
    print(f"   op host path: base {base_path}, head {head_path}", flush=True)
    for row in data.get("rows", []):
        if row["kind"] == "latency" and row.get("ratio") is not None:
            print(
                f"   {row['check']:<48} ratio {row['ratio']:.4f} [{row['ci_low']:.4f}, {row['ci_high']:.4f}]"
                f" p={row['p_value']:.2g} > {row['threshold']} : {row['verdict']}"
            )
    for row in data.get("rows", []):
        if row["kind"] == "run":
            print(f"   {row['check']:<48} {row['verdict']}: {row.get('note', '')[:160]}")
    return data


def host_paths(data: dict) -> list:
    """[base, head]: the host path each side's op took, as the verdict records it."""
    return [(data.get(side) or {}).get("op_host_path") for side in ("base", "head")]


def hostile(args, repo: Path, base: str) -> list[str]:
    toml = (repo / "src/rmsnorm_suite/regression.toml").read_text()
    head = commit_on(
        repo,
        base,
        {
            "src/rmsnorm_kernel/__init__.py": HOSTILE_OP,
            "src/rmsnorm_suite/gate.py": HOSTILE_GATE,
            "src/rmsnorm_suite/timing.py": HOSTILE_HARNESS,
            "=src/rmsnorm_suite/regression.toml": re.sub(r"factor = [0-9.]+", "factor = 1000.0", toml),
        },
        "hostile: slower op; gate, thresholds and harness rewritten to pass",
    )
    data = pr_verdict(args, repo, base, head, "hostile")
    return [] if data.get("status") == "regression" else [f"hostile head: {data.get('summary')}"]


def aa(args, repo: Path, base: str) -> list[str]:
    problems = []
    for k in range(args.aa_runs):
        data = pr_verdict(args, repo, base, base, f"aa-{k}")
        if data.get("status") != "pass":
            problems.append(f"A/A {k}: {data.get('summary')}")
        paths = host_paths(data)
        if paths != ["compiled", "compiled"]:
            problems.append(f"A/A {k}: the compiled host path was not timed on both sides: {paths}")
    return problems


def ab(args, repo: Path, base: str) -> list[str]:
    problems = []
    if args.slow:
        op, what = slow_patch(args.slow, args.percent), f"{args.percent:g}% more {args.slow} work"
        name, mode = f"ab-{args.slow}-{args.percent:g}", " forward" if args.slow == "forward" else "_backward"
    else:
        op, what = EXTRA_ROWS_OP.format(k=args.extra_rows), f"a forward over 1/{args.extra_rows} more rows"
        name, mode = "ab-extra-rows", " forward"
    head = commit_on(repo, base, {"src/rmsnorm_kernel/__init__.py": op}, what)
    data = pr_verdict(args, repo, base, head, name)
    rows = [r for r in data.get("rows", []) if r["check"].startswith("device ") and r["check"].endswith(mode)]
    missed = [r["check"] for r in rows if r["verdict"] != "regression"]
    if not rows or missed:
        problems.append(f"A/B ({what}): device{mode} rows not flagged: {missed or 'none judged'}")
    return problems


def host(args, repo: Path, base: str) -> list[str]:
    head = commit_on(
        repo, base, {"src/rmsnorm_kernel/host/__init__.py": PYTHON_HOST}, "the Python host path only"
    )
    data = pr_verdict(args, repo, base, head, "host-python")
    rows = [r for r in data.get("rows", []) if r["kind"] == "latency"]
    forward = [r for r in rows if r["check"].startswith("host ") and r["check"].endswith(" forward")]
    missed = [r["check"] for r in forward if r["verdict"] != "regression"]
    device = [r["check"] for r in rows if r["check"].startswith("device ") and r["verdict"] == "regression"]
    problems = []
    if not forward or missed:
        problems.append(f"host: host-time forward rows not flagged: {missed or 'none judged'}")
    if device:
        problems.append(f"host: device rows flagged, though the GPU work is the same: {device}")
    paths = host_paths(data)
    if paths != ["compiled", "python"]:
        problems.append(f"host: expected base compiled and head python, got {paths}")
    return problems


def catalogue(args, repo: Path, base: str) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from tests.suite import hostile_catalogue as cat

    token, problems = f"rmsnorm-hostile-{time.time_ns()}", []
    heads: dict[str, tuple[str, bool]] = {}
    init = "src/rmsnorm_kernel/__init__.py"
    for name in cat.ATTACKS:
        code = cat.attack(name, str(OUT / name / "verdict.json"), str(OUT / f"{name}.marker"), token)
        heads[name] = (commit_on(repo, base, {init: HOSTILE_OP + code}, name), False)
    git(repo, "checkout", "-q", "--detach", base)
    (repo / "src/rmsnorm_kernel/ops.py").unlink()
    (repo / "src/rmsnorm_kernel/ops.py").symlink_to("/etc/hostname")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", cat.LINKED_MODULE)
    heads[cat.LINKED_MODULE] = (git(repo, "rev-parse", "HEAD"), False)
    git(repo, "checkout", "-q", "--detach", base)
    shutil.move(repo / "src/rmsnorm_kernel", repo / "elsewhere")
    (repo / "src/rmsnorm_kernel").symlink_to("../elsewhere")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", cat.LINKED_PACKAGE)
    heads[cat.LINKED_PACKAGE] = (git(repo, "rev-parse", "HEAD"), False)
    marker = OUT / f"{cat.HEAD_CONFTEST}.marker"
    conftest = {"=tests/__init__.py": "", "=tests/test_head.py": cat.FAILING_GPU_TEST,
                "=tests/conftest.py": cat.CONFTEST.format(marker=marker), init: HOSTILE_OP}  # fmt: skip
    git(repo, "checkout", "-q", "--detach", base)
    (repo / "tests").mkdir(exist_ok=True)
    for name in conftest:
        (repo / name.removeprefix("=")).touch()
    git(repo, "add", "-A")
    heads[cat.HEAD_CONFTEST] = (commit_on(repo, git(repo, "commit", "-q", "-m", "t") or git(repo, "rev-parse", "HEAD"),
                                          conftest, cat.HEAD_CONFTEST), True)  # fmt: skip
    for name, (head, gpu_tests) in heads.items():
        if args.only and name not in args.only:
            continue
        data = pr_verdict(args, repo, base, head, name, gpu_tests=gpu_tests)
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout.split()
        before = len(problems)
        if data.get("status") not in ("regression", "error"):
            problems.append(f"{name}: {data.get('summary')}")
        watch = next((r for r in data.get("rows", []) if r["check"] == "stopwatch"), {})
        if name in cat.STOPWATCH_ONLY and watch.get("verdict") not in ("regression", "error"):
            problems.append(f"{name}: the stopwatch did not see it: {watch.get('note')}")
        if left or (OUT / f"{name}.marker").exists():
            problems.append(f"{name}: a process of the head outlived its sandbox: {left}")
        if "forged" in (
            (OUT / name / "verdict.json").read_text() if (OUT / name / "verdict.json").is_file() else ""
        ):
            problems.append(f"{name}: the verdict file was rewritten")
        # said per head, so that a run cut short still leaves each finished head's outcome
        print(f"   {name}: survivors {left or 'none'}, marker {(OUT / f'{name}.marker').exists()}, "
              f"{'as expected' if len(problems) == before else 'NOT AS EXPECTED'}", flush=True)  # fmt: skip
    return problems


def features(args, repo: Path, base: str) -> list[str]:
    """The feature rows' attacks through pr-verdict on this machine's device: the control head
    (batch dependent, nothing else) regresses on batch invariance; every attack ends REGRESSION
    or error, its batch invariance row never `pass`. Base: the stand-in op (not this tree's)."""
    sys.path.insert(0, str(ROOT))
    from tests.suite import _fixtures as fx
    from tests.suite import hostile_catalogue as cat

    repo, base, heads = fx.attack_heads_repo(
        repo.parent / "features", fx.INIT, fx.OPS_RESIDUAL, fx.MANY_ROW_PLAN, cat.FEATURE_ATTACKS
    )
    problems = []
    for name, head in heads.items():
        if args.only and name not in args.only:
            continue
        data = pr_verdict(args, repo, base, head, f"features-{name}")
        row = next((r for r in data.get("rows", []) if r["check"] == "batch invariance"), None)
        print(f"   batch invariance: {row and row['verdict']}: {(row or {}).get('note', '')[:160]}")
        if name == "control":
            if (row or {}).get("verdict") != "regression":
                problems.append(f"control: batch invariance not flagged: {row}")
        elif data.get("status") not in ("regression", "error") or (row or {}).get("verdict") == "pass":
            problems.append(f"{name}: {data.get('summary')}; batch invariance {row and row['verdict']}")
    return problems


def overhead(args, repo: Path, base: str) -> list[str]:
    """Seconds a sandbox adds to a process that starts CUDA: the same command plain and
    sandboxed, alternated, ``--aa-runs`` times each; prints the medians."""
    from rmsnorm_suite import sandbox

    code = "import torch; torch.zeros(1, device='cuda').sum().item()"
    times: dict[str, list[float]] = {"plain": [], "sandboxed": []}
    with tempfile.TemporaryDirectory(prefix="rmsnorm-overhead-") as tmp:
        box = sandbox.Sandbox(Path(tmp, "root"), {}, Path(tmp, "state"))
        box.root.mkdir()
        for _ in range(args.aa_runs):
            for kind, cmd in (("plain", [sys.executable, "-I", "-c", code]),
                              ("sandboxed", sandbox.command(box, [sys.executable, "-I", "-c", code]))):  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True)
                times[kind].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"== overhead: plain {med['plain']:.3f} s, sandboxed {med['sandboxed']:.3f} s per process "
          f"(medians of {args.aa_runs}); {times}")  # fmt: skip
    return []


REHEARSALS = {
    "hostile": hostile,
    "aa": aa,
    "ab": ab,
    "host": host,
    "catalogue": catalogue,
    "features": features,
    "overhead": overhead,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=list(REHEARSALS))
    parser.add_argument("--aa-runs", type=int, default=2, help="A/A runs (aa)")
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="HEAD", help="catalogue, features: these heads alone"
    )
    parser.add_argument("--extra-rows", type=int, default=20, help="A/B head: extra forward over 1/K rows")
    parser.add_argument(
        "--slow", choices=sorted(SLOW_OPS), default=None, help="A/B head: P%% more forward or backward work"
    )
    parser.add_argument("--percent", type=float, default=5.0, help="--slow's P (default 5)")
    parser.add_argument(
        "--shapes", nargs="+", default=["large"], help="pr-verdict's --shapes (default: large)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="pr-verdict's --rounds (default 4; host: 6)")
    parser.add_argument(
        "--samples", type=int, default=None, help="pr-verdict's --samples (default 50; host: 100)"
    )
    args = parser.parse_args()
    # host: pr-verdict's own defaults; with 4 rounds of 30 the 99% bound flagged 1 of 4 small
    # forwards that were 2.3-3.1x slower in host time (docs/gate.md)
    host_defaults = args.what == "host"
    args.rounds = args.rounds or (6 if host_defaults else 4)
    args.samples = args.samples or (100 if host_defaults else 50)
    with tempfile.TemporaryDirectory(prefix="rmsnorm-rehearsal-") as tmp:
        repo, base = make_repo(Path(tmp))
        problems = REHEARSALS[args.what](args, repo, base)
    for problem in problems:
        print(f"NOT AS EXPECTED: {problem}")
    print("rehearsal:", "as expected" if not problems else f"{len(problems)} unexpected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
