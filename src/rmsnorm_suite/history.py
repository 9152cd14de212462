"""The asv history page from a clone: ``nox -s history`` runs these steps around ``asv publish``.

    python -m rmsnorm_suite.history results [--remote origin]   # .asv/results from asv-results
    python -m rmsnorm_suite.history localise [--js DIR] [--site DIR]  # the page's JS, offline
    python -m rmsnorm_suite.history demo [--commits N] [--seed S]  # made-up figures, .asv/demo
    python -m rmsnorm_suite.history tags [--force]  # deletes non-release tags: CI clones only
    python -m rmsnorm_suite.history baseline [--rev HEAD]  # drift's release tag
    python -m rmsnorm_suite.history accepted [--rev HEAD] [--out FILE]  # accepted regressions
    python -m rmsnorm_suite.history record-accepted --verdicts DIR --commit SHA  # into accepted.json

Each step's function says what it reads and writes; docs/gate.md, "asv history", the why.
"""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

RESULTS_BRANCH = "asv-results"
RESULTS = Path(".asv/results")  # asv.conf.json's results_dir and html_dir, from the repository root
# On the results branch, beside the machines' folders: the rows merged pull requests' verdicts
# accepted, each with its commit of main, factor, reason and approver (record_accepted).
ACCEPTED = RESULTS / "accepted.json"
SHA = re.compile(r"[0-9a-f]{40}")
UNSAFE = re.compile(r"[<>&\"`\x00-\x1f\x7f]")  # what check_asv_results.py refuses in a string
HTML = Path(".asv/html")
JS = Path(".asv/js")  # where tools/fetch_asv_js.sh writes the local copies
RELEASE_TAG = re.compile(r"v\d+(\.\d+)*")  # the only tags asv may see and drift may judge against
DEMO = Path(".asv/demo")  # the demo page's asv configuration, results and page
DEMO_MACHINE = "demo-synthetic"
DEMO_COMMITS = 12
DEMO_SEED = 46
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
        if isinstance(points, list) and points and all(isinstance(p, dict) for p in points):
            continue  # a machine's summary.json: the table of last values, not a graph
        if not isinstance(points, list) or not any(
            isinstance(p, list) and len(p) > 1 and _has_value(p[1]) for p in points
        ):
            blank.append(str(path.relative_to(site)))
    return blank


def cdn_tags(site: Path) -> list[str]:
    """The addresses the page still loads from the network."""
    text = (site / "index.html").read_text(encoding="utf-8")
    return re.findall(r'<(?:script|link)[^>]*(?:src|href)="(https://[^"]+)"', text)


# The demo's made-up figures: bandwidth (TB/s) reached by each provider, its host time per call
# (ms), and the step the kernel takes two thirds of the way along (a change point to look at).
_DEMO_TBS = {"kernel": 4.2, "eager": 1.4, "native": 2.6, "compiled": 3.5, "liger": 3.9, "quack": 4.1}
_DEMO_HOST_MS = {"kernel": 0.007, "eager": 0.035, "native": 0.012, "compiled": 0.02}
_DEMO_ERROR = {"float32": 1e-7, "float16": 4e-4, "bfloat16": 3e-3}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _demo_value(rng: random.Random, name: str, shape: str, provider: str, step: bool) -> float:
    """One made-up figure of benchmark ``name`` (``Class.track_what``) at ``shape`` and ``provider``."""
    rows_cols, dtype = shape.split("-", 1)
    rows, cols = (int(n) for n in rows_cols.split("x"))
    what = name.rsplit(".track_", 1)[-1]
    if what.startswith("error_"):
        return float(f"{_DEMO_ERROR.get(dtype, 1e-3) * rng.uniform(0.8, 1.2):.4g}")
    passes = 5 if ".ForwardBackward." in name else 2  # tensors read and written per element
    seconds = passes * rows * cols * _ITEMSIZE.get(dtype, 2) / (_DEMO_TBS.get(provider, 3.0) * 1e12)
    device = seconds * 1e3 * (0.92 if step and provider == "kernel" else 1.0)
    host = _DEMO_HOST_MS.get(provider, 0.015)
    noise = abs(rng.gauss(0, 0.02))
    value = {
        "median_ms": max(device, host) * (1 + rng.gauss(0, 0.01)),
        "min_ms": max(device, host) * (1 - noise),
        "max_ms": max(device, host) * (1 + 3 * noise),
        "gpu_median_ms": device * (1 + rng.gauss(0, 0.01)),
        "gpu_min_ms": device * (1 - noise),
        "gpu_max_ms": device * (1 + 2 * noise),
        "host_median_ms": host * (1 + rng.gauss(0, 0.03)),
    }.get(what, device)
    return float(f"{value:.4g}")


