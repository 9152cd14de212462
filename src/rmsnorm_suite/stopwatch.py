"""The judge's stopwatch: op calls timed by the judge's own clock, outside the sandbox.

The op shares its process with the harness and can rewrite what the harness records; it cannot
change the judge's wall clock. After its results each worker waits for the judge's ``go`` line
(a seed), runs the op on inputs cut from buffers drawn from that seed (each call a new window:
no output can be ready before ``go``) and answers with random projections of every output.
The judge times ``go`` to answer, and holds head to base and to head's own reported times
(:func:`judge`, regression.toml [stopwatch]). docs/gate.md has the figures.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Bytes of op traffic one side's stopwatch moves on the GPU (tens of ms on an H200); on the host
# stand-in, calls of its CPU inputs. Every case within LARGE of the largest is timed.
GPU_BYTES = 64 * 2**30
HOST_CALLS = 200
LARGE = 0.5
ALIGN = 8  # elements: windows start 16-byte aligned, never on a row boundary of the last one


@dataclass(frozen=True)
class Block:
    """``reps`` calls of one (case, mode), each on a fresh window of shape ``shape``."""

    case: str
    mode: str
    shape: tuple[int, int]
    dtype: str
    reps: int


def plan(
    cases_: Sequence[Any], modes: Sequence[str], timing: str, host_shape: tuple[int, int]
) -> list[Block]:
    """The stopwatch's blocks for a round of ``cases_`` (harness.Case) and ``modes``."""
    if not cases_:
        return []
    top = max(c.nbytes["forward"] for c in cases_)
    chosen = [c for c in cases_ if c.nbytes["forward"] >= LARGE * top]
    blocks = []
    for case in chosen:
        for mode in modes:
            if timing == "host":
                shape = (min(case.m, host_shape[0]), min(case.n, host_shape[1]))
                blocks.append(Block(case.name, mode, shape, "float32", HOST_CALLS))
                continue
            reps = max(1, math.ceil(GPU_BYTES / (len(chosen) * len(modes) * case.nbytes[mode])))
            blocks.append(
                Block(case.name, mode, (case.m, case.n), str(case.dtype).removeprefix("torch."), reps)
            )
    return blocks


def answer_size(blocks: Sequence[Block]) -> int:
    """How many figures an answer holds: per output (y forward; dx and dw with backward) its
    projection, then per output its scale."""
    return sum(2 if b.mode == "forward" else 4 for b in blocks)


