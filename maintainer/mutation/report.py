"""The report, in docs/mutation.md's format: per session the scores and their intervals, the
catalogue's outcomes and every survivor with its reason (or the lack of one); then what is
mutated and what is not, and how to run it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

from maintainer.mutation import handwritten
from maintainer.mutation.catalogue import CATALOGUE_OPERATOR, Patch
from maintainer.mutation.config import ROOT, Config
from maintainer.mutation.scores import Score
from maintainer.mutation.session import file_hashes, read_meta, read_timings


@dataclasses.dataclass
class SessionResult:
    path: Path
    meta: dict[str, Any]
    scores: list[Score]
    catalogue: list[dict[str, Any]]  # id, path, failure, outcome, seconds
    survivors: list[dict[str, Any]]  # key, file, line, operator, diff, why (None: unexplained)
    revived: list[dict[str, Any]]  # survivors of an earlier pass killed on the rerun (new kill tests)
    seconds: list[float]  # per finished mutant
    pending: int
    killed: tuple[str, ...] = ()  # keys of the operator mutants killed


def summarise(
    path: Path, config: Config, patches: list[Patch], equivalent: dict[str, dict[str, str]]
) -> SessionResult:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    meta = read_meta(path)
    timings = read_timings(path)
    with use_db(str(path), WorkDB.Mode.open) as db:
        done = db.completed_work_items
        total = db.num_work_items
    scores = {  # the targets this session mutates
        t.name: Score(t.name, t.file, t.floor, meta["population"][t.name], 0)
        for t in config.targets.values()
        if t.name in meta["population"]
    }
    for m in meta["mutants"].values():
        scores[m["target"]].planned += 1
    patch_by_id = {p.id: p for p in patches}
    catalogue, survivors, revived, killed = [], [], [], []
    retried = set(meta.get("retried", []))
    for item, result in done:
        spec = item.mutations[0]
        survived = result.test_outcome == TestOutcome.SURVIVED
        incompetent = result.test_outcome == TestOutcome.INCOMPETENT
        seconds = timings.get(item.job_id, (float("nan"), ""))[0]
        if spec.operator_name == CATALOGUE_OPERATOR:
            p = patch_by_id.get(spec.operator_args["id"])
            catalogue.append(
                {"id": spec.operator_args["id"], "path": p.path if p else spec.definition_name,
                 "failure": p.failure if p else "?",
                 "outcome": "survived" if survived else "does not compile" if incompetent else "killed",
                 "seconds": seconds}
            )  # fmt: skip
            continue
        key = item.job_id.removeprefix("op-")
        m = meta["mutants"][key]
        s = scores[m["target"]]
        if incompetent:
            s.incompetent += 1
            continue
        s.run += 1
        changed = [
            ln for ln in (result.diff or "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
        ]
        row = {"key": key, "file": m["file"], "line": m["line"], "operator": m["operator"],
               "definition": m["definition"], "diff": changed, "why": None}  # fmt: skip
        if not survived:
            s.killed += 1
            killed.append(key)
            if item.job_id in retried:
                revived.append(row)
            continue
        entry = equivalent.get(key, {})
        why = entry.get("why")
        if why and entry.get("equivalent", True):
            s.equivalent += 1
        elif why:  # a known gap, argued but still counted against the score
            why = f"**Not equivalent, counted as a survivor:** {why}"
        survivors.append({**row, "why": why})
    catalogue.sort(key=lambda c: (c["path"], c["id"]))
    survivors.sort(key=lambda s: (s["file"], s["line"], s["key"]))
    revived.sort(key=lambda s: (s["file"], s["line"], s["key"]))
    seconds = [timings[i.job_id][0] for i, _ in done if i.job_id in timings]
    return SessionResult(
        path, meta, list(scores.values()), catalogue, survivors, revived, seconds, total - len(done),
        tuple(sorted(killed)),
    )  # fmt: skip


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def _source_status(root: Path, file: str, measured: str | None) -> str:
    """Whether ``file`` is still the code a session measured (its hash then, ``measured``)."""
    if not (root / file).is_file():
        return "**not in the tree**"
    now = file_hashes(root, {file})[file]
    return "unchanged" if measured == now else "**changed since**"


def _scrub(text: str) -> str:
    """An error excerpt without the machine's paths: an installed package's file from its
    site-packages folder on, the interpreter by its name, a work tree's file from the tree on."""
    text = re.sub(r"(?:/[\w.+-]+)+/((?:site|dist)-packages/)", r"\1", text)
    text = re.sub(r"(?:/[\w.+-]+)+/bin/(python[\d.]*)", r"\1", text)
    return re.sub(r"(?:/[\w.+-]+)*/rmsnorm-mutation-\w+/[\w-]+/", "", text)