def demo_config(root: Path, demo: Path) -> Path:
    """The demo's asv configuration: the project's, with the demo's folders and HEAD as the branch."""
    conf = json.loads((root / "asv.conf.json").read_text(encoding="utf-8"))
    conf.update(
        repo=str(root),
        branches=["HEAD"],
        benchmark_dir=str(root / conf["benchmark_dir"]),
        env_dir=str(demo / "env"),
        results_dir=str(demo / "results"),
        html_dir=str(demo / "html"),
    )
    demo.mkdir(parents=True, exist_ok=True)
    path = demo / "asv.conf.json"
    path.write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
    return path


def _discover(config: Path, head: str) -> dict:
    """asv's own discovery of ``benchmarks/`` (in this Python), written to the demo's benchmarks.json."""
    from asv import environment
    from asv.benchmarks import Benchmarks
    from asv.config import Config
    from asv.repo import get_repo

    conf = Config.load(str(config))
    envs = list(environment.get_environments(conf, ["existing:same"]))  # this Python
    Benchmarks.discover(conf, get_repo(conf), envs, [head]).save()
    return json.loads((Path(conf.results_dir) / "benchmarks.json").read_text(encoding="utf-8"))


def write_demo(
    root: Path,
    demo: Path | None = None,
    commits: int = DEMO_COMMITS,
    seed: int = DEMO_SEED,
    blank: bool = False,
    log=print,
) -> Path:
    """Write the demo's configuration and results into ``demo`` (default ``root/.asv/demo``); the same
    seed gives the same figures. ``blank``: every value None (a page of empty graphs, which the page
    check must fail). Returns the demo's asv configuration, for ``asv --config FILE publish``."""
    from asv.results import Results
    from asv.runner import BenchmarkResult

    log_out = _git("log", "--first-parent", f"-{commits}", "--format=%H %ct", "HEAD", cwd=root)
    history = [line.split() for line in reversed(log_out.stdout.decode().split("\n")) if line.strip()]
    if not history:
        raise SystemExit("history: demo: this checkout has no commits")
    demo = demo or root / DEMO
    results = demo / "results"
    if results.exists():
        shutil.rmtree(results)
    config = demo_config(root, demo)
    saved = os.environ.get("PYTHONPATH")
    src = str(root / "src")  # the benchmarks import this tree's package, installed or not
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, saved) if p)
    try:
        found = _discover(config, history[-1][0])
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    benchmarks = {k: v for k, v in found.items() if k != "version"}
    machine = {
        "machine": DEMO_MACHINE, "arch": "x86_64", "cpu": "synthetic", "num_cpu": "1", "os": "demo",
        "ram": "demo",
    }  # fmt: skip
    (results / DEMO_MACHINE).mkdir(parents=True, exist_ok=True)
    (results / DEMO_MACHINE / "machine.json").write_text(
        json.dumps({**machine, "version": 1}), encoding="utf-8"
    )
    rng = random.Random(seed)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    for index, (commit, when) in enumerate(history):
        step = index >= (2 * len(history)) // 3
        run = Results(
            {**machine, "python": python}, {}, commit, int(when) * 1000, python, "existing-demo", {}
        )
        started = datetime.datetime.fromtimestamp(int(when), datetime.timezone.utc)
        for name, bench in sorted(benchmarks.items()):
            combos = list(itertools.product(*[[_literal(v) for v in p] for p in bench["params"]]))
            values = [None if blank else _demo_value(rng, name, *combo, step) for combo in combos]
            none = [None] * len(values)
            run.add_result(bench, BenchmarkResult(values, none, none, 0, "", None), started, 0.0)
        run.save(str(results))
    log(
        f"history: demo: made-up figures (seed {seed}) for {len(benchmarks)} benchmarks at {len(history)} "
        f"commits in {results}; publish with `asv --config {config} publish`"
    )
    return config


