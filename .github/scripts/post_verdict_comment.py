#!/usr/bin/env python3
"""Post the GPU verdict of a pull request as one comment and one check run, or update them.

Input: the downloaded ``verdict-KIND/`` artifacts of a job that ran the pull request's code, so
untrusted: size-checked before parsing, every field validated, the summary rebuilt from the rows.
The pull request, head commit and conclusion come from ``--trigger`` (verify_trigger.py), never
from the artifacts. What is shown and how the comment is found again: docs/ci.md, "The comment".

    python3 .github/scripts/post_verdict_comment.py --verdicts outputs/pr-verdict --dry-run

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verdict_links import PAGES_URL, SHAPE, history_url  # noqa: F401
from verify_trigger import CONCLUSIONS, RUN_URL, Client, GitHub, client_from_env  # noqa: F401

MARKER = "<!-- rmsnorm-kernel:gpu-verdict"  # first line of the bot's comment: MARKER head=SHA -->
BOT_LOGIN = "github-actions[bot]"  # the default author of the comments (the App's is APP-SLUG[bot])
CHECK_NAME = "GPU verdict"  # the check run the ruleset requires from the verdict App (docs/ci.md)
MAX_BODY = 60_000  # GitHub refuses comments over 65,536 characters; the full table is an artifact
MAX_VERDICT_BYTES = 1_000_000  # a verdict.json of 100 kinds of rows is ~100 kB
MAX_PR_BYTES = 4_096
MAX_ROWS = 2_000
MAX_KINDS = 16
MAX_NOTE = 300

RUN_TITLE = re.compile(r"GPU verdict #([1-9][0-9]{0,8}) at ([0-9a-f]{40})")  # run-name of gpu.yml
SHA = re.compile(r"[0-9a-f]{40}")
CHECK = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.,:()/+-]{0,119}")
KIND = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
REPO = re.compile(r"[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}")

STATUSES = ("pass", "regression", "error")  # in order of severity
# a row's verdicts: "accepted" (a regression within an approved Accept-Regression) counts as a pass
ROW_VERDICTS = ("pass", "accepted", "regression", "error")
ICON = {"pass": "✅ pass", "regression": "❌ regression", "error": "⚠️ could not judge"}
ROW_KINDS = ("latency", "numerics", "run")
# (lowest, highest) accepted for each numeric field of a row: latencies in ms, relative errors,
# ratios head/base, probabilities. Anything else, or NaN/inf, rejects the whole artifact.
RANGES = {
    "base": (0.0, 1e9),
    "head": (0.0, 1e9),
    "ratio": (0.0, 1e6),
    "threshold": (0.0, 1e9),
    "p_value": (0.0, 1.0),
    "alpha": (0.0, 1.0),
    "ci_low": (0.0, 1e6),
    "ci_high": (0.0, 1e6),
    "confidence": (0.0, 1.0),
}
# Run conclusions (workflow_run.conclusion) that leave no verdict to trust.
STOPPED = {"cancelled": "was cancelled", "timed_out": "timed out"}
FAILED = {"failure", "startup_failure", "action_required"}


class VerdictError(ValueError):
    """An artifact that is missing, oversized, malformed or fails validation."""


@dataclass(frozen=True)
class Row:
    check: str
    verdict: str
    kind: str = "latency"
    base: float | None = None
    head: float | None = None
    ratio: float | None = None
    threshold: float | None = None
    p_value: float | None = None
    alpha: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float | None = None
    note: str = ""


@dataclass
class Entry:
    """One GPU kind's verdict, validated; ``problem`` says why it could not be read."""

    kind: str
    status: str
    rows: list[Row] = field(default_factory=list)
    problem: str = ""
    base_sha: str = ""  # the merge-base the judge compared against
    base_ref_sha: str = ""  # the base branch's tip it was given
    head_sha: str = ""


@dataclass(frozen=True)
class Run:
    """The GPU workflow run being reported: from its title and the workflow_run event."""

    number: int = 0
    head_sha: str = ""
    url: str = ""
    conclusion: str = ""
    pages: str = ""  # the history page, PAGES_URL; "" links no history


# ------------------------------------------------------------------------------------------------
# Reading the artifacts
# ------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise VerdictError(f"non-finite number {name}")


