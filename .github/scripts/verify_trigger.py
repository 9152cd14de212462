#!/usr/bin/env python3
"""Verify the workflow run that triggered the comment job, from the API, before any token is minted.

The run is looked up by its id and believed only when the API says it ran ``.github/workflows/
gpu.yml`` of the default branch's history in this repository, on ``pull_request_target``, for an
open pull request into the default branch (the checks and why: docs/ci.md). What is believed is
written as JSON for ``post_verdict_comment.py --trigger``:

    python3 .github/scripts/verify_trigger.py --repo OWNER/NAME --run-id ID --out trigger.json

Exit 0 when the run is verified, 1 (writing nothing) when it is not. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Protocol

WORKFLOW = ".github/workflows/gpu.yml"
EVENT = "pull_request_target"
RUN_TITLE = re.compile(r"GPU verdict #([1-9][0-9]{0,8}) at ([0-9a-f]{40})")  # run-name of gpu.yml
SHA = re.compile(r"[0-9a-f]{40}")
REPO = re.compile(r"[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}")
RUN_URL = re.compile(
    r"https://[A-Za-z0-9.-]{1,100}/[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}/actions/runs/\d{1,20}"
)
CONCLUSIONS = {"success", "failure", "cancelled", "timed_out", "skipped", "neutral", "action_required",
               "startup_failure", "stale"}  # fmt: skip


class TriggerError(ValueError):
    """The run is not one this job may report on."""


class Client(Protocol):
    def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any: ...


class GitHub:
    """The REST API with a token; the only part of the scripts that touches the network."""

    def __init__(self, api: str, token: str) -> None:
        self.api, self.token = api.rstrip("/"), token

    def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.api}{path}",
            method=method,
            data=None if payload is None else json.dumps(payload).encode(),
            headers={
                "Accept": "application/vnd.github+json",
                "Authorization": f"Bearer {self.token}",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "rmsnorm-kernel-verdict-comment",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


def client_from_env() -> GitHub:
    token = os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN") or ""
    if not token:
        raise SystemExit("needs GH_TOKEN")
    return GitHub(os.environ.get("GITHUB_API_URL", "https://api.github.com"), token)


def require(ok: bool, why: str) -> None:
    if not ok:
        raise TriggerError(why)


def verify(client: Client, repo: str, run_id: int, workflow: str = WORKFLOW) -> dict[str, Any]:
    """What the API says about run ``run_id``, checked; raises TriggerError when not to be believed."""
    run = client.request("GET", f"/repos/{repo}/actions/runs/{run_id}")
    require(isinstance(run, dict) and run.get("id") == run_id, "the API returned another run")
    path = str(run.get("path") or "")
    require(path.split("@", 1)[0] == workflow, f"the run is of {path[:100]!r}, not {workflow}")
    require(run.get("event") == EVENT, f"the run was started by {str(run.get('event'))[:40]!r}, not {EVENT}")
    require((run.get("repository") or {}).get("full_name") == repo, "the run belongs to another repository")
    require(run.get("status") == "completed", "the run has not completed")
    conclusion = run.get("conclusion")
    require(conclusion in CONCLUSIONS, "the run has no known conclusion")

    # pull_request_target runs the workflow file of the pull request's base branch at the run's
    # commit: a definition from anywhere but the default branch's history is not main's judge.
    default = (client.request("GET", f"/repos/{repo}") or {}).get("default_branch") or ""
    require(bool(default), "the repository has no default branch")
    definition = str(run.get("head_sha") or "")
    require(bool(SHA.fullmatch(definition)), "the run has no commit")
    compared = client.request(
        "GET", f"/repos/{repo}/compare/{definition}...{urllib.parse.quote(default, safe='')}"
    )
    require(
        (compared or {}).get("status") in ("identical", "ahead"),
        f"the run's definition ({definition[:12]}) is not on {default}'s history",
    )

    title = RUN_TITLE.fullmatch(str(run.get("display_title") or ""))
    require(title is not None, "the run's title is not 'GPU verdict #N at SHA'")
    number, head = int(title.group(1)), title.group(2)
    listed = run.get("pull_requests") or []  # the API lists them for same-repository heads only
    if listed:
        mine = [p for p in listed if p.get("number") == number]
        require(bool(mine), f"the run's pull requests do not include #{number}")
        require(((mine[0].get("head") or {}).get("sha")) == head, "the run's pull request has another head")
    pull = client.request("GET", f"/repos/{repo}/pulls/{number}") or {}
    base = pull.get("base") or {}
    require(base.get("ref") == default, f"#{number} is not a pull request into {default}")
    require((base.get("repo") or {}).get("full_name") == repo, f"#{number} is into another repository")
    url = str(run.get("html_url") or "")
    return {
        "run_id": run_id,
        "number": number,
        "head_sha": head,
        "conclusion": conclusion,
        "url": url if RUN_URL.fullmatch(url) else "",
    }


def main(argv: list[str] | None = None, client: Client | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="owner/name")
    parser.add_argument("--run-id", required=True, help="the triggering run (workflow_run.id)")
    parser.add_argument("--workflow", default=WORKFLOW, help="the only workflow file believed")
    parser.add_argument("--out", type=Path, required=True, help="where the verified facts go (JSON)")
    args = parser.parse_args(argv)
    if not REPO.fullmatch(args.repo) or not args.run_id.isdigit():
        parser.error("--repo must be owner/name and --run-id a number")
    try:
        facts = verify(client or client_from_env(), args.repo, int(args.run_id), args.workflow)
    except TriggerError as exc:
        print(f"::error::not reporting on run {args.run_id}: {re.sub(r'[^ -~]', '?', str(exc))}")
        return 1
    except urllib.error.HTTPError as exc:
        print(f"::error::GitHub API error {exc.code} while verifying run {args.run_id}")
        return 1
    args.out.write_text(json.dumps(facts) + "\n", encoding="utf-8")
    print(f"verified: run {args.run_id} of {args.workflow}, #{facts['number']} at {facts['head_sha'][:12]}, "
          f"{facts['conclusion']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