def _literal(text: str):
    """A parameter value as benchmarks.json writes it (its repr): ``"'kernel'"`` -> ``'kernel'``."""
    import ast

    return ast.literal_eval(text)


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


def accepted_regressions(root: Path, rev: str = "HEAD") -> list[dict]:
    """The accepted regressions of ``rev``'s first-parent history, oldest first: each valid
    ``Accept-Regression`` trailer (rmsnorm_suite.accept) as ``{commit, source, check, factor,
    reason}``, where ``commit`` is the first-parent commit that brought it to main (a squashed
    PR's own commit, or the merge of the PR's commits) and ``source`` the commit that carries it.
    On main a trailer is past the gate: a row it names could regress only with approval."""
    try:
        from rmsnorm_suite import accept
    except ImportError:  # run as a script (python3 src/rmsnorm_suite/history.py): its folder is on the path
        import accept  # type: ignore[no-redef]

    out = _git("log", "--first-parent", "--reverse", "--format=%H%x1f%P%x1f%B%x1e", rev, "--", cwd=root)
    records: list[dict] = []
    for entry in out.stdout.decode("utf-8", "replace").split("\x1e"):
        if entry.count("\x1f") < 2:
            continue
        commit, parents, message = entry.split("\x1f", 2)
        commit, parents = commit.strip(), parents.split()
        found = accept.from_message(message, commit)
        if len(parents) > 1:  # a merge: the trailers of the commits it brings in
            found += accept.from_git(root, parents[0], commit)
        for r in found:
            if r.problem is None and 1.0 < r.factor:
                records.append({"commit": commit, "source": r.commit, "check": r.check, "factor": r.factor,
                                "reason": r.reason})  # fmt: skip
    return records


MAX_VERDICT_BYTES = 5_000_000  # a verdict.json is a few kB; a larger one is not read
# A row's check as post_verdict_comment.py's CHECK allows it: it starts a line of the log
# (no workflow command) and stays far under check_asv_results.py's 1000 characters.
CHECK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.,:()/+-]{0,119}")


def _accept_bounds() -> tuple[int, float]:
    """[accept]'s max_rows and max_factor (regression.toml beside this file): what the gate grants."""
    import tomllib

    table = tomllib.loads((Path(__file__).with_name("regression.toml")).read_text(encoding="utf-8"))["accept"]
    return int(table["max_rows"]), float(table["max_factor"])


def _text(value, limit: int) -> str:
    return UNSAFE.sub(" ", str(value or ""))[:limit].strip()


