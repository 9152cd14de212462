"""The rehearsal's Pages stand-ins and the fake's Pages checks, without act: upload-pages-artifact's
archive (links, hidden names), upload's ``if-no-files-found``, and what the fake's Pages endpoint
refuses (tools/rehearse/standins.py, fake_github.py; docs/ci.md, "The offline rehearsal")."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "rehearse"
if not (TOOLS / "standins.py").is_file():
    pytest.skip("tools/rehearse is not in this checkout", allow_module_level=True)
sys.path.insert(0, str(TOOLS))
import standins  # noqa: E402
from fake_github import ACTIONS_APP_ID, Actor, State, pages_refusal, serve  # noqa: E402
from rehearse import APP_ID, APP_KEY, APP_SLUG, JOB_TOKEN, REPO, WRITER_TOKEN  # noqa: E402

JOB = Actor("github-actions[bot]", ACTIONS_APP_ID)
RUN = 101
SHA = "f" * 40


def make_site(workspace: Path) -> Path:
    """``workspace/site``: two pages, a hard link, a symbolic link to a file outside the folder, and
    hidden names (``.git``, ``.github``, ``.hidden``, a hidden file in a subfolder)."""
    site = workspace / "site"
    (site / "graphs").mkdir(parents=True)
    (site / "index.html").write_text("<h1>page</h1>")
    (site / "graphs" / "a.json").write_text("[[1, 0.5]]")
    os.link(site / "index.html", site / "copy.html")
    (workspace / "outside.txt").write_text("from outside the site")
    (site / "linked.txt").symlink_to(workspace / "outside.txt")
    for hidden in (".git/config", ".github/workflows/x.yml", ".hidden", "graphs/.cache"):
        (site / hidden).parent.mkdir(parents=True, exist_ok=True)
        (site / hidden).write_text("hidden")
    return site


def members(tar_path: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (kind, contents) of each member: kind "dir", "file" or "other" (a link, a device)."""
    found = {}
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            kind = "dir" if m.isdir() else "file" if m.isfile() else "other"
            found[m.name.rstrip("/")] = (kind, tar.extractfile(m).read() if m.isfile() else b"")
    return found


EXPECTED = {
    ".": ("dir", b""),
    "./index.html": ("file", b"<h1>page</h1>"),
    "./copy.html": ("file", b"<h1>page</h1>"),
    "./linked.txt": ("file", b"from outside the site"),
    "./graphs": ("dir", b""),
    "./graphs/a.json": ("file", b"[[1, 0.5]]"),
}


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    (tmp_path / "runner-temp").mkdir()
    (tmp_path / "ws").mkdir()
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.setenv("RUNNER_TEMP", str(tmp_path / "runner-temp"))
    monkeypatch.setenv("GITHUB_OUTPUT", str(tmp_path / "output"))
    for name in [k for k in os.environ if k.startswith("INPUT_")]:
        monkeypatch.delenv(name)
    return tmp_path / "ws"


def test_the_pages_archive_stores_links_as_files_and_leaves_hidden_names_out(workspace, monkeypatch):
    make_site(workspace)
    monkeypatch.setenv("INPUT_PATH", "site/")
    standins.pages_archive()
    assert members(workspace.parent / "runner-temp" / "artifact.tar") == EXPECTED


@pytest.mark.skipif(
    shutil.which("tar") is None
    or "GNU tar" not in subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout,
    reason="needs GNU tar (the real upload-pages-artifact's)",
)
def test_the_pages_archive_holds_what_the_real_actions_tar_holds(tmp_path):
    """upload-pages-artifact v4's own tar command on the same folder gives the same members."""
    site = make_site(tmp_path)
    subprocess.run(["tar", "--dereference", "--hard-dereference", "--directory", str(site), "-cf",
                    str(tmp_path / "real.tar"), "--exclude=.git", "--exclude=.github",
                    "--exclude=.[^/]*", "."], check=True)  # fmt: skip
    assert members(tmp_path / "real.tar") == EXPECTED


