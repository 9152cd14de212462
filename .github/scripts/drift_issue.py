#!/usr/bin/env python3
"""Show the drift of main on one tracking issue: open it, update it, close it when drift is gone.

Reads the history workflow's artifacts: ``--drift`` (``drift-KIND/``: verdict.json and drift.json)
and ``--steps`` (``changepoints/steps.json``, ``bisect-KIND/bisect.json``), validated as the PR
comment's are (post_verdict_comment.py). Drift opens or updates the bot's ``perf-drift`` issue
(never anyone else's), naming each step's commit range and the bisection's result; no drift
closes it; could not judge leaves it. docs/ci.md ("Drift of main") has the rules. Standard
library only. Locally, nothing posted:

    python3 .github/scripts/drift_issue.py --drift outputs --sha "$(git rev-parse HEAD)" --dry-run
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.error
from pathlib import Path

import post_verdict_comment as pvc

MARKER = "<!-- rmsnorm-kernel:perf-drift -->"
LABEL = "perf-drift"
TAG = re.compile(r"v[0-9A-Za-z][0-9A-Za-z._+-]{0,63}")  # the release tags `nox -s drift` judges against
MAX_DRIFT_BYTES = 1_024
MAX_STEPS_BYTES = 512_000  # steps.json and bisect.json, each
MAX_STEPS_SHOWN = 10
BISECT_STOPS = {"narrowed", "inconsistent", "out of calls", "out of time", "judge error", "one commit"}


def _step(s: object) -> dict | None:
    """One step of steps.json as the issue shows it, or None when it does not validate."""
    if not isinstance(s, dict) or s.get("direction") not in ("slowdown", "improvement"):
        return None
    ratio, series, accepted = s.get("ratio"), s.get("series"), s.get("accepted") or ""
    commits = [s.get("first_commit"), s.get("last_before")]
    if not all(isinstance(c, str) and pvc.SHA.fullmatch(c) for c in commits):
        return None
    if not (isinstance(ratio, (int, float)) and 0 < ratio < 1e6 and isinstance(series, str)):
        return None
    # where the step lies in main's history (commit_index, from changepoints); a file without it: -1
    where = s.get("commit_index")
    where = where if isinstance(where, int) and not isinstance(where, bool) and 0 <= where < 10**9 else -1
    index = s.get("index") if isinstance(s.get("index"), int) else 0  # within its series
    return {"series": series, "ratio": float(ratio), "direction": s["direction"], "first": commits[0],
            "last": commits[1], "commit_index": where, "index": index, "accepted": accepted if isinstance(accepted, str) else ""}  # fmt: skip


def load_steps(folder: Path | None) -> tuple[list[dict], list[dict]]:
    """The change points' steps (validated: SHAs, a finite ratio; oldest first by their commit's
    place in main's history, whatever order the file lists them in) and the bisections' results;
    what does not validate is left out."""
    if folder is None:
        return [], []
    try:
        data = pvc.load_json(folder / "changepoints" / "steps.json", MAX_STEPS_BYTES)
    except pvc.VerdictError:
        data = {}
    raw = data.get("steps") if isinstance(data, dict) else None
    steps = [s for s in map(_step, raw if isinstance(raw, list) else []) if s]
    steps.sort(key=lambda s: (s["commit_index"], s["series"], s["index"]))
    bisects: list[dict] = []
    for path in sorted(folder.glob("bisect-*/bisect.json")):
        kind = path.parent.name.removeprefix("bisect-")
        try:
            b = pvc.load_json(path, MAX_STEPS_BYTES)
        except pvc.VerdictError:
            continue
        if not isinstance(b, dict) or b.get("stopped") not in BISECT_STOPS or not pvc.KIND.fullmatch(kind):
            continue
        shas = [b.get("good"), b.get("bad")] + ([b["first_bad"]] if b.get("first_bad") is not None else [])
        if all(isinstance(c, str) and pvc.SHA.fullmatch(c) for c in shas):
            bisects.append({"kind": kind, "stopped": b["stopped"], "good": b["good"], "bad": b["bad"],
                            "first_bad": b.get("first_bad")})  # fmt: skip
    return steps, bisects


def steps_section(steps: list[dict], bisects: list[dict]) -> list[str]:
    """Markdown lines: each slowdown of main's history with the commit range it lies in (accepted
    ones say so), oldest first (the newest MAX_STEPS_SHOWN where there are more), then what the
    bisection narrowed."""
    slow = [s for s in steps if s["direction"] == "slowdown"]
    if not slow and not bisects:
        return []
    lines = ["### Which commit", ""]
    if slow:
        lines += ["Steps in main's history (`nox -s changepoints`): each lies after the first commit, up to "
                  "and including the second.", "", "| series | change | commits | |", "|---|---|---|---|"]  # fmt: skip
        if len(slow) > MAX_STEPS_SHOWN:
            lines.append(f"| {len(slow) - MAX_STEPS_SHOWN} older in the `changepoints` artifact | | | |")
        for s in slow[-MAX_STEPS_SHOWN:]:
            mark = "accepted: " + pvc.plain(s["accepted"], 160) if s["accepted"] else "slowdown"
            lines.append(f"| {pvc.plain(s['series'], 160)} | {pvc.percent(s['ratio'])} | "
                         f"{pvc.short(s['last'])}..{pvc.short(s['first'])} | {mark} |")  # fmt: skip
        lines.append("")
    for b in bisects:
        found = f", first bad commit {pvc.short(b['first_bad'])}" if b["first_bad"] else ""
        lines += [f"Bisection on {b['kind']} ({pvc.short(b['good'])}..{pvc.short(b['bad'])}): "
                  f"{pvc.plain(b['stopped'], 40)}{found}.", ""]  # fmt: skip
    return lines


def baseline_tag(folder: Path) -> str:
    """The baseline tag the drift job recorded in ``drift.json``, or "" when missing or malformed."""
    try:
        data = pvc.load_json(folder / "drift.json", MAX_DRIFT_BYTES)
    except pvc.VerdictError:
        return ""
    tag = data.get("baseline") if isinstance(data, dict) else None
    return tag if isinstance(tag, str) and TAG.fullmatch(tag) else ""


def collect(drift: Path, main_sha: str) -> tuple[list[pvc.Entry], str]:
    """Validated entries, one per GPU kind, and the baseline tag they agree on ("" if none or several)."""
    entries = pvc.collect(drift, pvc.Run(head_sha=main_sha), prefix="drift-")
    folders = [drift] if (drift / "verdict.json").exists() else [drift / f"drift-{e.kind}" for e in entries]
    tags = {baseline_tag(f) for f in folders}
    return entries, tags.pop() if len(tags) == 1 else ""


def drifted(entries: list[pvc.Entry]) -> bool:
    """Some kind regressed, whatever else could not be judged."""
    return any(e.status == "regression" or any(r.verdict == "regression" for r in e.rows) for e in entries)


def title(tag: str) -> str:
    return f"Performance drift of main against {tag or 'the last release'}"


def render(entries: list[pvc.Entry], main_sha: str, tag: str, run: pvc.Run,
           steps: tuple[list[dict], list[dict]] = ([], [])) -> str:  # fmt: skip
    """The issue body: what is measured against what, a line per GPU kind, then the rows that drift
    or could not be judged, worst first, each linked to its history; under GitHub's size limit."""
    overall = "regression" if drifted(entries) else pvc.worst(e.status for e in entries)
    base = next((e for e in entries if e.base_sha), None)
    facts = [f"main at {pvc.short(main_sha)}"]
    facts.append(f"baseline `{tag}`" if tag else "baseline: not recorded")
    if base:
        facts[-1] += f" at {pvc.short(base.base_sha)}"
    if run.url:
        facts.append(f"[run]({run.url})")
    if overall == "pass":
        lines = [MARKER, "## Drift of main: ✅ gone", "", " · ".join(facts), ""]
        lines += ["Every check of main is within its threshold of the baseline again: closed.", ""]
        return "\n".join(lines) + "\n"
    lines = [MARKER, f"## Drift of main: {pvc.ICON[overall]}", "", " · ".join(facts), ""]
    lines += [pvc.kind_summary(e) for e in entries] + [""]
    lines += steps_section(*steps)
    tail = [
        "Main is judged against the baseline on every push with the PR gate and its thresholds "
        "(`nox -s drift`); this issue is updated by each run and closed when no check drifts. "
        "Fix the drift, or accept it by releasing (docs/ci.md: moving the drift baseline forward). "
        "Every row is `verdict.md` in the run's `drift-KIND` artifact.",
    ]
    budget = pvc.MAX_BODY - len("\n".join(tail)) - 200
    for e in entries:
        attention = sorted((r for r in e.rows if r.verdict != "pass"), key=pvc.change_key)
        if attention:
            lines += [f"### {e.kind}", "", *pvc.table(attention, True, run.pages), ""]
    if len("\n".join(lines)) > budget:  # cut at a row boundary, and say so
        while len("\n".join([*lines, "", pvc.CUT])) > budget:
            lines.pop()
        lines += ["", pvc.CUT, ""]
    return "\n".join(lines + tail) + "\n"


