#!/usr/bin/env python3
"""Find the GPU verdict of the pull request a push to main merged, for the history's accepted rows.

The pull request is the one the API says was merged as ``--sha`` into the default branch; its
verdict run is the newest successful run of gpu.yml titled ``GPU verdict #N at HEAD`` for that
pull request's last head, believed only as verify_trigger.py believes the comment job's run.
Writes ``run-id``, ``pull`` and ``head`` to ``$GITHUB_OUTPUT`` (nothing when there is none: a direct push,
a pull request without a passing verdict at its head). Standard library only.

    python3 .github/scripts/merged_verdict.py --repo OWNER/NAME --sha SHA
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
from typing import Any

import verify_trigger as vt

MAX_PAGES = 5  # 500 successful verdict runs, newest first


def merged_pull(client: vt.Client, repo: str, sha: str) -> dict[str, Any] | None:
    """The pull request merged into the default branch as commit ``sha``, or None."""
    default = (client.request("GET", f"/repos/{repo}") or {}).get("default_branch") or ""
    for pull in client.request("GET", f"/repos/{repo}/commits/{sha}/pulls") or []:
        base, head = pull.get("base") or {}, pull.get("head") or {}
        if (
            pull.get("merged_at")
            and pull.get("merge_commit_sha") == sha
            and base.get("ref") == default
            and (base.get("repo") or {}).get("full_name") == repo
            and vt.SHA.fullmatch(str(head.get("sha") or ""))
            and isinstance(pull.get("number"), int)
        ):
            return pull
    return None


def verdict_run(client: vt.Client, repo: str, number: int, head: str) -> int | None:
    """The newest successful gpu.yml run for pull request ``number`` at ``head`` that verifies."""
    title = f"GPU verdict #{number} at {head}"
    workflow = vt.WORKFLOW.rsplit("/", 1)[-1]
    for page in range(1, MAX_PAGES + 1):
        listed = (
            client.request(
                "GET",
                f"/repos/{repo}/actions/workflows/{workflow}/runs?event={vt.EVENT}&status=success"
                f"&per_page=100&page={page}",
            )
            or {}
        )
        runs = listed.get("workflow_runs") or []
        for run in sorted(runs, key=lambda r: -int(r.get("id") or 0)):
            if run.get("display_title") != title or not isinstance(run.get("id"), int):
                continue
            try:
                facts = vt.verify(client, repo, run["id"])
            except vt.TriggerError as exc:
                print(f"merged verdict: run {run['id']} not believed: {exc}")
                continue
            if facts["conclusion"] == "success" and (facts["number"], facts["head_sha"]) == (number, head):
                return run["id"]
        if len(runs) < 100:
            break
    return None


def main(argv: list[str] | None = None, client: vt.Client | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="owner/name")
    parser.add_argument("--sha", required=True, help="the pushed commit of main (github.sha)")
    args = parser.parse_args(argv)
    if not vt.REPO.fullmatch(args.repo) or not vt.SHA.fullmatch(args.sha):
        parser.error("--repo must be owner/name and --sha a 40-hex commit")
    client = client or vt.client_from_env()
    try:
        pull = merged_pull(client, args.repo, args.sha)
        run = verdict_run(client, args.repo, pull["number"], pull["head"]["sha"]) if pull else None
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"GitHub API error {exc.code} on {exc.url}") from None
    if pull is None or run is None:
        why = (
            "no pull request was merged as it"
            if pull is None
            else f"#{pull['number']} has no passing verdict"
        )
        print(f"merged verdict: {args.sha[:12]}: {why}; no accepted rows to record")
        return 0
    print(f"merged verdict: {args.sha[:12]} merged #{pull['number']}; its verdict is run {run}")
    output = os.environ.get("GITHUB_OUTPUT")
    if output:
        with open(output, "a", encoding="utf-8") as out:
            out.write(f"run-id={run}\npull={pull['number']}\nhead={pull['head']['sha']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