def load_json(path: Path, limit: int) -> Any:
    """JSON from ``path``, refused before parsing when larger than ``limit`` bytes or a link."""
    if path.is_symlink() or not path.is_file():
        raise VerdictError(f"no {path.name}")
    size = path.stat().st_size
    if size > limit:
        raise VerdictError(f"{path.name} is {size} bytes, over the limit of {limit}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"), parse_constant=_reject_constant)
    except VerdictError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise VerdictError(f"{path.name} is not readable JSON ({type(exc).__name__})") from None


def number(raw: dict[str, Any], name: str) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise VerdictError(f"{name} is not a number")
    low, high = RANGES[name]
    if not math.isfinite(value) or not low <= value <= high:
        raise VerdictError(f"{name} is out of range")
    return float(value)


def sha(raw: dict[str, Any], name: str) -> str:
    value = raw.get(name)
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not SHA.fullmatch(value):
        raise VerdictError(f"{name} is not a 40-hex commit SHA")
    return value


def parse_row(raw: Any, i: int) -> Row:
    if not isinstance(raw, dict):
        raise VerdictError(f"row {i} is not an object")
    check, verdict, kind = raw.get("check"), raw.get("verdict"), raw.get("kind", "latency")
    if not isinstance(check, str) or not CHECK.fullmatch(check):
        raise VerdictError(f"row {i}: check name does not match {CHECK.pattern}")
    if verdict not in ROW_VERDICTS or kind not in ROW_KINDS:
        raise VerdictError(f"row {i}: verdict or kind not one of {ROW_VERDICTS} / {ROW_KINDS}")
    note = raw.get("note") or ""
    if not isinstance(note, str):
        raise VerdictError(f"row {i}: note is not text")
    try:
        numbers = {name: number(raw, name) for name in RANGES}
    except VerdictError as exc:
        raise VerdictError(f"row {i}: {exc}") from None
    return Row(check, verdict, kind, note=note[:MAX_NOTE], **numbers)


def worst(statuses) -> str:
    return max(statuses, key=STATUSES.index, default="error")


def parse_verdict(data: Any, kind: str) -> Entry:
    """A validated Entry; its status is the worse of the declared one and the rows' own."""
    if not isinstance(data, dict) or data.get("status") not in STATUSES:
        raise VerdictError(f"verdict.json has no status in {STATUSES}")
    rows = data.get("rows")
    if not isinstance(rows, list) or len(rows) > MAX_ROWS:
        raise VerdictError(f"verdict.json 'rows' is not a list of at most {MAX_ROWS}")
    parsed = [parse_row(raw, i) for i, raw in enumerate(rows)]
    derived = worst("pass" if r.verdict == "accepted" else r.verdict for r in parsed) if parsed else "error"
    status = worst([data["status"], derived])
    problem = "" if parsed else "the verdict has no checks"
    shas = {name: sha(data, name) for name in ("base_sha", "base_ref_sha", "head_sha")}
    return Entry(kind, status, parsed, problem, **shas)


def load_entry(folder: Path, run: Run, prefix: str = "verdict-") -> Entry:
    kind = folder.name.removeprefix(prefix)
    if not KIND.fullmatch(kind):
        return Entry("unknown", "error", problem="an artifact with a malformed GPU kind name")
    try:
        entry = parse_verdict(load_json(folder / "verdict.json", MAX_VERDICT_BYTES), kind)
    except VerdictError as exc:
        return Entry(kind, "error", problem=f"no usable verdict: {exc}")
    try:
        pr = load_json(folder / "pr.json", MAX_PR_BYTES) if (folder / "pr.json").exists() else {}
        claimed = sha(pr, "head_sha") if isinstance(pr, dict) else ""
    except VerdictError as exc:
        return Entry(kind, "error", problem=f"pr.json: {exc}")
    for name, value in (("verdict.json", entry.head_sha), ("pr.json", claimed)):
        if run.head_sha and value and value != run.head_sha:
            return Entry(kind, "error", problem=f"{name} names another head commit than this run's")
    number = pr.get("number") if isinstance(pr, dict) else None
    if run.number and number is not None and number != run.number:
        return Entry(kind, "error", problem="pr.json names another pull request than this run's")
    return entry


def collect(verdicts: Path, run: Run, prefix: str = "verdict-", kinds: tuple[str, ...] = ()) -> list[Entry]:
    """One Entry per artifact folder, ``PREFIX-KIND`` (or the folder itself when it is one ``--out DIR``).

    With ``kinds`` (the GPU matrix) only those folders are read, and a kind without one is an
    error: a run that lost a kind's verdict is not a pass of the others."""
    if not verdicts.is_dir():
        return []
    if kinds:
        found = [verdicts / f"{prefix}{k}" for k in kinds]
        if not any(f.is_dir() for f in found):
            return []
        return [
            load_entry(f, run, prefix)
            if f.is_dir() and not f.is_symlink()
            else Entry(k, "error", problem="no verdict artifact for this GPU kind")
            for k, f in zip(kinds, found)
        ]
    if (verdicts / "verdict.json").exists():
        folders = [verdicts]
    else:
        folders = sorted(p for p in verdicts.iterdir() if p.is_dir() and not p.is_symlink())
    entries = [load_entry(folder, run, prefix) for folder in folders[:MAX_KINDS]]
    if len(folders) > MAX_KINDS:
        entries.append(Entry("more", "error", problem=f"more than {MAX_KINDS} verdict artifacts"))
    return entries


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------

ZWSP = "\u200b"
CUT = "(cut to fit a comment: every row is in the artifact)"
# Characters that start markdown or HTML structure, written as numeric character references so
# they render as themselves; then what GitHub turns into links by itself (mentions, #refs, URLs).
_STRUCTURAL = str.maketrans({c: f"&#{ord(c)};" for c in "\\`*_[]()<>!|~&{}$^\"'=:"})
_AUTOLINKS = re.compile(r"([@#]|GH-|www\.|//)", re.IGNORECASE)


def plain(text: str, limit: int = MAX_NOTE) -> str:
    """Text from an artifact as inert markdown: one line, no links, images, HTML, mentions, refs."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())[:limit]
    text = _AUTOLINKS.sub(lambda m: m.group(1)[0] + ZWSP + m.group(1)[1:], text)
    return text.translate(_STRUCTURAL)


def short(commit: str) -> str:
    return f"`{commit[:12]}`" if SHA.fullmatch(commit or "") else "?"


def percent(ratio: float | None) -> str:
    return "–" if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def value(row: Row, which: str) -> str:
    v = getattr(row, which)
    if v is None:
        return "–"
    return f"{v * 1e3:.1f} µs" if row.kind == "latency" else f"{v:.2e}"


def confidence(row: Row) -> str:
    """How sure the judge is: a confidence interval of the change when the row has one, else the
    one-sided p-value against its significance level."""
    if row.ci_low is not None and row.ci_high is not None:
        level = f"{row.confidence:.0%} " if row.confidence is not None else ""
        return f"{level}CI {percent(row.ci_low)} to {percent(row.ci_high)}"
    if row.p_value is not None:
        return f"p = {row.p_value:.2g}" + (f" (α {row.alpha:g})" if row.alpha is not None else "")
    return "–"


def threshold(row: Row) -> str:
    if row.threshold is None:
        return "–"
    if row.kind == "latency" and row.ci_low is not None:
        return f"CI low end > {percent(row.threshold)}"  # the change is surely above the factor
    if row.kind == "latency":
        return f"> {percent(row.threshold)}" + (" and significant" if row.alpha is not None else "")
    return f"error > {row.threshold:.2e}"


def history_link(row: Row, pages: str) -> str:
    url = history_url(row.check, pages)
    return f"[history]({url})" if url else "–"


def change_key(row: Row) -> tuple[int, float, str]:
    """Regressions first, then rows that could not be judged, then passes; each by change, largest first."""
    change = row.ratio if row.ratio is not None else -math.inf
    return (("regression", "error", "accepted", "pass").index(row.verdict), -change, row.check)


def table(rows: list[Row], with_verdict: bool, pages: str = "") -> list[str]:
    """The rows as a markdown table; with ``pages`` (the verdict columns only) a link per row to
    its benchmark's history."""
    links = with_verdict and bool(pages)
    head = "| check | change | confidence | threshold | base → head |" + (
        " verdict |" if with_verdict else ""
    )
    head += " history |" if links else ""
    lines = [head, "|---" * (5 + with_verdict + links) + "|"]
    for r in rows:
        cells = [
            plain(r.check),
            percent(r.ratio),
            confidence(r),
            threshold(r),
            f"{value(r, 'base')} → {value(r, 'head')}",
        ]
        if with_verdict:
            verdict = {"regression": "**regression**", "accepted": "accepted (Accept-Regression)"}.get(
                r.verdict, "could not judge"
            )
            cells.append(verdict + (f": {plain(r.note)}" if r.note else ""))
        if links:
            cells.append(history_link(r, pages))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kind_summary(entry: Entry) -> str:
    """One line per GPU kind, counted from the rows."""
    if entry.problem and not entry.rows:
        return f"- **{entry.kind}**: {ICON['error']}: {plain(entry.problem)}"
    counts = {s: sum(r.verdict == s for r in entry.rows) for s in ROW_VERDICTS}
    parts = [
        f"{counts['regression']} regressed",
        f"{counts['error']} could not judge",
        f"{counts['pass']} pass",
    ]
    if counts["accepted"]:
        parts.insert(1, f"{counts['accepted']} accepted")
    line = f"- **{entry.kind}**: {ICON[entry.status]}: " + ", ".join(parts) + f" of {len(entry.rows)} checks"
    flagged = sorted((r for r in entry.rows if r.verdict == "regression"), key=change_key)
    if flagged:
        line += f" (largest: {plain(flagged[0].check)} {percent(flagged[0].ratio)})"
    return line