def bot_issue(client: pvc.Client, repo: str, bot: str) -> int | None:
    """Number of the oldest open ``perf-drift`` issue opened by ``bot``; others' are skipped."""
    for page in range(1, 11):
        issues = client.request(
            "GET",
            f"/repos/{repo}/issues?labels={LABEL}&state=open&sort=created&direction=asc&per_page=100&page={page}",
        )
        for issue in issues:
            if (issue.get("user") or {}).get("login") == bot and "pull_request" not in issue:
                return int(issue["number"])
        if len(issues) < 100:
            break
    return None


def publish(client: pvc.Client, repo: str, entries: list[pvc.Entry], main_sha: str, tag: str,
            run: pvc.Run, bot: str, steps: tuple[list[dict], list[dict]] = ([], [])) -> str:  # fmt: skip
    """Open, update or close the tracking issue; returns what was done, for the log."""
    if not entries:
        return "no drift verdict: the tracking issue is left as it is"
    if not drifted(entries) and any(e.status != "pass" for e in entries):
        return "drift could not be judged: the tracking issue is left as it is"
    number = bot_issue(client, repo, bot)
    body = render(entries, main_sha, tag, run, steps)
    if not drifted(entries):  # every kind passes
        if number is None:
            return "no drift, no tracking issue: nothing to do"
        payload = {"body": body, "state": "closed", "state_reason": "completed"}
        client.request("PATCH", f"/repos/{repo}/issues/{number}", payload)
        return f"no drift: closed #{number}"
    if number is None:
        issue = client.request(
            "POST", f"/repos/{repo}/issues", {"title": title(tag), "body": body, "labels": [LABEL]}
        )
        return f"drift: opened #{issue.get('number')}"
    client.request("PATCH", f"/repos/{repo}/issues/{number}", {"title": title(tag), "body": body})
    return f"drift: updated #{number}"


