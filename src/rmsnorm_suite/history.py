"""The asv history page from a clone: ``nox -s history`` runs these steps around ``asv publish``.

``results``: the stored results into ``.asv/results``. CI appends main's results to the
``asv-results`` branch; a clone does not have that branch, so when ``origin`` has it, it is
fetched and its files are written into ``.asv/results`` (a folder that is itself a checkout, as
in CI, is used as it is). Offline, or where the remote has no such branch, the results already in
``.asv/results`` are used; when there are none, it says so and how to get them, and exits 1.

``localise``: the published page (``.asv/html/index.html``) loads jQuery, flot and bootstrap from
public CDNs. Where local copies exist (``RMSNORM_ASV_JS``, default ``.asv/js``:
``bash tools/fetch_asv_js.sh``), the page's tags are pointed at copies under ``.asv/html/vendor``,
so ``asv preview`` works offline; without them it says the page needs the network.

``tags``: asv shows every tag name on the page as HTML, so in CI's throwaway clone every tag that
is not a release (``RELEASE_TAG``) is deleted before ``asv publish``. ``baseline``: drift's
baseline, the release tag on the newest commit of the first-parent history, the newest by creation
where one commit has several (an old commit tagged later does not move it back).

    python -m rmsnorm_suite.history results [--remote origin]
    python -m rmsnorm_suite.history localise [--js DIR]
    python -m rmsnorm_suite.history tags [--force]  # deletes tags: CI clones only
    python -m rmsnorm_suite.history baseline [--rev HEAD]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

RESULTS_BRANCH = "asv-results"
RESULTS = Path(".asv/results")  # asv.conf.json's results_dir and html_dir, from the repository root
HTML = Path(".asv/html")
JS = Path(".asv/js")  # where tools/fetch_asv_js.sh writes the local copies
RELEASE_TAG = re.compile(r"v\d+(\.\d+)*")  # the only tags asv may see and drift may judge against
HOW_TO_GET_RESULTS = (
    "Results come from a GPU machine: `nox -s asv` (or `nox --no-venv -s asv`) records the current "
    "commit into .asv/results; on GitHub the history workflow appends main's results to the "
    f"`{RESULTS_BRANCH}` branch, which this command fetches from origin when it is there."
)


def _git(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=timeout)


def _has_results(folder: Path) -> bool:
    return (folder / "benchmarks.json").is_file() and any(p.is_dir() for p in folder.iterdir())


def fetch_results(root: Path, remote: str = "origin", log=print) -> bool:
    """Bring the results branch's files into ``root/.asv/results`` when ``remote`` has the branch;
    True when results are there to publish afterwards, False (having said why) otherwise."""
    results = root / RESULTS
    if (results / ".git").exists():
        log(f"history: {RESULTS} is a checkout of its own (as in CI): using it as it is")
        return _has_results(results) or _none(results, log)
    try:
        probe = _git("ls-remote", "--exit-code", remote, f"refs/heads/{RESULTS_BRANCH}", cwd=root, timeout=60)
    except subprocess.TimeoutExpired:
        probe = subprocess.CompletedProcess([], 128, b"", b"timed out")
    if probe.returncode == 0:
        ref = f"refs/remotes/{remote}/{RESULTS_BRANCH}"
        fetched = _git("fetch", "--no-tags", remote, f"+refs/heads/{RESULTS_BRANCH}:{ref}", cwd=root)
        if fetched.returncode != 0:
            log(f"history: git fetch {remote} {RESULTS_BRANCH} failed: {fetched.stderr.decode().strip()}")
        else:
            archive = _git("archive", "--format=tar", ref, cwd=root)
            if archive.returncode != 0:
                log(f"history: git archive {ref} failed: {archive.stderr.decode().strip()}")
            else:
                results.mkdir(parents=True, exist_ok=True)
                # the "data" filter (no links out, no absolute paths) where this Python has it
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                    tar.extractall(results, **safe)
                log(f"history: fetched {remote}/{RESULTS_BRANCH} into {RESULTS}")
    elif probe.returncode == 2:
        log(f"history: {remote} has no {RESULTS_BRANCH} branch (no results published there yet)")
    else:
        reason = probe.stderr.decode().strip().splitlines()[:1] or ["no such remote"]
        log(f"history: could not ask {remote} for {RESULTS_BRANCH} (offline?): {reason[0]}")
    if _has_results(results):
        log(f"history: publishing the results in {RESULTS}")
        return True
    return _none(results, log)


def _none(results: Path, log) -> bool:
    log(f"history: there are no asv results yet (no {RESULTS}/benchmarks.json), so no page to publish.")
    log(HOW_TO_GET_RESULTS)
    return False


def localise(site: Path, js_dir: Path) -> list[str]:
    """Point the CDN tags of ``site/index.html`` at local copies found in ``js_dir`` by file name,
    copied to ``site/vendor``; returns the names substituted. Integrity attributes go with them:
    the copies are the local ones. A page already localised has no CDN tags left: nothing changes."""
    index = site / "index.html"
    text = index.read_text(encoding="utf-8")
    used = []

    def swap(match: re.Match) -> str:
        tag, url = match.group(0), match.group(2)
        name = url.rsplit("/", 1)[-1]
        if not (js_dir / name).is_file():
            return tag
        (site / "vendor").mkdir(exist_ok=True)
        shutil.copyfile(js_dir / name, site / "vendor" / name)
        used.append(name)
        tag = tag.replace(url, f"vendor/{name}")
        return re.sub(r'\s(integrity|crossorigin|referrerpolicy)="[^"]*"', "", tag)

    text = re.sub(r'<(script|link)[^>]*(?:src|href)="(https://[^"]+)"[^>]*>', swap, text)
    index.write_text(text, encoding="utf-8")
    return used


def _has_value(value) -> bool:
    if isinstance(value, list):
        return any(_has_value(v) for v in value)
    return value is not None


def blank_graphs(site: Path) -> list[str]:
    """The graphs of a published page (``graphs/**/*.json``, lists of [revision, value] points;
    a parameterised benchmark's value is a list, one per combination) with no data point: every
    value null, or no point at all. A page of blank graphs draws empty axes; its check fails."""
    blank = []
    for path in sorted((site / "graphs").rglob("*.json")):
        points = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(points, list) or not any(
            isinstance(p, list) and len(p) > 1 and _has_value(p[1]) for p in points
        ):
            blank.append(str(path.relative_to(site)))
    return blank


def cdn_tags(site: Path) -> list[str]:
    """The addresses the page still loads from the network."""
    text = (site / "index.html").read_text(encoding="utf-8")
    return re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https://[^"]+)"', text)


def _tags(root: Path) -> list[tuple[str, str, int]]:
    """(name, commit, creation time) of every tag: a tag object's date, else its commit's."""
    fmt = "%(refname)%00%(objectname)%00%(*objectname)%00%(creatordate:unix)"
    out = _git("for-each-ref", f"--format={fmt}", "refs/tags", cwd=root).stdout.decode("utf-8", "replace")
    tags = []
    for line in out.splitlines():
        ref, obj, peeled, when = line.split("\0")
        tags.append((ref.removeprefix("refs/tags/"), peeled or obj, int(when or 0)))
    return tags


def drop_tags(root: Path) -> list[str]:
    """Delete every tag of ``root`` whose name is not a release (``RELEASE_TAG``); the names dropped."""
    dropped = [name for name, _, _ in _tags(root) if not RELEASE_TAG.fullmatch(name)]
    for name in dropped:
        _git("update-ref", "-d", f"refs/tags/{name}", cwd=root)  # a ref path: no name read as an option
    return dropped


def release_baseline(root: Path, rev: str = "HEAD") -> str:
    """The release tag on the newest commit of ``rev``'s first-parent history (the newest tag by
    creation where that commit has several), or ""."""
    by_commit: dict[str, list[tuple[int, str]]] = {}
    for name, commit, when in _tags(root):
        if RELEASE_TAG.fullmatch(name):
            by_commit.setdefault(commit, []).append((when, name))
    if not by_commit:
        return ""
    history = _git("rev-list", "--first-parent", rev, "--", cwd=root).stdout.decode().split()
    for commit in history:
        if commit in by_commit:
            return max(by_commit[commit])[1]
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rmsnorm_suite.history", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="step", required=True)
    fetch = sub.add_parser(
        "results", help=f"fetch the {RESULTS_BRANCH} branch into {RESULTS} when there is one"
    )
    fetch.add_argument("--remote", default="origin")
    local = sub.add_parser("localise", help=f"point {HTML}/index.html at local copies of its scripts")
    local.add_argument("--js", default=os.environ.get("RMSNORM_ASV_JS") or str(JS))
    tags = sub.add_parser("tags", help="delete every tag that is not a release (CI's throwaway clone)")
    tags.add_argument("--force", action="store_true", help="outside GitHub Actions too (deletes tags here)")
    base = sub.add_parser(
        "baseline", help="print drift's baseline: the newest release tag on first-parent history"
    )
    base.add_argument("--rev", default="HEAD")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.step == "tags":
        if os.environ.get("GITHUB_ACTIONS") != "true" and not args.force:
            print(
                "history: tags deletes this clone's non-release tags; outside CI pass --force",
                file=sys.stderr,
            )
            return 2
        dropped = drop_tags(root)
        print(f"history: dropped {len(dropped)} tags that are not releases ({RELEASE_TAG.pattern})")
        return 0
    if args.step == "baseline":
        tag = release_baseline(root, args.rev)
        print(tag)
        return 0 if tag else 1
    if args.step == "results":
        return 0 if fetch_results(root, args.remote) else 1
    site = root / HTML
    if not (site / "index.html").is_file():
        print(f"history: no published page ({HTML}/index.html): run asv publish first", file=sys.stderr)
        return 1
    js_dir = Path(args.js)
    used = localise(site, js_dir) if js_dir.is_dir() else []
    left = cdn_tags(site)
    if used:
        print(f"history: {HTML}/index.html loads {len(used)} local copies from {HTML}/vendor (from {js_dir})")
    if left:
        print(
            f"history: the page still loads {len(left)} scripts from public CDNs ({', '.join(left[:2])}, ...): "
            "browsing it needs the network; for offline browsing run `bash tools/fetch_asv_js.sh` "
            "(writes .asv/js) and `nox -s history` again"
        )
    else:
        print(f"history: the page needs no network; browse it with `asv preview` (serves {HTML})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
