"""``python3 -m nox -s pr_verdict -- ...`` as the rehearsal runs it: the wiring, not the judge.

The rehearsal checks how the jobs connect, so the GPU session is stubbed to a second: the verdict
is the one the head commit asks for in its ``REHEARSE`` file (pass, regression, crash: no verdict
and exit 1; fail-after-pass: a pass verdict, then exit 1), written in the gate's format with the
merge-base of ``--base`` and ``--head``. Every other session fails: a rehearsed job that calls
one is a job this stub does not cover.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def row(check: str, verdict: str, ratio: float) -> dict:
    return {"check": check, "verdict": verdict, "kind": "latency", "base": 0.0500, "head": 0.05 * ratio,
            "ratio": ratio, "threshold": 1.03, "ci_low": ratio - 0.01, "ci_high": ratio + 0.01,
            "confidence": 0.95}  # fmt: skip


def main() -> int:
    argv = sys.argv[1:]
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