def measured_commit(root: Path, file: str, measured: str | None) -> str:
    """The commit that holds the code a session measured: the newest commit of ``file`` whose
    content has the session's hash (derived here from the content, not from the checkout of the
    machine that ran the session); "" where no commit of the last 300 has it."""
    try:
        log = subprocess.run(
            ["git", "log", "-n", "300", "--format=%h", "--", file],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        for commit in log:
            shown = subprocess.run(["git", "show", f"{commit}:{file}"], cwd=root, capture_output=True)
            if shown.returncode == 0 and hashlib.sha256(shown.stdout).hexdigest()[:16] == measured:
                return commit
    except (OSError, subprocess.CalledProcessError):
        pass
    return ""


def unmeasured(results: list[SessionResult], config: Config, root: Path = ROOT) -> dict[str, list[str]]:
    """Per device (cpu, gpu), the targets no session of ``results`` measured on the code in the
    tree now: none ran them, or their file changed since (a session confined to some functions
    does not count). A target with no GPU-only functions whose kill command is the same on both
    devices, measured on one, counts as measured on the other: the run would repeat itself."""
    current = {}
    for device in ("cpu", "gpu"):
        current[device] = {
            s.target for r in results if r.meta.get("device") == device and not r.meta.get("confined")
            for s in r.scores if _source_status(root, s.file, r.meta.get("hashes", {}).get(s.file)) == "unchanged"
        }  # fmt: skip

    def same_run(t: str) -> bool:
        target = config.targets[t]
        kills = [config.kill.get(d, {}).get(target.kill) for d in ("cpu", "gpu")]
        return not target.gpu_only and kills[0] is not None and kills[0] == kills[1]

    measured = current["cpu"] | current["gpu"]
    return {
        d: [t for t in config.targets if t not in current[d] and not (t in measured and same_run(t))]
        for d in ("cpu", "gpu")
    }


def render_report(
    results: list[SessionResult], config: Config, patches: list[Patch], root: Path = ROOT
) -> str:
    out = [
        "# Mutation testing of the production code",
        "",
        "Regenerated by `nox -s mutation` (`python -m maintainer.mutation`); do not edit by hand.",
        "A mutant is a small change to the code users run; the suite kills it when a kill command",
        "(a fast subset of the test suite) fails. The score of a file is killed / non-equivalent",
        "mutants of those run, with a Wilson 95% interval where the mutants are a sample. A mutant",
        'Triton refuses to compile is counted apart ("did not compile"), neither killed nor survived.',
        "",
    ]
    for r in results:
        meta = r.meta
        sample = (
            "all" if meta["sample"] is None else f"at most {meta['sample']} per file (seed {meta['seed']})"
        )
        secs = r.seconds
        timing = (
            f"median {statistics.median(secs):.1f} s, max {max(secs):.1f} s per mutant over {len(secs)}"
            if secs else "none finished"
        )  # fmt: skip
        out += [
            f"## {_session_name(r)}",
            "",
            f"Sample: {sample}. Sources: "
            + ", ".join(f"`{f}` {h}" for f, h in meta["hashes"].items())
            + f". Wall time so far {meta.get('elapsed_s', 0):.0f} s; {timing}."
            + (
                f" Started {meta['started']}; population drawn by"
                f" `maintainer/mutation/config.toml` {meta['config']} with cosmic-ray {meta['cosmic_ray']}."
                if all(meta.get(k) for k in ("started", "config", "cosmic_ray"))
                else ""
            )
            + (
                f" **{r.pending} work item{'s' if r.pending != 1 else ''} still pending** (resume with the same command)."
                if r.pending
                else ""
            ),
            "",
            "| file | mutants (this device) | sampled | run | killed | equivalent | score | 95% interval | floor "
            "| did not compile | file since | code of |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
        ]
        for s in r.scores:
            lo, hi = s.interval
            flag = " **below floor**" if s.below_floor else ""
            measured = meta.get("hashes", {}).get(s.file)
            since = _source_status(root, s.file, measured)
            commit = measured_commit(root, s.file, measured)
            code_of = f"`{commit}`" if commit else "no commit"
            out.append(
                f"| `{s.file}` ({s.target}) | {s.population} | {s.planned} | {s.run} | {s.killed} | {s.equivalent} "
                f"| {pct(s.percent)}{flag} | {lo:.1f}-{hi:.1f}% | {s.floor:g}% | {s.incompetent} | {since} | {code_of} |"
            )
        for name, error in meta.get("baseline_errors", {}).items():
            out += ["", f"**Kill command `{name}` fails on the unmutated tree; its mutants were not run:**", "",
                    "```", _scrub(error.strip()[-1200:]), "```"]  # fmt: skip
        gpu_only = {t: n for t, n in meta.get("gpu_only", {}).items() if n}
        if meta["device"] == "cpu" and gpu_only:
            out += [
                "",
                "Not run here (the interpreter cannot reach them; the GPU session runs them): "
                + ", ".join(f"{n} mutants of {t}" for t, n in gpu_only.items())
                + ".",
            ]
        out += ["", "### Failure catalogue", "", "| path | failure mode | patch | outcome | seconds |",
                "|---|---|---|---|---:|"]  # fmt: skip
        for c in r.catalogue:
            out.append(
                f"| {c['path']} | {c['failure']} | `{c['id']}` | {c['outcome']} | {c['seconds']:.1f} |"
            )
        if not r.catalogue:
            out.append("| | none run yet | | | |")
        out += ["", "### Survivors", ""]
        if not r.survivors:
            out.append("None.")
        for s in r.survivors:
            diff = " / ".join(f"`{ln.strip()}`" for ln in s["diff"][:2])
            # The same mutant killed by another session of this report (one run after kill tests
            # were added): this session's own rerun (--retry-survivors) is still to come.
            elsewhere = [_session_name(o) for o in results if o is not r and s["key"] in o.killed]
            why = s["why"] or (
                f"**killed in the {' and the '.join(elsewhere)} of this report; not yet rerun here "
                "(`--retry-survivors`)**"
                if elsewhere
                else "**unexplained: a gap, or an equivalent mutant to argue in maintainer/mutation/equivalent.toml**"
            )
            out.append(
                f"- `{s['key']}` {s['file']}:{s['line']} ({s['definition']}, {s['operator']}): {diff}. {why}"
            )
        if r.revived:
            out += ["", "Survivors of an earlier pass, killed on the rerun (`--retry-survivors`) by kill tests added since:",
                    ""]  # fmt: skip
            for s in r.revived:
                diff = " / ".join(f"`{ln.strip()}`" for ln in s["diff"][:2])
                out.append(
                    f"- `{s['key']}` {s['file']}:{s['line']} ({s['definition']}, {s['operator']}): {diff}"
                )
        out.append("")
    missing = {d: ts for d, ts in unmeasured(results, config, root).items() if ts}
    if missing:
        out += ["## Not yet measured at this commit", ""]
        for device, targets in missing.items():
            out.append(
                f"- **{', '.join(targets)}: not yet measured on {device.upper()} at this commit** (no session "
                "of this report ran them on the files in the tree now)."
            )
        out.append("")
    out += handwritten.render(root)
    out += _method_section(config, patches)
    return "\n".join(out) + "\n"


def _session_name(r: SessionResult) -> str:
    """A session's heading: its device and targets (a report may hold several per device), and
    the functions it was confined to (--definition)."""
    targets = r.meta.get("targets") or sorted(s.target for s in r.scores)
    confined = r.meta.get("confined")
    inside = f"; only {', '.join(confined)}" if confined else ""
    return f"{r.meta['device'].upper()} session" + (f" ({', '.join(targets)}{inside})" if targets else "")


def _method_section(config: Config, patches: list[Patch]) -> list[str]:
    out = [
        "## What is mutated, and what is not",
        "",
        "Operators (cosmic-ray names, as regular expressions):",
        "",
    ]
    out += [f"- `{p}`" for p in config.operators]
    out += ["", "Left out:", ""]
    out += [f"- `{p}`: {why}" for p, why in config.excluded_operators.items()]
    out += ["", "Code not mutated, per file, with the reason:", ""]
    for t in config.targets.values():
        if t.definitions:
            out.append(
                f"- `{t.file}`: only the judgement functions " + ", ".join(f"`{d}`" for d in t.definitions)
            )
        for name, why in {**t.skip_definitions, **t.skip_assignments}.items():
            out.append(f"- `{t.file}` `{name}`: {why}")
        for name, why in t.gpu_only.items():
            out.append(f"- `{t.file}` `{name}` (GPU session only): {why}")
    out += ["", "Kill commands (pytest `-x -q`, in a copy of the tree with the mutant applied):", ""]
    for device, commands in config.kill.items():
        for name, steps in commands.items():
            shown = " && ".join(
                ("TRITON_INTERPRET=1 " if s.get("interpret") else "")
                + "pytest "
                + " ".join(_quote(a) for a in s["args"])
                for s in steps
            )
            out.append(f"- {device} `{name}`: `{shown}`")
    paths = sorted({p.path for p in patches})
    gpu = sum(p.gpu_only for p in patches)
    out += [
        "",
        f"The catalogue (`maintainer/mutation/catalogue.toml`) holds {len(patches)} patches over the paths "
        + ", ".join(paths)
        + f"; {gpu} of them only the GPU session runs. Survivors argued equivalent are listed, each"
        " with its reason, in `maintainer/mutation/equivalent.toml`.",
        "",
        "## Running it",
        "",
        "The CPU sessions above, one per target (a target's sample does not depend on the others",
        "run with it), then this page from their databases:",
        "",
        "```bash",
        *[
            f"nox -s mutation -- --device cpu --target {t} --sample 30 --seed 1 --workers 2 --out .mutation/{t}"
            for t in config.targets
        ],
        "python -m maintainer.mutation report --report docs/mutation.md "
        + " ".join(f"--session .mutation/{t}/session-cpu.sqlite" for t in config.targets),
        "```",
        "",
        "On the GPU (every target in one session, then the GPU-only functions alone):",
        "",
        "```bash",
        "nox -s mutation -- --device gpu --sample 30 --seed 1 --workers 8 --out .mutation/gpu",
        "nox -s mutation -- --device gpu --definition _rsqrt_newton --workers 4 --out .mutation/gpu-newton",
        "```",
        "",
        "A population is what `maintainer/mutation/config.toml` draws from the files with the pinned cosmic-ray",
        "(`requirements/constraints.txt`); tests/maintainer/test_mutation.py checks every population this page",
        "shows for a file still unchanged against a fresh enumeration.",
        "",
        "The same command resumes a session cut short by `--budget-s` (its database under `--out`,",
        "default `.mutation/`); `--fresh` starts over. A session refuses to resume over changed",
        "sources or arguments. `--definition F` runs every mutant inside the function F alone (the",
        "GPU-only functions above, say), without the catalogue. Each worker mutates its own copy of",
        "the tree, never the checkout.",
        "The run fails (exit 1) when a file's score is below its floor or a catalogue patch survives.",
    ]
    return out


def _quote(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg
