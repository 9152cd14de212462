#!/usr/bin/env python3
"""Check asv results from the GPU jobs before they reach the results branch and ``asv publish``.

Only the layout asv writes, bounded sizes, JSON, names and keys against a pattern, and no markup
or control characters in any string (asv's page puts them in unescaped). DEST, the checkout of
the results branch, is re-checked the same way on every run; then the new files are copied into
it. What is checked and why: docs/ci.md, "History and drift".

    python3 .github/scripts/check_asv_results.py INCOMING DEST

Exit 0 when everything was copied, 1 (copying nothing) when anything failed a check. Stdlib only.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 20_000_000
MAX_TOTAL_BYTES = 200_000_000
MACHINE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
LAYOUT = re.compile(
    rf"benchmarks\.json|{MACHINE}/machine\.json|{MACHINE}/[0-9a-f]{{8}}-[A-Za-z0-9_.+-]{{1,150}}\.json"
)
# benchmark names, machine facts, result columns; asv's own duration keys (<build>, <setup_cache M:N>)
KEY = re.compile(r"[A-Za-z0-9_.+-]{1,200}|<build>|<setup_cache [A-Za-z0-9_.]{1,150}:[0-9]{1,6}>")
UNSAFE = re.compile(r"[<>&\"`\x00-\x1f\x7f]")  # markup and control characters
EXEMPT_KEYS = {"code"}


def check_value(value: Any, where: str, problems: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not KEY.fullmatch(key):
                problems.append(f"{where}: key {key[:60]!r} does not match {KEY.pattern}")
            elif key not in EXEMPT_KEYS:
                check_value(item, f"{where}.{key}", problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_value(item, f"{where}[{i}]", problems)
    elif isinstance(value, str) and (UNSAFE.search(value) or len(value) > 1000):
        problems.append(f"{where}: a string with markup, control characters or over 1000 characters")


# Only on the results branch: the rows merged pull requests' verdicts accepted (history.py
# record-accepted writes it in the publish job); a GPU job's artifact may not bring one.
BRANCH_ONLY = {"accepted.json"}


def check_tree(incoming: Path, skip_git: bool = False) -> tuple[list[Path], list[str]]:
    """Files that pass, and the problems; ``skip_git``: the results branch (its .git aside, no total
    cap, and its accepted.json)."""
    files, problems, total = [], [], 0
    for path in sorted(incoming.rglob("*")):
        name = path.relative_to(incoming).as_posix()
        if skip_git and (name == ".git" or name.startswith(".git/")):
            continue
        if path.is_symlink() or (not path.is_dir() and not path.is_file()):
            problems.append(f"{name}: not a plain file")
        if path.is_dir() or path.is_symlink():
            continue
        if not LAYOUT.fullmatch(name) and not (skip_git and name in BRANCH_ONLY):
            problems.append(
                f"{name}: not a file asv writes (benchmarks.json, MACHINE/machine.json, MACHINE/HASH-ENV.json)"
            )
            continue
        size = path.stat().st_size
        total += size
        if size > MAX_FILE_BYTES or (total > MAX_TOTAL_BYTES and not skip_git):
            problems.append(f"{name}: over the size limit")
            continue
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            problems.append(f"{name}: not JSON ({type(exc).__name__})")
            continue
        check_value(data, name, problems)
        files.append(path)
    return files, problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    incoming, dest = Path(args[0]), Path(args[1])
    files, problems = check_tree(incoming)
    if dest.is_dir():
        _, kept = check_tree(dest, skip_git=True)
        problems += [f"results branch: {problem}" for problem in kept]
    if problems or not files:
        for problem in problems[:50] or ["no results in the artifacts"]:
            print("::error::" + re.sub(r"[\x00-\x1f\x7f]", "?", problem))  # no injected workflow commands
        return 1
    for path in files:
        target = dest / path.relative_to(incoming)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    print(f"checked and copied {len(files)} files into {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
