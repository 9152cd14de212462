"""Helpers the CI tests share: the PR comment script's artifacts and its dry run, and the
sessions a noxfile declares, read with ast."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".github" / "scripts" / "post_verdict_comment.py"
NOXFILE = ROOT / "noxfile.py"

# ------------------------------------------------------------------------------------------------
# The PR comment: verdict artifacts and the script's dry run
# ------------------------------------------------------------------------------------------------

HEAD, OLD, BASE, REF = "a" * 40, "c" * 40, "b" * 40, "d" * 40
RUN_URL = "https://github.com/o/r/actions/runs/42"
TITLE = f"GPU verdict #7 at {HEAD}"
EVIL = (
    "see [click](https://evil.example/x) ![pixel](https://evil.example/p.png) "
    '<img src=x onerror="alert(1)"> <a href="https://evil.example">a</a> @octocat #123 GH-5 '
    "www.evil.example `code` | pipe **bold** $x^2$ javascript:alert(1) [ref]: https://evil.example"
)


def row(check, verdict="pass", ratio=1.0, **extra):
    return {"check": check, "base": 0.040, "head": 0.040 * ratio, "ratio": ratio, "threshold": 1.05,
            "verdict": verdict, "kind": "latency", "p_value": 0.5, "alpha": 0.01, "note": "", **extra}  # fmt: skip


ROWS = [
    row("latency 4096x4096-bfloat16 forward"),
    row("device 4096x4096-bfloat16 forward", "regression", 1.081, p_value=1e-4),
    row("device 32768x4096-bfloat16 forward", "regression", 1.32, p_value=1e-6),
    {"check": "gpu tests (head)", "verdict": "error", "kind": "run", "note": "timed out"},
    row("latency 1x4096-bfloat16 forward", "pass", 0.97),
    {"check": "error dx 4096x4096-float32", "base": 1e-7, "head": 1.1e-7, "ratio": 1.1,
     "threshold": 2e-6, "verdict": "pass", "kind": "numerics", "note": "ceiling"},
]  # fmt: skip


def write(folder: Path, verdict: dict | None = None, pr: dict | None = None, raw: bytes | None = None):
    folder.mkdir(parents=True)
    if raw is not None:
        (folder / "verdict.json").write_bytes(raw)
    elif verdict is not None:
        (folder / "verdict.json").write_text(json.dumps(verdict), encoding="utf-8")
    if pr is not None:
        (folder / "pr.json").write_text(json.dumps(pr), encoding="utf-8")
    return folder.parent


def verdict(status="regression", rows=ROWS, **extra):
    return {"status": status, "summary": "IGNORED SUMMARY @octocat", "rows": rows,
            "base_sha": BASE, "base_ref_sha": REF, "head_sha": HEAD, **extra}  # fmt: skip


def dry(verdicts: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--verdicts", str(verdicts), "--dry-run", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


# ------------------------------------------------------------------------------------------------
# The noxfile's sessions
# ------------------------------------------------------------------------------------------------


def _literal_kw(call: ast.Call, name: str, default=None):
    for kw in call.keywords:
        if kw.arg == name:
            return ast.literal_eval(kw.value)
    return default


def noxfile_sessions(path: Path = NOXFILE) -> dict[str, dict]:
    """Sessions declared in a noxfile, read with ast (nox need not be importable):
    name -> {"tags": set, "doc": str}."""
    sessions = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            call = deco if isinstance(deco, ast.Call) else None
            target = call.func if call else deco
            if ast.unparse(target) not in ("nox.session", "session"):
                continue
            name = _literal_kw(call, "name", node.name) if call else node.name
            tags = set(_literal_kw(call, "tags", []) if call else [])
            sessions[name] = {"tags": tags, "doc": ast.get_docstring(node) or ""}
    return sessions
