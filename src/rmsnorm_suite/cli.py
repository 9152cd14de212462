"""`rmsnorm-kernel` (also `python -m rmsnorm_suite`): the walkthrough, the suite and the gate as commands.

Each subcommand lives in its own module, which exposes two functions:
``configure(parser: argparse.ArgumentParser, command: str) -> None`` adds the subcommand's arguments and
``run(args: argparse.Namespace) -> int`` does the work and returns the exit status.
Modules are imported only when their subcommand runs, so ``--help`` stays fast and a CPU-only
machine never imports GPU-only code it does not need.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). The order is the walkthrough's order.
COMMANDS: dict[str, tuple[str, str]] = {
    "check-environment": (
        "rmsnorm_suite.walkthrough.environment",
        "versions, device, and one real kernel computed and checked",
    ),
    "reference": (
        "rmsnorm_suite.walkthrough.oraclecheck",
        "float64 gradcheck of the reference; synthetic data splits",
    ),
    "check-forward": ("rmsnorm_suite.walkthrough.grids", "forward case grid against the reference"),
    "check-backward": ("rmsnorm_suite.walkthrough.grids", "dx case grid against the reference"),
    "check-gamma": ("rmsnorm_suite.walkthrough.grids", "dw case grid against the reference"),
    "train-integration": ("rmsnorm_suite.training", "train the small network on both paths and compare"),
    "benchmark": ("rmsnorm_suite.bench", "fair comparison: eager, compiled, native, this kernel, peers"),
    "exercise": ("rmsnorm_suite.walkthrough.exercise", "the wrong-denominator variant made observable"),
    "figures": ("rmsnorm_suite.walkthrough.figures", "PNG plots from the recorded outputs"),
    "check-checkpoints": ("rmsnorm_suite.walkthrough.checkpoints", "reload saved checkpoints and compare"),
    "clean": ("rmsnorm_suite.walkthrough.clean", "delete generated files (preview with --dry-run)"),
    "verdict": (
        "rmsnorm_suite.verdict",
        "every check this machine can run, one table, non-zero exit on failure",
    ),
    "gate": ("rmsnorm_suite.gate", "compare base and head results against regression.toml"),
    "pr-verdict": ("rmsnorm_suite.pullrequest", "benchmark base and head interleaved, then gate them"),
    "changepoints": (
        "rmsnorm_suite.changepoint",
        "steps in main's benchmark history, and the first commit of each",
    ),
    "bisect": (
        "rmsnorm_suite.bisection",
        "the first commit pr-verdict flags between a good and a bad commit",
    ),
}

# optional dependency (top-level module) -> the extra of pyproject.toml that installs it
EXTRA_OF = {
    "yaml": "suite",
    "tqdm": "suite",
    "scipy": "suite",
    "tomli": "suite",
    "matplotlib": "bench",
    "asv": "bench",
    "pytest_benchmark": "bench",
    "transformers": "models",
    "liger_kernel": "peers",
    "cosmic_ray": "mutation",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The extra that installs the module ``error`` names, or None for a module of no extra."""
    return EXTRA_OF.get((error.name or "").split(".", 1)[0])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rmsnorm-kernel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help or the "invalid choice" error and exits
        return 2
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        sub = argparse.ArgumentParser(prog=f"rmsnorm-kernel {name}", description=help_text)
        module.configure(sub, name)
        args = sub.parse_args(argv[1:])
        args.command = name
        return int(module.run(args) or 0)
    except ModuleNotFoundError as error:
        extra = missing_extra(error)
        if extra is None:
            raise
        print(
            f'rmsnorm-kernel {name}: needs {error.name}: pip install "rmsnorm-kernel[{extra}]"',
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