def verdict_acceptances(verdict) -> list[dict]:
    """The rows ``verdict`` (verdict.json) accepted: each row whose verdict is ``accepted`` and whose
    request the gate granted with a maintainer's approval, as ``{check, factor, reason, approved_by}``;
    anything else, or malformed, is left out."""
    if not isinstance(verdict, dict):
        return []
    acceptance = verdict.get("acceptance") if isinstance(verdict.get("acceptance"), dict) else {}
    listed = acceptance.get("granted")
    granted = {
        g["check"]: g
        for g in (listed if isinstance(listed, list) else [])
        if isinstance(g, dict) and isinstance(g.get("check"), str)
    }
    rows = verdict.get("rows")
    max_rows, max_factor = _accept_bounds()
    out: list[dict] = []
    for row in rows if isinstance(rows, list) else []:
        if len(out) >= max_rows:  # the gate grants no more: a verdict that lists more is not believed past it
            break
        if (
            not isinstance(row, dict)
            or row.get("verdict") != "accepted"
            or not isinstance(row.get("check"), str)
        ):
            continue
        g = granted.get(row.get("check"))
        if not g or not isinstance(g.get("approved_by"), str) or not g["approved_by"].strip():
            continue
        factor = g.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            continue
        try:
            factor = float(factor)  # a JSON integer of 400 digits: OverflowError
        except OverflowError:
            continue
        check = str(row["check"])
        parts = check.split()
        if len(parts) != 3 or not CHECK_NAME.fullmatch(check) or not 1.0 < factor <= max_factor:
            continue
        out.append({"check": check, "factor": float(factor), "reason": _text(g.get("reason"), 200),
                    "approved_by": _text(g["approved_by"], 100)})  # fmt: skip
    return out


def _read_verdict(path: Path, pull: int | None, head: str | None) -> dict | None:
    """``path`` (verdict.json) as a dict, or None with why on stderr: a link, too large, not JSON,
    not of ``head`` (the merged pull request's last head) or, by the pr.json beside it, of
    another pull request than ``pull``."""
    try:
        if path.is_symlink() or path.stat().st_size > MAX_VERDICT_BYTES:
            raise ValueError("a link, or over the size limit")
        verdict = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(verdict, dict):
            raise ValueError("not a JSON object")
        if head is not None and verdict.get("head_sha") != head:
            raise ValueError("of another head than the merged pull request's")
        pr = path.parent / "pr.json"
        if pull is not None and pr.is_file() and not pr.is_symlink() and pr.stat().st_size < 10_000:
            number = json.loads(pr.read_text(encoding="utf-8"))
            if not isinstance(number, dict) or number.get("number") != pull:
                raise ValueError("of another pull request (pr.json)")
    except (OSError, ValueError, RecursionError) as exc:
        print(f"history: record-accepted: {path}: passed over: {str(exc)[:200]}", file=sys.stderr)
        return None
    return verdict