def test_the_pages_archive_of_a_missing_folder_fails(workspace, monkeypatch):
    monkeypatch.setenv("INPUT_PATH", "_site/")
    with pytest.raises(SystemExit, match="::error::tar: _site/: no such folder"):
        standins.pages_archive()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The fake API served, its Pages tokens as the rehearsal sets them, run RUN under way."""
    state = State(REPO, tmp_path / "origin.git", APP_ID, APP_SLUG, APP_KEY)
    state.tokens.update({JOB_TOKEN: JOB, APP_KEY: Actor("app-jwt"), WRITER_TOKEN: Actor("mallory")})
    state.uploading_run = RUN
    server, url = serve(state)
    monkeypatch.setenv("GITHUB_API_URL", url)
    monkeypatch.setenv("GITHUB_REPOSITORY", REPO)
    monkeypatch.setenv("GITHUB_RUN_ID", str(RUN))
    monkeypatch.setenv("GITHUB_SHA", SHA)
    yield state
    server.shutdown()


@pytest.mark.parametrize("mode, code, line", [("error", 1, "::error::"), ("warn", 0, "::warning::")])
def test_an_upload_with_no_files_fails_only_under_error(
    workspace, fake, monkeypatch, capsys, mode, code, line
):
    (workspace / "empty").mkdir()
    monkeypatch.setenv("INPUT_PATH", "empty")
    monkeypatch.setenv("INPUT_NAME", "github-pages")
    monkeypatch.setenv("INPUT_IF_NO_FILES_FOUND", mode)
    with pytest.raises(SystemExit) as stopped:
        standins.upload()
    assert stopped.value.code == code
    assert f"{line}no files found for the artifact github-pages" in capsys.readouterr().out
    assert fake.artifacts == []


def test_upload_pages_artifact_uploads_with_if_no_files_found_error():
    """The stand-in's composite, as the real v4: its upload step passes ``error``."""
    action = yaml.safe_load((TOOLS / "actions" / "upload-pages-artifact" / "action.yml").read_text())
    (upload,) = [s for s in action["runs"]["steps"] if s["run"].endswith('standins.py" upload')]
    assert upload["env"]["INPUT_IF_NO_FILES_FOUND"] == "error"


def pages_artifact(run_id: int = RUN, name: str = "github-pages", extra: bool = False, link: bool = False):
    """An artifact as the fake keeps it: a zip of artifact.tar (a page; a symbolic link with
    ``link``), and a second file with ``extra``."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        page = tarfile.TarInfo("./index.html")
        page.size = 4
        tar.addfile(page, io.BytesIO(b"page"))
        if link:
            linked = tarfile.TarInfo("./secret")
            linked.type, linked.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(linked)
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("artifact.tar", tar_bytes.getvalue())
        if extra:
            archive.writestr("other.txt", "x")
    return {"id": 1000, "run_id": run_id, "name": name, "zip": zipped.getvalue()}


BODY = {"artifact_id": 1000, "pages_build_version": SHA, "oidc_token": ""}


@pytest.mark.parametrize(
    "actor, body, art, refused",
    [
        (Actor("mallory"), BODY, pages_artifact(), (403, "mallory is not a workflow job")),
        (Actor(f"{APP_SLUG}[bot]", APP_ID), BODY, pages_artifact(), (403, "is not a workflow job")),
        (JOB, {"artifact_id": 1000}, pages_artifact(), (400, "pages_build_version is missing")),
        (JOB, BODY, pages_artifact(run_id=RUN - 1), (400, "no such artifact in this workflow run")),
        (JOB, BODY, None, (400, "no such artifact in this workflow run")),
        (JOB, BODY, pages_artifact(name="site"), (400, "named 'site', not 'github-pages'")),
        (JOB, BODY, pages_artifact(extra=True), (400, "not one artifact.tar")),
        (JOB, BODY, pages_artifact(link=True), (400, "the tar holds links or special files: ['./secret']")),
    ],
    ids=["writer", "app", "no-build-version", "other-run", "none", "other-name", "two-files", "link"],
)
def test_pages_refuses(actor, body, art, refused):
    code, why = pages_refusal(actor, body, art, RUN)
    assert code == refused[0] and refused[1] in why, (code, why)


def test_pages_takes_this_runs_tar_from_the_job_token():
    assert pages_refusal(JOB, BODY, pages_artifact(), RUN) == (0, "")


def test_a_writers_token_cannot_deploy_and_the_jobs_can(workspace, fake, monkeypatch):
    """The pages archive uploaded as this run's github-pages, then deploy-pages' stand-in: with a
    writer's personal token the fake refuses it (403); with the job token it deploys that artifact,
    recorded with the artifact's own run."""
    make_site(workspace)
    monkeypatch.setenv("INPUT_PATH", "site/")
    standins.pages_archive()
    monkeypatch.setenv("INPUT_PATH", str(workspace.parent / "runner-temp" / "artifact.tar"))
    monkeypatch.setenv("INPUT_NAME", "github-pages")
    standins.upload()
    (uploaded,) = fake.artifacts
    monkeypatch.setenv("INPUT_TOKEN", WRITER_TOKEN)
    with pytest.raises(SystemExit, match=re.escape("Failed to create deployment (status: 403)")):
        standins.deploy_pages()
    assert fake.deployments == []
    monkeypatch.setenv("INPUT_TOKEN", JOB_TOKEN)
    standins.deploy_pages()
    (deployment,) = fake.deployments
    assert (deployment["artifact_id"], deployment["run_id"], deployment["pages_build_version"]) == (
        uploaded["id"], RUN, SHA)  # fmt: skip
    assert "page_url=https://rehearse.github.io/rmsnorm-kernel/" in (workspace.parent / "output").read_text()
