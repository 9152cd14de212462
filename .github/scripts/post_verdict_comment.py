#!/usr/bin/env python3
"""Post the GPU verdict of a pull request as one comment, or update that comment in place.

The comment is found again by a hidden marker, so every push edits the same comment. Input is a
folder of downloaded verdict artifacts, one subfolder per GPU kind (``verdict-h200/``...), each
holding what ``rmsnorm-kernel pr-verdict --out DIR`` wrote (``verdict.json``, ``verdict.md``) and
the ``pr.json`` that the GPU workflow recorded. The comment is rendered from ``verdict.json``
only, with every cell escaped: the artifacts come from a job that ran the pull request's code, so
they are treated as data, and the pull request number they name is believed only when that pull
request's head is the commit the verdict was computed for.

Locally, ``--dry-run`` prints the comment body and touches nothing:

    python3 .github/scripts/post_verdict_comment.py --verdicts outputs --dry-run

Standard library only, so that the comment job installs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MARKER = "<!-- rmsnorm-kernel:gpu-verdict -->"
API = os.environ.get("GITHUB_API_URL", "https://api.github.com")
MAX_BODY = 60_000  # GitHub refuses comments over 65,536 characters
STATUS_ICON = {"pass": "✅ pass", "regression": "❌ regression", "error": "⚠️ error"}
SEVERITY = {"pass": 0, "regression": 1, "error": 2}
COLUMNS = ("check", "base", "head", "ratio", "threshold", "verdict")


class VerdictError(Exception):
    """A verdict folder that does not follow the contract of ``pr-verdict --out``."""


def escape(value: Any, limit: int = 200) -> str:
    """One markdown table cell: no pipes, newlines, HTML or @-mentions from the artifact."""
    if value is None:
        return "–"
    if isinstance(value, float):
        text = f"{value:.4g}" if math.isfinite(value) else str(value)
    else:
        text = str(value)
    text = " ".join(text.split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("|", "\\|").replace("@", "@\u200b")
    return text[:limit]


def cell(row: dict[str, Any], column: str) -> str:
    """A verdict row's cell; latency medians (milliseconds in the JSON) shown in microseconds."""
    value = row.get(column)
    if row.get("kind") == "latency" and column in ("base", "head") and isinstance(value, (int, float)):
        return escape(f"{value * 1e3:.1f} µs")
    return escape(value)


