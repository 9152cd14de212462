"""The command line of ``python -m maintainer.mutation``, run from the checkout's root (which
``nox -s mutation`` does)::

    python -m maintainer.mutation run --device cpu --sample 40 --seed 1 --budget-s 3000
    python -m maintainer.mutation run --device gpu --definition _rsqrt_newton --out .mutation/newton
    python -m maintainer.mutation report --session .mutation/session-cpu.sqlite
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from maintainer.mutation.catalogue import check_catalogue, load_catalogue
from maintainer.mutation.config import MutationError, load_config
from maintainer.mutation.equivalence import current_equivalent, load_equivalent
from maintainer.mutation.handwritten import RECORD, run_all
from maintainer.mutation.population import describe_mutant, enumerate_mutants, restrict_to_definitions
from maintainer.mutation.report import SessionResult, pct, render_report, summarise
from maintainer.mutation.runner import execute
from maintainer.mutation.scores import floor_failures
from maintainer.mutation.session import init_session, reopen_survivors

DEFAULT_OUT = Path(".mutation")
DEFAULT_REPORT = Path("docs/mutation.md")
DESCRIPTION = "Mutation testing of the production code: how much of what a bug does the suite kills."


def _session_path(out: Path, device: str) -> Path:
    return out / f"session-{device}.sqlite"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maintainer.mutation", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="init (or resume) a session, run it within the budget, write the report")
    run.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    run.add_argument("--sample", type=int, default=None, help="at most N mutants per file (default: all)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--budget-s", type=float, default=None, help="stop starting mutants after this many seconds"
    )
    run.add_argument(
        "--workers", type=int, default=1, help="parallel kill commands, each in its own tree copy"
    )
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="session database and report directory")
    run.add_argument("--report", type=Path, default=None, help="report path (default: OUT/mutation.md)")
    run.add_argument("--fresh", action="store_true", help="discard an existing session database first")
    run.add_argument(
        "--narrow", action="store_true",
        help="keep only the --target files of an existing session (their sources unchanged)",
    )  # fmt: skip
    run.add_argument("--no-catalogue", action="store_true", help="operators only")
    run.add_argument("--target", action="append", default=None, help="only these targets (config names)")
    run.add_argument(
        "--definition", action="append", default=None, metavar="FUNCTION",
        help="only operator mutants inside these functions (the catalogue is left out)",
    )  # fmt: skip
    run.add_argument(
        "--retry-survivors", action="store_true", help="run the survivors again (after adding kill tests)"
    )
    run.add_argument(
        "--retry", action="append", default=None, metavar="KEY",
        help="run this survivor again (a key the report prints); repeatable",
    )  # fmt: skip
    rep = sub.add_parser("report", help="render the report of one or more session databases")
    rep.add_argument("--session", type=Path, action="append", required=True)
    rep.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    sub.add_parser("check-catalogue", help="check that every catalogue patch applies exactly once")
    hand = sub.add_parser("handwritten", help="run the hand-written mutants under their CPU kill commands")
    hand.add_argument("--record", action="store_true", help=f"write the outcomes to {RECORD}")
    describe = sub.add_parser(
        "describe",
        help="a mutant's description, as an entry of maintainer/mutation/equivalent.toml records it",
    )
    describe.add_argument("key", nargs="+")
    args = parser.parse_args(argv)

    config = load_config()
    patches = load_catalogue()
    equivalent = load_equivalent()
    if args.command in ("run", "report"):
        equivalent = current_equivalent(config, equivalent)
    if args.command == "check-catalogue":
        check_catalogue(patches)
        print(f"all {len(patches)} catalogue patches apply exactly once")
        return 0
    if args.command == "handwritten":
        results = run_all(config)
        if args.record:
            RECORD.parent.mkdir(parents=True, exist_ok=True)
            RECORD.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        alive = [k for k, r in results.items() if r["outcome"] != "killed"]
        for k in alive:
            print(f"FAIL hand-written mutant {k} {results[k]['outcome']}")
        return 1 if alive else 0
    if args.command == "describe":
        by_key = {m.key: m for m in enumerate_mutants(config)[0]}
        for key in args.key:
            if key not in by_key:
                raise MutationError(f"describe: {key} names no mutant of the population the config draws")
            print(f"[[mutant]]\nkey = {json.dumps(key)}")
            for field, value in describe_mutant(by_key[key]).items():
                print(f"{field} = {json.dumps(value)}")  # a JSON string is a TOML basic string
            print()
        return 0
    if args.command == "report":
        results = [summarise(p, config, patches, equivalent) for p in args.session]
        args.report.write_text(render_report(results, config, patches), encoding="utf-8")
        print(f"wrote {args.report}")
        return _verdict(results)
    if args.target:
        unknown = set(args.target) - set(config.targets)
        if unknown:
            raise MutationError(f"--target: unknown {sorted(unknown)}; known {sorted(config.targets)}")
        config = dataclasses.replace(
            config, targets={k: v for k, v in config.targets.items() if k in args.target}
        )
        files = {t.file for t in config.targets.values()}
        patches = [p for p in patches if p.file in files]
    if args.definition:
        config = restrict_to_definitions(config, args.definition)
    if args.no_catalogue or args.definition:
        patches = []
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise MutationError("--device gpu needs a CUDA device (the kill commands run -m gpu tests)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = _session_path(args.out, args.device)
    if args.fresh and path.exists():
        path.unlink()
    init_session(
        path, config, patches, args.device, args.sample, args.seed,
        confined=args.definition, narrow=args.narrow,
    )  # fmt: skip
    if args.retry_survivors or args.retry:
        print(f"{reopen_survivors(path, args.retry)} survivors to run again")
    counts = execute(path, config, load_catalogue(), args.device, args.workers, args.budget_s)
    print(f"session {path}: {counts}")
    results = [summarise(path, config, load_catalogue(), equivalent)]
    report = args.report or args.out / "mutation.md"
    report.write_text(render_report(results, config, load_catalogue()), encoding="utf-8")
    print(f"wrote {report}")
    return _verdict(results)


def _verdict(results: list[SessionResult]) -> int:
    """1 when a file's score is below its floor, a catalogue patch survived or a kill command
    failed unmutated, else 0."""
    failures = [f for r in results for f in floor_failures(r.scores)]
    failures += [
        f"kill command {n} fails unmutated" for r in results for n in r.meta.get("baseline_errors", {})
    ]
    failures += [f"catalogue patch {c['id']} ({c['path']}: {c['failure']}) {c['outcome']}" for r in results
                 for c in r.catalogue if c["outcome"] != "killed"]  # fmt: skip
    for r in results:
        for s in r.scores:
            lo, hi = s.interval
            print(
                f"{s.file}: {s.killed}/{s.non_equivalent} killed ({pct(s.percent)}, {lo:.1f}-{hi:.1f}%), floor {s.floor:g}%"
            )
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0