def record_accepted(
    ledger: Path, verdicts: list[Path], commit: str, pull: int | None = None, head: str | None = None
) -> list[dict]:
    """Add the rows each verdict file accepted to ``ledger`` (``{"accepted": [...]}``, the results
    branch's accepted.json; created where missing) under ``commit``, main's commit that merged
    them; a row already there for that commit is kept as it is. A verdict file that does not read
    (_read_verdict), or is not of ``head`` where given, is passed over: the publish job goes on.
    Returns the records added; a ledger that is not JSON is a ValueError, and is left as it is."""
    if not SHA.fullmatch(commit):
        raise ValueError(f"not a 40-hex commit: {commit[:60]!r}")
    if head is not None and not SHA.fullmatch(head):
        raise ValueError(f"not a 40-hex head: {head[:60]!r}")
    data = json.loads(ledger.read_text(encoding="utf-8")) if ledger.is_file() else {}
    kept = data.get("accepted") if isinstance(data, dict) and isinstance(data.get("accepted"), list) else []
    have = {
        (r["commit"], r["check"])
        for r in kept
        if isinstance(r, dict) and isinstance(r.get("commit"), str) and isinstance(r.get("check"), str)
    }
    added = []
    for path in verdicts:
        verdict = _read_verdict(path, pull, head)
        if verdict is None:
            continue
        judged = verdict.get("head_sha") if head is None else head
        for row in verdict_acceptances(verdict):
            if (commit, row["check"]) in have:
                continue
            have.add((commit, row["check"]))
            record = {"commit": commit, **row}
            if isinstance(pull, int):
                record["pull"] = pull
            if isinstance(judged, str) and SHA.fullmatch(judged):
                record["head"] = judged
            added.append(record)
    if added or not ledger.is_file():
        ledger.parent.mkdir(parents=True, exist_ok=True)
        ledger.write_text(json.dumps({"accepted": kept + added}, indent=1) + "\n", encoding="utf-8")
    return added


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
    local.add_argument("--site", default=str(HTML), help=f"the published page's folder (default {HTML})")
    demo = sub.add_parser("demo", help=f"made-up, seeded results for a demo page, in {DEMO}")
    demo.add_argument("--commits", type=int, default=DEMO_COMMITS, help="the last N first-parent commits")
    demo.add_argument("--seed", type=int, default=DEMO_SEED)
    tags = sub.add_parser("tags", help="delete every tag that is not a release (CI's throwaway clone)")
    tags.add_argument("--force", action="store_true", help="outside GitHub Actions too (deletes tags here)")
    base = sub.add_parser(
        "baseline", help="print drift's baseline: the newest release tag on first-parent history"
    )
    base.add_argument("--rev", default="HEAD")
    acc = sub.add_parser("accepted", help="the Accept-Regression trailers on first-parent history, as JSON")
    acc.add_argument("--rev", default="HEAD")
    acc.add_argument("--out", default=None, help="write here (default: print)")
    rec = sub.add_parser(
        "record-accepted", help=f"add the rows a merged pull request's verdicts accepted to {ACCEPTED}"
    )
    rec.add_argument("--verdicts", required=True, help="verdict.json, or a folder of verdict-KIND/ folders")
    rec.add_argument("--commit", required=True, help="main's commit that merged the pull request")
    rec.add_argument("--pull", type=int, default=None, help="the pull request's number")
    rec.add_argument("--head", default=None, help="its last head: a verdict of another is passed over")
    rec.add_argument("--into", default=str(ACCEPTED), help=f"the ledger (default {ACCEPTED})")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.step == "record-accepted":
        given = Path(args.verdicts)
        files = [given] if given.is_file() else sorted(given.glob("verdict-*/verdict.json"))
        try:
            added = record_accepted(Path(args.into), files, args.commit, args.pull, args.head)
        except (OSError, ValueError) as exc:
            print(f"history: record-accepted: {exc}", file=sys.stderr)
            return 2
        print(f"history: {len(added)} accepted rows of {len(files)} verdicts recorded in {args.into}"
              + "".join(f"\n  {r['check']} x{r['factor']:g} at {r['commit'][:12]} (approved by {r['approved_by']})"
                        for r in added))  # fmt: skip
        return 0
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
    if args.step == "accepted":
        records = accepted_regressions(root, args.rev)
        text = json.dumps({"rev": args.rev, "accepted": records}, indent=1) + "\n"
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text, encoding="utf-8")
            print(f"history: {len(records)} accepted regressions on the first-parent history of {args.rev}")
        else:
            sys.stdout.write(text)
        return 0
    if args.step == "baseline":
        tag = release_baseline(root, args.rev)
        print(tag)
        return 0 if tag else 1
    if args.step == "results":
        return 0 if fetch_results(root, args.remote) else 1
    if args.step == "demo":
        write_demo(root, commits=args.commits, seed=args.seed)
        return 0
    site = root / args.site
    if not (site / "index.html").is_file():
        print(f"history: no published page ({args.site}/index.html): run asv publish first", file=sys.stderr)
        return 1
    js_dir = Path(args.js)
    used = localise(site, js_dir) if js_dir.is_dir() else []
    left = cdn_tags(site)
    if used:
        print(
            f"history: {args.site}/index.html loads {len(used)} local copies from {args.site}/vendor (from {js_dir})"
        )
    if left:
        print(
            f"history: the page still loads {len(left)} scripts from public CDNs ({', '.join(left[:2])}, ...): "
            "browsing it needs the network; for offline browsing run `bash tools/fetch_asv_js.sh` "
            "(writes .asv/js) and `nox -s history` again"
        )
    else:
        print(f"history: the page needs no network; browse it with `asv preview` (serves {args.site})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