def load_verdict(folder: Path) -> dict[str, Any]:
    """Read and check ``verdict.json``: status in pass/regression/error, a summary, a list of rows."""
    path = folder / "verdict.json"
    if not path.is_file():
        raise VerdictError(f"{folder.name}: no verdict.json (the pr_verdict step ended before writing it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VerdictError(f"{folder.name}: verdict.json is not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("status") not in SEVERITY:
        raise VerdictError(f"{folder.name}: verdict.json has no status in {sorted(SEVERITY)}")
    rows = data.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise VerdictError(f"{folder.name}: verdict.json 'rows' is not a list of objects")
    return {"status": data["status"], "summary": str(data.get("summary", "")), "rows": rows}


def load_pr(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "pr.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def kind_of(folder: Path) -> str:
    return folder.name.removeprefix("verdict-") or folder.name


def collect(verdicts: Path) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(kind, verdict, pr) per artifact folder; a broken verdict becomes an "error" entry."""
    folders = sorted(p for p in verdicts.iterdir() if p.is_dir()) if verdicts.is_dir() else []
    if verdicts.is_dir() and (verdicts / "verdict.json").is_file():
        folders = [verdicts]  # a single `pr-verdict --out DIR` folder, as written locally
    entries = []
    for folder in folders:
        try:
            verdict = load_verdict(folder)
        except VerdictError as exc:
            verdict = {"status": "error", "summary": str(exc), "rows": []}
        entries.append((kind_of(folder), verdict, load_pr(folder)))
    return entries


def render(
    entries: list[tuple[str, dict[str, Any], dict[str, Any]]],
    *,
    head_sha: str = "",
    run_url: str = "",
    conclusion: str = "",
) -> str:
    """The comment body: overall status (the worst kind), then one table per GPU kind."""
    if entries:
        overall = max((v["status"] for _, v, _ in entries), key=SEVERITY.__getitem__)
    else:
        overall = "error"
    lines = [MARKER, f"## GPU verdict: {STATUS_ICON[overall]}", ""]
    facts = []
    if head_sha:
        facts.append(f"head `{escape(head_sha[:12])}`")
    base = next((str(pr.get("base_sha", "")) for _, _, pr in entries if pr.get("base_sha")), "")
    if base:
        facts.append(f"base `{escape(base[:12])}`")
    if run_url:
        facts.append(f"[workflow run]({run_url})" + (f" ({escape(conclusion)})" if conclusion else ""))
    if facts:
        lines += [" · ".join(facts), ""]
    if not entries:
        lines += [
            "No verdict artifact was uploaded: the GPU job failed before `pr_verdict` wrote one. "
            "The workflow run's log says why.",
            "",
        ]
    for kind, verdict, _ in entries:
        lines += [f"### {escape(kind)}: {STATUS_ICON[verdict['status']]}", ""]
        if verdict["summary"]:
            lines += [escape(verdict["summary"], limit=1000), ""]
        if verdict["rows"]:
            lines.append("| " + " | ".join(COLUMNS) + " |")
            lines.append("|" + "---|" * len(COLUMNS))
            for row in verdict["rows"]:
                lines.append("| " + " | ".join(cell(row, c) for c in COLUMNS) + " |")
            lines.append("")
    lines += [
        "<sub>Thresholds: regression.toml. Rerun: `nox -s pr_verdict -- --base BASE --head HEAD` "
        "on the GPU runner (docs/ci.md). This comment is updated in place on every push.</sub>",
    ]
    body = "\n".join(lines) + "\n"
    if len(body) > MAX_BODY:
        cut = "\n\n(truncated: the full tables are in the workflow run's summary)\n"
        body = body[: MAX_BODY - len(cut)] + cut
    return body


def github(method: str, path: str, token: str, payload: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{API}{path}",
        method=method,
        data=None if payload is None else json.dumps(payload).encode(),
        headers={
            "Accept": "application/vnd.github+json",
            "Authorization": f"Bearer {token}",
            "X-GitHub-Api-Version": "2022-11-28",
            "User-Agent": "rmsnorm-kernel-verdict-comment",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


def pull_request_number(candidates: list[int], repo: str, head_sha: str, token: str) -> int:
    """The first candidate whose head commit is ``head_sha``; numbers from artifacts are not trusted."""
    for number in dict.fromkeys(candidates):
        pull = github("GET", f"/repos/{repo}/pulls/{number}", token)
        if pull.get("head", {}).get("sha") == head_sha:
            return number
        print(f"pull request #{number} has head {pull.get('head', {}).get('sha')}, not {head_sha}: ignored")
    raise SystemExit(f"no pull request among {candidates} has head {head_sha}; nothing posted")


def find_comment(repo: str, number: int, token: str) -> int | None:
    page = 1
    while True:
        comments = github("GET", f"/repos/{repo}/issues/{number}/comments?per_page=100&page={page}", token)
        for comment in comments:
            if MARKER in (comment.get("body") or ""):
                return int(comment["id"])
        if len(comments) < 100:
            return None
        page += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--verdicts", type=Path, required=True, help="folder of verdict-KIND/ artifact folders"
    )
    parser.add_argument("--repo", default=os.environ.get("GITHUB_REPOSITORY", ""), help="owner/name")
    parser.add_argument("--head-sha", default="", help="the head commit the verdict was computed for")
    parser.add_argument("--pr-number", type=int, action="append", default=[], help="fallback PR number")
    parser.add_argument("--run-url", default="")
    parser.add_argument("--conclusion", default="", help="conclusion of the GPU workflow run")
    parser.add_argument("--dry-run", action="store_true", help="print the comment body; post nothing")
    args = parser.parse_args(argv)

    entries = collect(args.verdicts)
    body = render(entries, head_sha=args.head_sha, run_url=args.run_url, conclusion=args.conclusion)
    if args.dry_run:
        sys.stdout.write(body)
        return 0

    token = os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN") or ""
    if not token or not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo) or not args.head_sha:
        parser.error("posting needs GH_TOKEN, --repo owner/name and --head-sha (or use --dry-run)")
    candidates = [int(pr["number"]) for _, _, pr in entries if str(pr.get("number", "")).isdigit()]
    candidates += args.pr_number
    if not candidates:
        raise SystemExit("no pull request number in the artifacts and no --pr-number; nothing posted")
    try:
        number = pull_request_number(candidates, args.repo, args.head_sha, token)
        existing = find_comment(args.repo, number, token)
        if existing is None:
            github("POST", f"/repos/{args.repo}/issues/{number}/comments", token, {"body": body})
            print(f"created the verdict comment on #{number}")
        else:
            github("PATCH", f"/repos/{args.repo}/issues/comments/{existing}", token, {"body": body})
            print(f"updated the verdict comment {existing} on #{number}")
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"GitHub API error {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
    return 0


if __name__ == "__main__":
    sys.exit(main())
