"""Console helpers shared by the suite's commands (walkthrough, training, verdict): the device
choice, the common arguments and config loading, human and JSON output, tables, versions."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from rmsnorm_suite.config import DEFAULT_CONFIG, SHIPPED_CONFIGS, Config, load_config


class DeviceUnavailable(RuntimeError):
    """Neither CUDA nor the Triton interpreter is available to run the kernels."""


def interpreter_hint(command: str) -> str:
    return (
        "To run the real Triton kernels on this CPU under the Triton interpreter (slow; small shapes):\n"
        f"    TRITON_INTERPRET=1 rmsnorm-kernel {command}\n"
        "TRITON_INTERPRET must be set before the kernels are imported, so set it on the command line, "
        "not inside Python."
    )


def resolve_device(requested: str, command: str = "COMMAND") -> str:
    """'cuda', or 'cpu' (the Triton interpreter); raises DeviceUnavailable with the fix."""
    from rmsnorm_kernel import kernels

    cuda = torch.cuda.is_available()
    env = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if env and not kernels.INTERPRET:
        raise DeviceUnavailable(
            "TRITON_INTERPRET=1 was set after rmsnorm_kernel.kernels was imported; the kernels were "
            "defined for the GPU. Set it before starting Python.\n" + interpreter_hint(command)
        )
    if requested == "cuda" or (requested == "auto" and cuda):
        if not cuda:
            raise DeviceUnavailable(f"--device cuda: torch sees no CUDA device ({cuda_diagnosis()}).")
        if kernels.INTERPRET:
            raise DeviceUnavailable(
                "--device cuda with TRITON_INTERPRET=1: the interpreter runs kernels on CPU tensors; "
                "unset TRITON_INTERPRET to use the GPU, or pass --device cpu."
            )
        return "cuda"
    if kernels.INTERPRET:
        return "cpu"
    if requested == "cpu":
        raise DeviceUnavailable("--device cpu needs the Triton interpreter.\n" + interpreter_hint(command))
    raise DeviceUnavailable(
        f"no CUDA device and TRITON_INTERPRET is not set ({cuda_diagnosis()}).\n" + interpreter_hint(command)
    )


def cuda_diagnosis() -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but sees no device or driver"


def add_common_arguments(
    parser: argparse.ArgumentParser, *, json_flag: bool = True, device: bool = False
) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="PATH",
        help=f"a YAML file, or a shipped config: {', '.join(SHIPPED_CONFIGS)} (default {DEFAULT_CONFIG})",
    )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    if device:
        parser.add_argument(
            "--device",
            choices=("auto", "cuda", "cpu"),
            default="auto",
            help="auto: CUDA if present, else CPU under TRITON_INTERPRET=1 (default auto)",
        )


def load(args: argparse.Namespace) -> Config:
    if args.config is None:
        return load_config(DEFAULT_CONFIG)
    return load_config(args.config)


def say(args: argparse.Namespace, message: str) -> None:
    """Human output: stdout normally, stderr under --json so that stdout stays pure JSON."""
    print(message, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on a terminal; elsewhere (CI logs, files) a plain line every tenth of the way."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(
            iterable,
            desc=desc,
            total=total,
            file=sys.stderr,
            mininterval=0.5,
            leave=False,
            dynamic_ncols=True,
        )
    return _lines(iterable, desc, total)


def _lines(iterable, desc: str, total: int | None):
    items = list(iterable) if total is None else iterable
    total = len(items) if total is None else total
    every = max(1, total // 10)
    for i, item in enumerate(items, 1):
        yield item
        if i == total or i % every == 0:
            print(f"{desc}: {i}/{total}", file=sys.stderr, flush=True)


def write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def format_table(headers: list[str], rows: list[list[Any]], right: Collection[int] = ()) -> str:
    """A plain-text table: columns as wide as their widest cell, the ones in ``right`` (indices)
    right-aligned, a rule under the headers."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    pad = lambda i, c, w: c.rjust(w) if i in right else c.ljust(w)
    line = lambda r: "  ".join(pad(i, c, w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def markdown_table(headers: list[str], rows: list[list[Any]], right: Collection[int] = ()) -> str:
    """A markdown table; the columns in ``right`` (indices) right-aligned."""
    rule = ["---:" if i in right else "---" for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(str(c) for c in r) + " |"
    return "\n".join([line(headers), "|" + "|".join(rule) + "|"] + [line(r) for r in rows])


def fmt(value: float | None, digits: int = 7) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}g}" if 1e-4 <= abs(value) < 1e6 else f"{value:.3e}"


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # reported, not raised: this is the diagnosis
        info["triton"] = None
        info["triton_error"] = f"{type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device_name"] = props.name
        info["device_capability"] = f"{props.major}.{props.minor}"
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["device_count"] = torch.cuda.device_count()
    return info


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def run_command(args: argparse.Namespace, handler) -> int:
    """Load the config and run ``handler(args, cfg)``; a bad config or no device to run on ends
    in an error message and exit status 2."""
    try:
        return handler(args, load(args))
    except (ValueError, DeviceUnavailable) as exc:
        return fail(str(exc))
