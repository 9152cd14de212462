"""The rehearsal's stand-ins for the actions the workflows use (act cannot fetch them offline).

Each ``tools/rehearse/actions/OWNER/NAME/action.yml`` is a composite action that calls one
command here with its inputs in the environment (``INPUT_*``); act maps ``OWNER/NAME@SHA`` to it
with ``--local-repository``. What each approximates:

- ``checkout``: a clone of the local bare repository ``REHEARSE_ORIGIN`` (GitHub's copy) at
  ``ref`` or the default branch; ``fetch-depth`` 0 (all history and tags) or 1, ``path``,
  ``sparse-checkout`` (non-cone). No credentials are ever written (persist-credentials ignored).
- ``upload``: the files of ``path`` (lines; a folder is taken whole, hidden files only with
  ``include-hidden-files``), zipped relative to the paths' common folder (a folder's own, for
  one), posted to the fake API; ``if-no-files-found``: error, warn or ignore.
- ``download``: the REST calls download-artifact makes with ``run-id`` and ``github-token``:
  list the run's artifacts, keep those matching ``name`` or ``pattern``, unzip each into
  ``path/NAME`` (or into ``path`` with ``merge-multiple`` or ``name``); without ``run-id``, this
  run's own artifacts with the job's token (the real action uses the runtime's).
- ``pages-archive`` (upload-pages-artifact's tar, then ``upload``) and ``deploy-pages``: their
  functions, and docs/ci.md ("The offline rehearsal"), say what they do and approximate.
- ``app-token``: create-github-app-token's two calls (the installation of the repository, then an
  installation token), the private key standing for the JWT it signs; outputs ``token``,
  ``app-slug`` and ``installation-id``.

Standard library only.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path


def inp(name: str, default: str = "") -> str:
    return os.environ.get(f"INPUT_{name.upper().replace('-', '_')}", "") or default


def api(method: str, path: str, token: str, payload=None, raw: bytes | None = None):
    url = os.environ["GITHUB_API_URL"].rstrip("/") + path
    data = raw if raw is not None else None if payload is None else json.dumps(payload).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["Content-Type"] = "application/zip" if raw is not None else "application/json"
    with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=30) as r:
        body = r.read()
        return body if r.headers.get("Content-Type") == "application/zip" else json.loads(body or b"null")


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "advice.detachedHead=false", *args], cwd=cwd, check=True)


def checkout() -> None:
    target = Path(os.environ["GITHUB_WORKSPACE"]) / inp("path", ".")
    origin = os.environ["REHEARSE_ORIGIN"]
    ref = inp("ref", "main")
    target.mkdir(parents=True, exist_ok=True)
    depth = [] if inp("fetch-depth", "1") == "0" else ["--depth", inp("fetch-depth", "1")]
    git("init", "-q", "-b", "rehearse-empty", cwd=target)
    git("remote", "add", "origin", origin, cwd=target)
    tags = ["--tags"] if not depth or inp("fetch-tags") == "true" else ["--no-tags"]
    git("fetch", "-q", *depth, *tags, "origin", f"+{ref}:refs/remotes/origin/{ref}"
        if not ref.startswith("refs/") else ref, cwd=target)  # fmt: skip
    sparse = [line.strip() for line in inp("sparse-checkout").splitlines() if line.strip()]
    if sparse:
        git("sparse-checkout", "set", "--no-cone", *sparse, cwd=target)
    git("checkout", "-q", "-B", ref.rsplit("/", 1)[-1], "FETCH_HEAD", cwd=target)


def upload() -> None:
    workspace = Path(os.environ["GITHUB_WORKSPACE"])
    hidden = inp("include-hidden-files") == "true"
    files: list[Path] = []
    roots: list[str] = []  # the real action zips relative to the search paths' common folder
    for line in inp("path").splitlines():
        if not line.strip():
            continue
        p = workspace / line.strip()
        roots.append(str(p if p.is_dir() else p.parent))
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in sorted(p.rglob("*")) if f.is_file() and
                      (hidden or not any(part.startswith(".") for part in f.relative_to(p).parts))]  # fmt: skip
    name = inp("name", "artifact")
    if not files:
        mode = inp("if-no-files-found", "warn")
        print(f"{'::error::' if mode == 'error' else '::warning::' if mode == 'warn' else ''}"
              f"no files found for the artifact {name}")  # fmt: skip
        sys.exit(1 if mode == "error" else 0)
    root = Path(os.path.commonpath(roots))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for f in files:
            archive.write(f, f.relative_to(root).as_posix())
    made = api("POST", f"/_rehearse/upload?name={name}", "", raw=buffer.getvalue())
    output(f"artifact-id={made['id']}")
    print(f"uploaded {len(files)} files as {name}")


def output(line: str) -> None:
    with open(os.environ["GITHUB_OUTPUT"], "a", encoding="utf-8") as out:
        out.write(line + "\n")


def pages_archive() -> None:
    """upload-pages-artifact's archive step: ``path`` as ``$RUNNER_TEMP/artifact.tar``, links
    stored as the files they name, every hidden name (``.git``, ``.github``, ``.*``) left out."""
    site = Path(os.environ["GITHUB_WORKSPACE"]) / inp("path", "_site/")
    if not site.is_dir():
        sys.exit(f"::error::tar: {inp('path', '_site/')}: no such folder")
    archive = Path(os.environ["RUNNER_TEMP"]) / "artifact.tar"
    count = 0
    # dereference: a symbolic or hard link goes in as the file it names (Pages refuses links)
    with tarfile.open(archive, "w", dereference=True) as tar:
        tar.add(site, arcname=".", recursive=False)
        for folder, dirs, names in os.walk(site, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in [*dirs, *sorted(n for n in names if not n.startswith("."))]:
                path = Path(folder) / name
                tar.add(path, arcname="./" + path.relative_to(site).as_posix(), recursive=False)
                count += path.is_file()
    print(f"archived {count} files of {inp('path', '_site/')} in {archive}")


def download() -> None:
    repo, token = os.environ["GITHUB_REPOSITORY"], inp("github-token")
    if not inp("run-id"):  # this run's artifacts: the real action reads them with the runtime's token
        token = os.environ.get("REHEARSE_RUNTIME_TOKEN", "")
    run_id = inp("run-id") or os.environ.get("GITHUB_RUN_ID", "")
    dest = Path(os.environ["GITHUB_WORKSPACE"]) / inp("path", ".")
    listed = api("GET", f"/repos/{repo}/actions/runs/{run_id}/artifacts", token)["artifacts"]
    name, pattern = inp("name"), inp("pattern")
    chosen = [
        a for a in listed if (a["name"] == name if name else fnmatch.fnmatchcase(a["name"], pattern or "*"))
    ]
    if name and not chosen:
        sys.exit(f"::error::no artifact named {name}")
    merge = bool(name) or inp("merge-multiple") == "true"
    for art in chosen:
        data = api("GET", art["archive_download_url"], token)
        folder = dest if merge else dest / art["name"]
        folder.mkdir(parents=True, exist_ok=True)
        zipfile.ZipFile(io.BytesIO(data)).extractall(folder)
    print(f"downloaded {len(chosen)} artifacts into {dest}")


def deploy_pages() -> None:
    """deploy-pages: this run's one artifact named ``artifact_name`` handed to the fake's Pages
    endpoint with ``token``, its status polled; ``page_url``. No OIDC token (act has none): the
    fake checks that ``token`` is the job's instead."""
    repo, token, sha = os.environ["GITHUB_REPOSITORY"], inp("token"), os.environ["GITHUB_SHA"]
    name = inp("artifact_name", "github-pages")
    listed = api("GET", f"/repos/{repo}/actions/runs/{os.environ['GITHUB_RUN_ID']}/artifacts", token)
    named = [a for a in listed["artifacts"] if a["name"] == name]
    if len(named) != 1:
        sys.exit(f"::error::{len(named)} artifacts named {name} in this run, where one is deployed")
    payload = {"artifact_id": named[0]["id"], "pages_build_version": sha, "oidc_token": ""}
    try:
        made = api("POST", f"/repos/{repo}/pages/deployments", token, payload)
    except urllib.error.HTTPError as exc:
        sys.exit(f"::error::Failed to create deployment (status: {exc.code}): {exc.read().decode()}")
    output(f"page_url={made['page_url']}")
    for _ in range(20):
        status = api("GET", f"/repos/{repo}/pages/deployments/{made['id']}", token)["status"]
        if status == "succeed":
            print(f"deployed artifact {named[0]['id']} ({name}) at {sha[:12]}: {made['page_url']}")
            return
        if status in ("deployment_failed", "deployment_content_failed", "deployment_cancelled"):
            sys.exit(f"::error::the deployment ended {status}")
        time.sleep(0.2)
    sys.exit("::error::the deployment did not report success")


def app_token() -> None:
    repo = os.environ["GITHUB_REPOSITORY"]
    key = inp("private-key")  # stands for the JWT the action signs with it
    installation = api("GET", f"/repos/{repo}/installation", key)
    permissions = {k.removeprefix("INPUT_PERMISSION_").lower().replace("_", "-"): v
                   for k, v in os.environ.items() if k.startswith("INPUT_PERMISSION_") and v}  # fmt: skip
    minted = api("POST", f"/app/installations/{installation['id']}/access_tokens", key,
                 {"repositories": [repo.split("/")[1]], "permissions": permissions})  # fmt: skip
    output(f"token={minted['token']}\napp-slug={installation['app_slug']}")
    output(f"installation-id={installation['id']}")
    print(f"::add-mask::{minted['token']}")


if __name__ == "__main__":
    {"checkout": checkout, "upload": upload, "download": download, "app-token": app_token,
     "pages-archive": pages_archive, "deploy-pages": deploy_pages}[sys.argv[1]]()  # fmt: skip
