"""``python3 -m nox -s NAME -- ...`` as the rehearsal runs it: the wiring, not the judge.

``pr_verdict`` (GPU) is stubbed to a second: the verdict the head commit asks for in its
``REHEARSE`` file (pass, regression, crash: none and exit 1; fail-after-pass: pass, then exit 1)
in the gate's format. ``bisect`` (GPU) is the real search (rmsnorm_suite.bisection of the
checkout), each probe this pr_verdict. ``changepoints`` and ``history`` (CPU) are the real sessions,
with ``--no-venv --no-install`` in ``$REHEARSE_PYTHON``; history's page test without the three
tests that render the page in Chromium (PAGE_RENDERING). Any other NAME fails: not covered.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def row(check: str, verdict: str, ratio: float) -> dict:
    return {"check": check, "verdict": verdict, "kind": "latency", "base": 0.0500, "head": 0.05 * ratio,
            "ratio": ratio, "threshold": 1.03, "ci_low": ratio - 0.01, "ci_high": ratio + 0.01,
            "confidence": 0.95}  # fmt: skip


# The page test's tests that open the page in headless Chromium: asv's page loads its scripts
# from public CDNs, which an offline run cannot reach (local copies come from npm through
# tools/fetch_asv_js.sh). The page test's other tests (graphs with data, accepted.html linked) run.
PAGE_TEST = "tests/suite/test_asv_page.py"
PAGE_RENDERING = ("test_benchmarks_are_listed", "test_a_graph_renders", "test_one_shape_per_graph_by_link")


def real_session(argv: list[str]) -> int:
    """The real session (the checkout's noxfile), no virtualenv and nothing installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the real nox, not this stub
    if argv[:2] == ["-s", "history"]:
        # no tests/conftest.py (it imports torch, which the rehearsal's Python need not have; the
        # page test uses none of its fixtures), and the rendering tests deselected, by name
        deselect = " ".join(f"--deselect {PAGE_TEST}::{name}" for name in PAGE_RENDERING)
        env["PYTEST_ADDOPTS"] = f"--noconftest -p no:cacheprovider {deselect}"
    python = os.environ.get("REHEARSE_PYTHON") or sys.executable
    return subprocess.run([python, "-m", "nox", "--no-venv", "--no-install", *argv], env=env).returncode


def bisect(argv: list[str]) -> int:
    """The real search over the checkout; each probe is ``-s pr_verdict`` (this stub), base=good."""
    sys.path.insert(0, str(Path("src").resolve()))
    from rmsnorm_suite import bisection

    parser = argparse.ArgumentParser(prog="nox -s bisect --")
    bisection.configure(parser, "bisect")
    args = parser.parse_args(argv[3:] if argv[2:3] == ["--"] else argv[2:])

    def judge(base: str, head: str) -> bool:
        folder = Path(args.out) / "probes" / head[:12]
        subprocess.run([sys.executable, "-m", "nox", "-s", "pr_verdict", "--", "--base", base, "--head", head,
                        "--out", str(folder), "--deadline-s", f"{args.deadline_s or 900:g}"])  # fmt: skip
        try:
            status = json.loads((folder / "verdict.json").read_text(encoding="utf-8"))["status"]
        except (OSError, ValueError, KeyError) as exc:
            raise bisection.JudgeError(f"no verdict for {head[:12]}: {exc}") from None
        return status == "regression"

    return bisection.run(args, judge)


def main() -> int:
    argv = sys.argv[1:]
    if argv[:2] in (["-s", "changepoints"], ["-s", "history"]):
        return real_session(argv)
    if argv[:2] == ["-s", "bisect"]:
        return bisect(argv)
    if argv[:2] != ["-s", "pr_verdict"]:
        print(f"rehearsal nox stub: no stand-in for {' '.join(argv[:2])}", file=sys.stderr)
        return 3
    parser = argparse.ArgumentParser()
    for name in ("--base", "--head", "--out", "--deadline-s"):
        parser.add_argument(name, required=True)
    args = parser.parse_args(argv[3:] if argv[2:3] == ["--"] else argv[2:])
    try:
        mode = git("show", f"{args.head}:REHEARSE").strip() or "pass"
    except subprocess.CalledProcessError:
        mode = "pass"
    print(f"rehearsal nox stub: pr_verdict of {args.head[:12]} against {args.base[:12]}: {mode}")
    if mode == "crash":
        return 1
    status = "regression" if mode == "regression" else "pass"
    rows = [row("latency 4096x4096-bfloat16 forward", status, 1.08 if status == "regression" else 1.0),
            row("device 4096x4096-bfloat16 forward", "pass", 1.0)]  # fmt: skip
    verdict = {"status": status, "rows": rows, "base_sha": git("merge-base", args.base, args.head),
               "base_ref_sha": args.base, "head_sha": args.head}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict.json").write_text(json.dumps(verdict), encoding="utf-8")
    (out / "verdict.md").write_text(f"# rehearsal verdict: {status}\n", encoding="utf-8")
    return 1 if status == "regression" or mode == "fail-after-pass" else 0


if __name__ == "__main__":
    sys.exit(main())