def marker(head_sha: str) -> str:
    return f"{MARKER} head={head_sha if SHA.fullmatch(head_sha) else 'none'} -->"


def footer(run: Run) -> list[str]:
    rerun = "*Re-run jobs* on the " + (f"[workflow run]({run.url})" if run.url else "workflow run")
    return [
        "**What next.** A regression: read the flagged rows; if the change is intended, say why in the "
        "pull request (a maintainer can override the check: docs/ci.md, merge protection). Could not "
        "judge: the job log says why. Rerun: push a commit, or " + rerun + " (a fork's run waits for "
        "approval again); on a GPU machine, `nox --no-venv -s pr_verdict -- --base BASE --head HEAD`. "
        "Every row, with its notes, is `verdict.md` in the run's `verdict-KIND` artifact.",
    ]


def header(title: str, run: Run, entries: list[Entry]) -> list[str]:
    facts = [f"head {short(run.head_sha)}"] if run.head_sha else []
    base = next((e for e in entries if e.base_sha), None)
    if base:
        facts.append(
            f"base {short(base.base_sha)} (merge-base with the base branch at {short(base.base_ref_sha)})"
        )
    if run.url:
        facts.append(f"[job log]({run.url})")
    lines = [marker(run.head_sha), f"## GPU verdict: {title}", ""]
    return lines + [" · ".join(facts), ""] if facts else lines


def render(entries: list[Entry], run: Run) -> str:
    """The comment: title (the worst kind), a line per kind, then per kind the rows that need
    attention, worst first, and the passing rows folded; kept under GitHub's size limit."""
    if run.conclusion in STOPPED:
        return render_no_verdict(run, f"The GPU run for this commit {STOPPED[run.conclusion]}")
    if not entries:
        return render_no_verdict(run, "The GPU run ended before it wrote a verdict")
    overall = worst(e.status for e in entries)
    summaries = [kind_summary(e) for e in entries]
    if overall == "pass" and run.conclusion and run.conclusion != "success":  # the run's word wins
        overall = "error"
        summaries.append(f"- the GPU run concluded {plain(run.conclusion, 40)}: its pass is not believed")
    lines = header(ICON[overall], run, entries) + summaries + [""]
    tail = footer(run)
    budget = MAX_BODY - len("\n".join(tail)) - 200

    def size(extra: list[str] = []) -> int:  # noqa: B006 - read only
        return len("\n".join(lines + extra))

    for e in entries:
        attention = sorted((r for r in e.rows if r.verdict != "pass"), key=change_key)
        if attention:
            lines += [f"### {e.kind}: needs attention", "", *table(attention, True, run.pages), ""]
    if size() > budget:  # the attention rows alone are too long: cut at a row boundary
        while size(["", CUT]) > budget:
            lines.pop()
        lines += ["", CUT]
    for e in entries:
        passing = sorted((r for r in e.rows if r.verdict == "pass"), key=change_key)
        block = [f"<details><summary>{e.kind}: {len(passing)} passing checks</summary>", ""]
        block += table(passing, False)
        end = [
            "",
            f"{len(passing)} passing rows in all; the others are in the artifact.",
            "",
            "</details>",
            "",
        ]
        while size(block + end) > budget and len(block) > 4:
            block.pop()
        if not passing or len(block) == 4:
            continue
        lines += block + (end if len(block) - 4 < len(passing) else end[2:])
    return "\n".join(lines + tail) + "\n"