def main(argv: list[str] | None = None, client: pvc.Client | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drift", type=Path, required=True, help="folder of drift-KIND/ artifact folders")
    parser.add_argument(
        "--steps", type=Path, default=None, help="folder of changepoints/ and bisect-KIND/ artifact folders"
    )
    parser.add_argument("--sha", required=True, help="the commit of main that was judged (github.sha)")
    parser.add_argument("--repo", default=os.environ.get("GITHUB_REPOSITORY", ""), help="owner/name")
    parser.add_argument("--run-url", default="", help="the history run's page")
    parser.add_argument(
        "--pages-url", default="", help="the history page, https://OWNER.github.io/REPO/: links per row"
    )
    parser.add_argument("--bot-login", default=pvc.BOT_LOGIN, help="author of the issue this script edits")
    parser.add_argument("--dry-run", action="store_true", help="print the issue body; post nothing")
    args = parser.parse_args(argv)

    if not pvc.SHA.fullmatch(args.sha):
        parser.error("--sha must be a 40-hex commit SHA")
    if args.pages_url and not pvc.PAGES_URL.fullmatch(args.pages_url):
        parser.error(f"--pages-url must match {pvc.PAGES_URL.pattern}")
    url = args.run_url if pvc.RUN_URL.fullmatch(args.run_url) else ""
    run = pvc.Run(head_sha=args.sha, url=url, pages=args.pages_url)
    entries, tag = collect(args.drift, args.sha)
    steps = load_steps(args.steps)
    if args.dry_run:
        sys.stdout.write(render(entries, args.sha, tag, run, steps) if entries else "no drift verdict\n")
        return 0

    token = os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN") or ""
    if not pvc.REPO.fullmatch(args.repo) or (client is None and not token):
        parser.error("posting needs GH_TOKEN and --repo owner/name (or use --dry-run)")
    client = client or pvc.GitHub(os.environ.get("GITHUB_API_URL", "https://api.github.com"), token)
    try:
        print(publish(client, args.repo, entries, args.sha, tag, run, args.bot_login, steps))
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"GitHub API error {exc.code} on {exc.url}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
