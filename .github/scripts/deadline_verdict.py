#!/usr/bin/env python3
"""Write an ``error`` verdict for a pr-verdict run that passed its deadline and was killed.

The GPU workflow runs pr-verdict under ``timeout`` with a deadline shorter than the job's own
limit, so a hang (a kernel that never returns, a deadlocked worker) ends as a verdict that says
"could not judge" instead of a job that GitHub kills with nothing to show. Files as
``pr-verdict --out DIR`` writes them (``verdict.json``, ``verdict.md``), replacing any partial
ones. Standard library only.

    python3 .github/scripts/deadline_verdict.py --out DIR --minutes 75 --base-ref SHA --head SHA
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SHA = re.compile(r"[0-9a-f]{40}")


def sha(text: str) -> str:
    if not SHA.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:50]!r} is not a 40-hex commit SHA")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="pr-verdict's --out folder")
    parser.add_argument("--minutes", type=int, required=True, help="the deadline that passed")
    parser.add_argument(
        "--base-ref", type=sha, required=True, help="the base branch's tip given to pr-verdict"
    )
    parser.add_argument("--head", type=sha, required=True, help="the pull request's head")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    note = f"pr-verdict did not finish within its deadline of {args.minutes} min and was stopped"
    verdict = {
        "status": "error",
        "summary": f"ERROR: could not judge: {note}",
        "rows": [{"check": "deadline", "base": None, "head": None, "ratio": None, "threshold": None,
                  "verdict": "error", "kind": "run", "note": note}],
        "base_ref_sha": args.base_ref,
        "head_sha": args.head,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verdict.json").write_text(json.dumps(verdict, indent=1) + "\n", encoding="utf-8")
    (args.out / "verdict.md").write_text(f"**{verdict['summary']}**\n", encoding="utf-8")
    print(verdict["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