def render_no_verdict(run: Run, why: str) -> str:
    lines = header("⏹️ no verdict", run, [])
    lines += [f"{why}: there is no verdict for it, and any earlier verdict no longer applies.", ""]
    return "\n".join(lines + footer(run)) + "\n"


def render_outdated(run: Run, current_head: str, old_head: str) -> str:
    lines = header("⏳ outdated", Run(run.number, current_head, run.url, ""), [])
    lines += [
        f"The last verdict was for {short(old_head)}; the pull request's head is now "
        f"{short(current_head)}, whose verdict is not in yet. It appears here when its run completes "
        "(a fork's run starts once a maintainer approves it).",
        "",
    ]
    return "\n".join(lines) + "\n"


def check_conclusion(entries: list[Entry], run: Run) -> tuple[str, str] | None:
    """(conclusion, title) of the required check run; None when no verdict run took place.

    Only a run that concluded ``success`` with every kind passing is a success: a pass artifact
    of a run that failed or was cancelled is not believed. Neutral and skipped are never used
    (a ruleset counts both as passing)."""
    if run.conclusion in STOPPED:
        return run.conclusion, f"no verdict: the run {STOPPED[run.conclusion]}"
    if not entries:
        if run.conclusion in FAILED:
            return "failure", "no verdict: the run failed before writing one"
        return None
    overall = worst(e.status for e in entries)
    if overall == "pass" and run.conclusion != "success":
        return "failure", f"could not judge: the run concluded {plain(run.conclusion or 'nothing', 40)}"
    title = {"pass": "every check passes", "regression": "regression", "error": "could not judge"}[overall]
    return ("success" if overall == "pass" else "failure"), title


# ------------------------------------------------------------------------------------------------
# GitHub
# ------------------------------------------------------------------------------------------------


def bot_comment(client: Client, repo: str, number: int, bot: str) -> tuple[int, str] | None:
    """(id, head SHA it reports) of the oldest comment with the marker written by ``bot``."""
    for page in range(1, 51):
        comments = client.request("GET", f"/repos/{repo}/issues/{number}/comments?per_page=100&page={page}")
        for c in comments:
            body, login = c.get("body") or "", (c.get("user") or {}).get("login")
            if login == bot and body.startswith(MARKER):
                head = re.match(re.escape(MARKER) + r" head=([0-9a-f]{40}) -->", body)
                return int(c["id"]), head.group(1) if head else ""
        if len(comments) < 100:
            break
    return None


def publish(client: Client, repo: str, run: Run, entries: list[Entry], bot: str) -> str:
    """Comment and commit status for ``run``; returns what was done, for the log."""
    pull = client.request("GET", f"/repos/{repo}/pulls/{run.number}")
    if pull.get("state") != "open":
        return f"#{run.number} is not open: nothing posted"
    current = (pull.get("head") or {}).get("sha", "")
    done = []
    status = check_conclusion(entries, run)
    if status:
        conclusion, title = status
        payload = {
            "name": CHECK_NAME,
            "head_sha": run.head_sha,
            "status": "completed",
            "conclusion": conclusion,
            "output": {"title": f"GPU verdict: {title}", "summary": f"GPU verdict: {title}."},
        }
        if run.url:
            payload["details_url"] = run.url
        client.request("POST", f"/repos/{repo}/check-runs", payload)
        done.append(f"check run {conclusion} on {run.head_sha[:12]}")
    existing = bot_comment(client, repo, run.number, bot)
    if current != run.head_sha:  # the pull request moved on: only retire a verdict of an older head
        if existing and existing[1] != current:
            body = render_outdated(run, current, existing[1])
            client.request("PATCH", f"/repos/{repo}/issues/comments/{existing[0]}", {"body": body})
            done.append(f"comment {existing[0]} marked outdated")
        return (
            "; ".join(done) or f"{run.head_sha[:12]} is no longer the head of #{run.number}: nothing posted"
        )
    if status is None:
        return "no verdict run took place (skipped): nothing posted"
    body = render(entries, run)
    if existing:
        client.request("PATCH", f"/repos/{repo}/issues/comments/{existing[0]}", {"body": body})
        done.append(f"updated the verdict comment {existing[0]} on #{run.number}")
    else:
        client.request("POST", f"/repos/{repo}/issues/{run.number}/comments", {"body": body})
        done.append(f"created the verdict comment on #{run.number}")
    return "; ".join(done)


