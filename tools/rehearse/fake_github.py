"""A small fake of the GitHub REST API for the offline rehearsal of the PR flow (``nox -s rehearse``).

It serves, over HTTP on 127.0.0.1, what the rehearsed jobs and their stand-in actions call: the
repository, workflow runs (by id, and a workflow's runs list) and their artifacts, compare,
pull requests (by number, and those of a commit), issue comments, commit statuses, check runs,
Pages deployments and the App installation token; and it records every write. The test registers
the runs (act does not report them) and evaluates the ruleset the project ships
(``.github/rulesets/main.json``) against the checks and statuses received.

Where it approximates GitHub (docs/ci.md, "The offline rehearsal" lists these too):
- tokens are opaque strings mapped to an actor: the job token acts as the GitHub Actions app,
  the App's installation token as the App, a personal token as a user; permissions of a job
  token are not enforced (the workflow files' ``permissions:`` are checked by the tests);
- ``compare`` answers from the local bare repository with ``git merge-base``;
- artifacts are uploaded to a private endpoint (the real service is not the REST API) and
  downloaded through the REST endpoints download-artifact uses;
- the ruleset evaluation covers only ``required_status_checks`` (context and integration id);
- a Pages deployment needs the job token (where GitHub checks an OIDC token, which act cannot
  mint), ``pages_build_version`` and this run's ``github-pages`` artifact, one ``artifact.tar``
  of files and folders only, as Pages requires; it succeeds at once and serves nothing.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
import threading
import urllib.parse
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ACTIONS_APP_ID = 15368  # the GitHub Actions app: the source of checks and statuses made with a job token
PASSING = {"success", "neutral", "skipped"}  # check conclusions a required check accepts


@dataclass
class Actor:
    login: str
    app_id: int | None = None  # the app a check run or status is attributed to


@dataclass
class State:
    repo: str
    origin: Path  # the bare repository standing for GitHub's copy
    app_id: int
    app_slug: str
    app_key: str  # the App's private key as the secret holds it
    tokens: dict[str, Actor] = field(default_factory=dict)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # {id, run_id, name, zip}
    pulls: dict[int, dict[str, Any]] = field(default_factory=dict)
    comments: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)  # Pages: {id, artifact_id, ...}
    uploading_run: int = 0  # the run the act invocation under way stands for
    log: list[str] = field(default_factory=list)

    def ancestor(self, older: str, newer: str) -> bool:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", older, newer], cwd=self.origin)
        return done.returncode == 0

    def merge_allowed(self, sha: str, ruleset: dict[str, Any]) -> tuple[bool, str]:
        """The ruleset's required status checks on ``sha``: each needs the latest check run of its
        name from its integration (or any source without one) to pass, or such a commit status."""
        for rule in ruleset.get("rules", []):
            if rule.get("type") != "required_status_checks":
                continue
            for required in rule["parameters"]["required_status_checks"]:
                context, app = required["context"], required.get("integration_id")
                checks = [c for c in self.checks if c["head_sha"] == sha and c["name"] == context
                          and (app is None or c["app_id"] == app)]  # fmt: skip
                statuses = [s for s in self.statuses if s["sha"] == sha and s["context"] == context
                            and (app is None or s["app_id"] == app)]  # fmt: skip
                if checks and checks[-1]["conclusion"] in PASSING:
                    continue
                if not checks and statuses and statuses[-1]["state"] == "success":
                    continue
                return False, f"{context!r} from integration {app} is not satisfied on {sha[:12]}"
        return True, "every required check passes"


class Handler(BaseHTTPRequestHandler):
    state: State  # set on the subclass made per server

    def log_message(self, *args) -> None:  # quiet: the test prints State.log when it fails
        pass

    def reply(self, code: int, body: Any = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/zip" if raw is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def actor(self) -> Actor | None:
        auth = self.headers.get("Authorization", "")
        token = re.sub(r"^(Bearer|token)\s+", "", auth)
        return self.state.tokens.get(token)

    def payload(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        return data if self.headers.get("Content-Type") == "application/zip" else json.loads(data or b"null")

    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def do_PATCH(self) -> None:
        self.route("PATCH")

    def route(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path.removeprefix("/api"), urllib.parse.parse_qs(url.query)
        s = self.state
        s.log.append(f"{method} {path}")
        actor = self.actor()
        if path == "/_rehearse/upload" and method == "POST":  # upload-artifact's stand-in
            name = query["name"][0]
            art = {
                "id": 1000 + len(s.artifacts),
                "run_id": s.uploading_run,
                "name": name,
                "zip": self.payload(),
            }
            s.artifacts.append(art)
            return self.reply(201, {"id": art["id"]})
        if actor is None:
            return self.reply(401, {"message": "Bad credentials"})
        repo = f"/repos/{s.repo}"
        if method == "GET" and path == f"{repo}/installation":
            ok = actor.login == "app-jwt"
            return self.reply(200, {"id": 1, "app_slug": s.app_slug}) if ok else self.reply(401, {})
        if method == "POST" and path == "/app/installations/1/access_tokens":
            if actor.login != "app-jwt":
                return self.reply(401, {"message": "A JSON web token could not be decoded"})
            token = f"ghs_app_{len(s.tokens)}"
            s.tokens[token] = Actor(f"{s.app_slug}[bot]", s.app_id)
            return self.reply(
                201, {"token": token, "permissions": (self.payload() or {}).get("permissions", {})}
            )
        if method == "GET" and path == repo:
            return self.reply(
                200, {"full_name": s.repo, "name": s.repo.split("/")[1], "default_branch": "main"}
            )
        if method == "GET" and (m := re.fullmatch(rf"{repo}/actions/runs/(\d+)", path)):
            run = s.runs.get(int(m[1]))
            return self.reply(200, run) if run else self.reply(404, {"message": "Not Found"})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/actions/workflows/([\w.-]+)/runs", path)):
            event, status = query.get("event", [""])[0], query.get("status", [""])[0]
            per_page, page = int(query.get("per_page", ["30"])[0]), int(query.get("page", ["1"])[0])
            runs = sorted((r for r in s.runs.values() if r["path"].split("@", 1)[0] == f".github/workflows/{m[1]}"
                           and (not event or r["event"] == event)
                           and (not status or status in (r["status"], r["conclusion"]))),
                          key=lambda r: -r["id"])  # fmt: skip
            listed = runs[(page - 1) * per_page : page * per_page]
            return self.reply(200, {"total_count": len(runs), "workflow_runs": listed})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/commits/([0-9a-f]{{40}})/pulls", path)):
            merged = [p for p in s.pulls.values() if m[1] in (p.get("merge_commit_sha"), p["head"]["sha"])]
            return self.reply(200, merged)
        if method == "GET" and (m := re.fullmatch(rf"{repo}/actions/runs/(\d+)/artifacts", path)):
            arts = [a for a in s.artifacts if a["run_id"] == int(m[1])]
            listed = [{"id": a["id"], "name": a["name"], "expired": False, "size_in_bytes": len(a["zip"]),
                       "archive_download_url": f"{repo}/actions/artifacts/{a['id']}/zip"} for a in arts]  # fmt: skip
            return self.reply(200, {"total_count": len(listed), "artifacts": listed})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/actions/artifacts/(\d+)/zip", path)):
            art = next((a for a in s.artifacts if a["id"] == int(m[1])), None)
            return self.reply(200, raw=art["zip"]) if art else self.reply(404, {})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/compare/([0-9a-f]{{40}})\.\.\.(.+)", path)):
            base, head = m[1], urllib.parse.unquote(m[2])
            rev = subprocess.run(["git", "rev-parse", "--verify", "-q", head], cwd=s.origin,
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
            if not rev:
                return self.reply(404, {})
            status = "identical" if rev == base else "ahead" if s.ancestor(base, rev) else "diverged"
            return self.reply(200, {"status": status})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/pulls/(\d+)", path)):
            pull = s.pulls.get(int(m[1]))
            return self.reply(200, pull) if pull else self.reply(404, {})
        if (m := re.fullmatch(rf"{repo}/issues/(\d+)/comments", path)) and int(m[1]) in s.pulls:
            if method == "GET":
                page = int(query.get("page", ["1"])[0])
                mine = [c for c in s.comments if c["issue"] == int(m[1])]
                return self.reply(200, mine[(page - 1) * 100 : page * 100])
            comment = {"id": 500 + len(s.comments), "issue": int(m[1]), "body": self.payload()["body"],
                       "user": {"login": actor.login}}  # fmt: skip
            s.comments.append(comment)
            return self.reply(201, comment)
        if method == "PATCH" and (m := re.fullmatch(rf"{repo}/issues/comments/(\d+)", path)):
            comment = next((c for c in s.comments if c["id"] == int(m[1])), None)
            if comment is None or comment["user"]["login"] != actor.login:  # the fake: authors edit
                return self.reply(404 if comment is None else 403, {})
            comment["body"] = self.payload()["body"]
            return self.reply(200, comment)
        if method == "POST" and path == f"{repo}/pages/deployments":
            body = self.payload() or {}
            art = next((a for a in s.artifacts if a["id"] == body.get("artifact_id")), None)
            code, refused = pages_refusal(actor, body, art, s.uploading_run)
            if refused:
                return self.reply(code, {"message": refused})
            owner, name = s.repo.split("/")
            # the run the artifact belongs to, as uploaded: a test can tell another run's apart
            made = {"id": len(s.deployments) + 1, "artifact_id": art["id"], "status": "succeed",
                    "pages_build_version": body["pages_build_version"], "run_id": art["run_id"],
                    "page_url": f"https://{owner}.github.io/{name}/"}  # fmt: skip
            s.deployments.append(made)
            return self.reply(200, {**made, "status_url": f"{repo}/pages/deployments/{made['id']}"})
        if method == "GET" and (m := re.fullmatch(rf"{repo}/pages/deployments/(\d+)", path)):
            made = next((d for d in s.deployments if d["id"] == int(m[1])), None)
            return self.reply(200, {"status": made["status"]}) if made else self.reply(404, {})
        if method == "POST" and path == f"{repo}/check-runs":
            if actor.app_id is None:  # GitHub: only apps create check runs
                return self.reply(403, {"message": "You must authenticate via a GitHub App."})
            check = {**self.payload(), "app_id": actor.app_id, "id": 700 + len(s.checks)}
            s.checks.append(check)
            return self.reply(201, check)
        if method == "POST" and (m := re.fullmatch(rf"{repo}/statuses/([0-9a-f]{{40}})", path)):
            status = {**self.payload(), "sha": m[1], "app_id": actor.app_id, "creator": actor.login}
            s.statuses.append(status)
            return self.reply(201, status)
        return self.reply(404, {"message": f"the fake has no {method} {path}"})


def pages_refusal(
    actor: Actor, body: dict[str, Any], art: dict[str, Any] | None, run_id: int
) -> tuple[int, str]:
    """Why Pages would refuse to deploy ``art`` for run ``run_id``: (HTTP status, message), or
    (0, "") when it would not. Refused: a caller other than the job token (GitHub asks for the
    job's OIDC token instead), no ``pages_build_version``, an artifact of another run or not
    named ``github-pages``, or one that is not one tar (artifact.tar) of plain files and folders."""
    if actor.app_id != ACTIONS_APP_ID:
        return 403, f"{actor.login} is not a workflow job: only a job's token deploys Pages"
    if not body.get("pages_build_version"):
        return 400, "pages_build_version is missing"
    if art is None or art["run_id"] != run_id:
        return 400, "no such artifact in this workflow run"
    if art["name"] != "github-pages":
        return 400, f"the artifact is named {art['name']!r}, not 'github-pages'"
    try:
        with zipfile.ZipFile(io.BytesIO(art["zip"])) as archive:
            if archive.namelist() != ["artifact.tar"]:
                return 400, f"the artifact holds {archive.namelist()}, not one artifact.tar"
            with tarfile.open(fileobj=io.BytesIO(archive.read("artifact.tar"))) as tar:
                odd = [m.name for m in tar.getmembers() if not (m.isfile() or m.isdir())]
    except (zipfile.BadZipFile, tarfile.TarError) as exc:
        return 400, f"the artifact does not read: {exc}"
    return (400, f"the tar holds links or special files: {odd[:3]}") if odd else (0, "")


def serve(state: State) -> tuple[ThreadingHTTPServer, str]:
    """Start the fake on a free port of 127.0.0.1; (server, base URL)."""
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