def run(fn: Callable, blocks: Sequence[Block], seed: int, device: str) -> list[float]:
    """Per block, the projections u.(Y v) of every output summed over its calls (u, v drawn from
    the seed; dw: dw.v), then each output's scale (the first call's norm x sqrt(calls): the
    projection's standard deviation). Inputs are windows at seeded offsets of buffers of random
    values in runs of random scale (normalising matters; no row of a call is a row of another)."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    f32 = torch.float32
    out: list[float] = []
    for block in blocks:
        dtype, (m, n) = getattr(torch, block.dtype), block.shape
        size = (2 * m * n + n + 63) // 64 * 64

        xs = _buffer(gen, size, dtype, device)
        dys = _buffer(gen, size, dtype, device) if block.mode != "forward" else None
        w = torch.rand(n, generator=gen, device=device, dtype=f32).add_(0.5).to(dtype)
        u = torch.randn(m, generator=gen, device=device, dtype=f32)
        v = torch.randn(n, generator=gen, device=device, dtype=f32)
        room = (size - m * n) // ALIGN
        starts = torch.randint(0, room, (block.reps, 2), generator=gen, device=device).mul_(ALIGN).tolist()
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        norms = torch.zeros(2, dtype=torch.float64, device=device)
        for i, (a, b) in enumerate(starts):
            a += ALIGN if a % n == 0 else 0  # never a row-aligned window: rows differ between calls
            x = xs[a : a + m * n].view(m, n)
            if block.mode == "forward":
                outs = [_plain(fn(x, w))]
            else:
                x = x.detach().requires_grad_()
                wg = w.detach().requires_grad_()
                fn(x, wg).backward(dys[b : b + m * n].view(m, n))
                outs = [_plain(x.grad), _plain(wg.grad)]
            # one read of each output, in its own dtype (a GEMV accumulates in fp32)
            acc[0] += u @ (outs[0] @ v.to(outs[0].dtype)).to(f32)
            if len(outs) == 2:
                acc[1] += outs[1].to(f32) @ v  # dw: n elements
            if i == 0:  # the scale a projection's disagreement is judged against
                for j, o in enumerate(outs):
                    norms[j] = o.to(f32).norm().double() * math.sqrt(block.reps)
        k = 1 if block.mode == "forward" else 2
        out.extend(acc[:k].tolist() + norms[:k].tolist())  # .tolist() waits for the GPU
    return out


def _buffer(gen: Any, size: int, dtype: Any, device: str) -> Any:
    """``size`` normal values (a multiple of 64) in runs of 64 at log-normal scales."""
    import torch

    scale = torch.randn(size // 64, 1, generator=gen, device=device, dtype=torch.float32).mul_(1.5).exp_()
    values = torch.randn(size // 64, 64, generator=gen, device=device, dtype=torch.float32)
    return values.mul_(scale).view(-1).to(dtype)


def _plain(t: Any) -> Any:
    """``t`` itself when a plain tensor: a subclass could answer the projection without the values."""
    import torch

    if type(t) is not torch.Tensor:
        raise TypeError(f"the op returned a {type(t).__name__}, not a torch.Tensor, to the stopwatch")
    return t


def read_answer(line: str, blocks: Sequence[Block], seed: int) -> list[float]:
    """The projections a worker answered with; ValueError unless it echoes ``seed`` and holds
    ``answer_size(blocks)`` finite floats."""
    data = json.loads(line)
    if not isinstance(data, dict) or data.get("seed") != seed:
        raise ValueError("the stopwatch's answer does not echo the judge's seed")
    sums = data.get("sums")
    if not isinstance(sums, list) or len(sums) != answer_size(blocks):
        raise ValueError(f"the stopwatch's answer must hold {answer_size(blocks)} projections")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in sums):
        raise ValueError("the stopwatch's answer holds a projection that is not a finite number")
    return [float(s) for s in sums]


def _scale_of(blocks: Sequence[Block], i: int) -> int:
    """The index, in an answer, of the scale that figure ``i`` is judged against."""
    start = 0
    for b in blocks:
        k = 1 if b.mode == "forward" else 2
        if i < start + 2 * k:
            return start + k + (i - start) % k
        start += 2 * k
    raise IndexError(i)


@dataclass(frozen=True)
class Side:
    """One round of one side: the judge's seconds, the projections, and what the side's own
    rows claim the stopwatch's calls cost (seconds: reps x its device median, summed)."""

    seconds: float
    sums: Sequence[float]
    claimed: float


def judge(
    base: Mapping[int, Side],
    head: Mapping[int, Side],
    blocks: Sequence[Block],
    tolerance: float,
    sums_tolerance: float,
) -> tuple[str, float | None, str]:
    """(verdict, ratio, note). `error` when a round's projections disagree beyond
    ``sums_tolerance`` (of base's scale for it), when no round pairs, or when head's seconds pass what
    its own rows predict (base's seconds less base's claimed op time plus head's) by more than
    ``tolerance``; `regression` when head/base passes 1 + ``tolerance``. Ratios: the upper
    median over rounds."""
    pairs = sorted(set(base) & set(head))
    if not pairs:
        return "error", None, "the stopwatch cannot judge: no round of both sides answered"
    for k in pairs:
        for i, (b, h) in enumerate(zip(base[k].sums, head[k].sums)):
            if not abs(h - b) <= sums_tolerance * base[k].sums[_scale_of(blocks, i)]:
                why = f"head's stopwatch outputs differ from base's ({h:.6g} vs {b:.6g})"
                return "error", None, f"round {k}: {why}"
    ratio = statistics.median_high(head[k].seconds / base[k].seconds for k in pairs)
    predicted = statistics.median_high(
        head[k].seconds / max(base[k].seconds - base[k].claimed + head[k].claimed, 1e-9) for k in pairs
    )
    share = statistics.median(min(base[k].claimed / base[k].seconds, 1.0) for k in pairs)
    note = (
        f"head/base {ratio:.3f} by the judge's clock, upper median over {len(pairs)} rounds; "
        f"head/(what head's rows predict) {predicted:.3f}; the op {share:.0%} of base's "
        f"{statistics.median(base[k].seconds for k in pairs) * 1e3:.1f} ms"
    )
    if predicted > 1.0 + tolerance:
        return "error", ratio, f"the judge's clock disagrees with head's own times: {note}"
    if ratio > 1.0 + tolerance:
        return "regression", ratio, f"{note}, beyond {tolerance:.0%}"
    return "pass", ratio, note