def load_trigger(path: Path) -> Run:
    """The run as verify_trigger.py verified it from the API, checked once more."""
    facts = load_json(path, MAX_PR_BYTES)
    ok = isinstance(facts, dict) and isinstance(facts.get("number"), int) and facts["number"] > 0
    ok = ok and SHA.fullmatch(str(facts.get("head_sha"))) and facts.get("conclusion") in CONCLUSIONS
    if not ok:
        raise VerdictError(f"{path.name} is not a verified trigger")
    url = str(facts.get("url") or "")
    return Run(facts["number"], facts["head_sha"], url if RUN_URL.fullmatch(url) else "", facts["conclusion"])


def main(argv: list[str] | None = None, client: Client | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--verdicts", type=Path, required=True, help="folder of verdict-KIND/ artifact folders"
    )
    parser.add_argument("--repo", default=os.environ.get("GITHUB_REPOSITORY", ""), help="owner/name")
    parser.add_argument("--trigger", type=Path, help="the run as verify_trigger.py verified it (posting)")
    parser.add_argument(
        "--kinds", default="", help="the GPU matrix's kinds, comma-separated: read only these"
    )
    parser.add_argument(
        "--run-title", default="", help="--dry-run: the GPU run's title 'GPU verdict #N at SHA'"
    )
    parser.add_argument("--head-sha", default="", help="--dry-run: head commit, without --run-title")
    parser.add_argument("--run-url", default="", help="--dry-run: the GPU run's page (its job logs)")
    parser.add_argument("--conclusion", default="", help="--dry-run: conclusion of the GPU workflow run")
    parser.add_argument(
        "--pages-url",
        default="",
        help="the history page, https://OWNER.github.io/REPO/: links per flagged row",
    )
    parser.add_argument("--bot-login", default=BOT_LOGIN, help="author of the comments this script edits")
    parser.add_argument("--dry-run", action="store_true", help="print the comment body; post nothing")
    args = parser.parse_args(argv)

    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not all(KIND.fullmatch(k) for k in kinds) or len(kinds) > MAX_KINDS:
        parser.error(f"--kinds must be names matching {KIND.pattern}, comma-separated")
    if args.pages_url and not PAGES_URL.fullmatch(args.pages_url):
        parser.error(f"--pages-url must match {PAGES_URL.pattern}")
    if args.trigger:
        try:
            run = load_trigger(args.trigger)
        except VerdictError as exc:
            parser.error(str(exc))
        run = Run(run.number, run.head_sha, run.url, run.conclusion, args.pages_url)
    else:
        title = RUN_TITLE.fullmatch(args.run_title)
        if args.run_title and not title:
            parser.error(f"--run-title {args.run_title[:80]!r} is not 'GPU verdict #N at SHA'")
        head = title.group(2) if title else args.head_sha
        if head and not SHA.fullmatch(head):
            parser.error("--head-sha must be a 40-hex commit SHA")
        url = args.run_url if RUN_URL.fullmatch(args.run_url) else ""
        run = Run(int(title.group(1)) if title else 0, head, url, args.conclusion, args.pages_url)
    entries = collect(args.verdicts, run, kinds=kinds)
    if args.dry_run:
        sys.stdout.write(render(entries, run))
        return 0

    # Posting believes only a run verified from the API (verify_trigger.py), never a title.
    if not REPO.fullmatch(args.repo) or not args.trigger or not kinds:
        parser.error("posting needs --repo owner/name, --trigger and --kinds (or use --dry-run)")
    try:
        print(publish(client or client_from_env(), args.repo, run, entries, args.bot_login))
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"GitHub API error {exc.code} on {exc.url}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
