"""The judge's stopwatch: op calls timed by the judge's own clock, outside the sandbox.

Everything inside a worker can be rewritten by the op it imports (a frame walk reaches the
harness's lists; an op can cache its outputs for inputs it has seen). What it cannot change is
the wall clock of the judge's process. So after its results, each worker waits for a ``go`` line
carrying a seed the judge drew, runs a fixed set of calls on fresh inputs drawn from that seed
(no output can be prepared before ``go``), and answers with checksums of every output. The judge
times ``go`` to answer with its own clock and holds head to base, round by round, with the
tolerances of regression.toml's [stopwatch]. The checksums must agree with base's (an answer
sent before the work was done, or with stale outputs, does not).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Bytes of op traffic one side's stopwatch moves on the GPU (about 16 ms on an H200, as much
# again for drawing inputs and checksums); on the host stand-in, calls of its CPU inputs.
GPU_BYTES = 64 * 2**30
HOST_CALLS = 200
CASES = 2  # the largest cases of the round (most bytes): where the op's own work dominates


@dataclass(frozen=True)
class Block:
    """``reps`` calls of one (case, mode), each on inputs of shape ``shape`` drawn afresh."""

    case: str
    mode: str
    shape: tuple[int, int]
    dtype: str
    reps: int


def plan(
    cases_: Sequence[Any], modes: Sequence[str], timing: str, host_shape: tuple[int, int]
) -> list[Block]:
    """The stopwatch's blocks for a round of ``cases_`` (harness.Case) and ``modes``."""
    chosen = sorted(cases_, key=lambda c: -c.nbytes["forward"])[:CASES]
    blocks = []
    for case in chosen:
        for mode in modes:
            if timing == "host":
                shape, dtype, reps = (
                    (min(case.m, host_shape[0]), min(case.n, host_shape[1])),
                    "float32",
                    HOST_CALLS,
                )
            else:
                shape, dtype = (case.m, case.n), str(case.dtype).removeprefix("torch.")
                reps = max(1, math.ceil(GPU_BYTES / (len(chosen) * len(modes) * case.nbytes[mode])))
            blocks.append(Block(case.name, mode, shape, dtype, reps))
    return blocks


def run(fn: Callable, blocks: Sequence[Block], seed: int, device: str) -> list[float]:
    """Checksums of every output, per block: sum(y*x) forward; sum(dx*dy) and sum(dw*dw) with
    backward (float64 sums, positive and input-dependent: a stale output gives another sum)."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    sums: list[float] = []
    for block in blocks:
        dtype = getattr(torch, block.dtype)
        m, n = block.shape
        w = torch.rand(n, generator=gen, device=device, dtype=torch.float32).add_(0.5).to(dtype)
        acc = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
        for _ in range(block.reps):
            x = torch.randn(m, n, generator=gen, device=device, dtype=dtype)
            if block.mode == "forward":
                acc[0] += torch.sum(fn(x, w) * x, dtype=torch.float64)
                continue
            x.requires_grad_()
            wg = w.detach().requires_grad_()
            dy = torch.randn(m, n, generator=gen, device=device, dtype=dtype)
            fn(x, wg).backward(dy)
            acc[0] += torch.sum(x.grad * dy, dtype=torch.float64)
            acc[1] += torch.sum(wg.grad.double() ** 2)
        sums.extend(a.item() for a in acc)  # .item() waits for the GPU: the answer follows the work
    return sums


def read_answer(line: str, expected: int) -> list[float]:
    """The checksums a worker answered with; ValueError unless ``expected`` finite floats."""
    import json

    data = json.loads(line)
    sums = data.get("sums") if isinstance(data, dict) else None
    if not isinstance(sums, list) or len(sums) != expected:
        raise ValueError(f"the stopwatch's answer must hold {expected} sums")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in sums):
        raise ValueError("the stopwatch's answer holds a sum that is not a finite number")
    return [float(s) for s in sums]


def judge(
    base: Mapping[int, tuple[float, Sequence[float]]],
    head: Mapping[int, tuple[float, Sequence[float]]],
    tolerance: float,
    sums_tolerance: float,
) -> tuple[str, float | None, str]:
    """(verdict, ratio, note) from each round's (seconds, sums) of both sides: `error` when the
    sums of a round disagree beyond ``sums_tolerance`` (relative) or no round pairs; `regression`
    when head's seconds over base's, median over rounds, pass 1 + ``tolerance``."""
    pairs = sorted(set(base) & set(head))
    if not pairs:
        return "error", None, "the stopwatch cannot judge: no round of both sides answered"
    for k in pairs:
        for b, h in zip(base[k][1], head[k][1]):
            if abs(h - b) > sums_tolerance * max(abs(b), 1e-30):
                return (
                    "error",
                    None,
                    f"round {k}: head's stopwatch outputs differ from base's ({h:.6g} vs {b:.6g})",
                )
    ratio = statistics.median(head[k][0] / base[k][0] for k in pairs)
    note = (
        f"head/base {ratio:.3f} by the judge's clock, median over {len(pairs)} rounds "
        f"(base {statistics.median(base[k][0] for k in pairs) * 1e3:.1f} ms a round)"
    )
    if ratio > 1.0 + tolerance:
        return "regression", ratio, f"{note}, beyond {tolerance:.0%}"
    return "pass", ratio, note
