"""The judge's stopwatch: op calls timed by the judge's own clock, outside the sandbox.

The op shares its process with the harness and can rewrite what the harness records; it cannot
change the judge's wall clock. After its results a worker gets the judge's ``prepare`` seed,
draws every block's inputs from it and warms each block up (untimed), and says ``ready``. Then,
block by block, the judge sends a ``go`` seed and times go to answer: the calls run on windows at
offsets drawn from that seed (no output can be ready before go), and the answer holds random
projections of every output. :func:`judge` holds head to base and to head's own rows, group by
group (regression.toml [stopwatch]). docs/gate.md has the figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Calls per block: enough for BLOCK_BYTES of op traffic (about 10 ms of an H200's memory time),
# at most MAX_REPS (launch-bound shapes); the host stand-in makes HOST_CALLS calls of its inputs
# (milliseconds: several of a loaded CPU's scheduling slices).
BLOCK_BYTES = 32 * 2**30
MAX_REPS = 400
HOST_CALLS = 100
REPEATS = 3  # each block timed this many times, round-robin; the median over them counts
LOOSE = "where the op is less"  # the note's words for the blocks held only to `coarse`
ALIGN = 8  # elements: windows start 16-byte aligned, never on a row boundary of the last one
# The projection's vector in the output's dtype is v x PROJECTION_SCALE, undone in fp32: a
# float16 GEMV (cuBLAS may keep its partial sums in float16) of a dx row reached 2.3e4 of 65504
# on the judge's data; a power of two, so the scaling is exact. docs/gate.md, the stopwatch.
PROJECTION_SCALE = 2.0**-8


@dataclass(frozen=True)
class Block:
    """``reps`` calls of one (case, mode), each on a fresh window of shape ``shape``; ``repeat``:
    which of the REPEATS timings of it."""

    case: str
    group: str
    mode: str
    shape: tuple[int, int]
    dtype: str
    reps: int
    repeat: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return self.case, self.mode


def plan(
    cases_: Sequence[Any], modes: Sequence[str], timing: str, host_shape: tuple[int, int]
) -> list[Block]:
    """The stopwatch's blocks: every case (cases.Case) in every mode, REPEATS times over."""
    blocks: list[Block] = []
    for case in cases_:
        for mode in modes:
            if timing == "host":
                shape = (min(case.m, host_shape[0]), min(case.n, host_shape[1]))
                blocks.append(Block(case.name, case.group, mode, shape, "float32", HOST_CALLS))
                continue
            reps = min(MAX_REPS, max(1, math.ceil(BLOCK_BYTES / case.nbytes[mode])))
            dtype = str(case.dtype).removeprefix("torch.")
            blocks.append(Block(case.name, case.group, mode, (case.m, case.n), dtype, reps))
    return [dataclasses.replace(b, repeat=r) for r in range(REPEATS) for b in blocks]


def outputs(block: Block) -> int:
    """How many outputs a block's calls give: y forward; dx and dw with backward."""
    return 1 if block.mode == "forward" else 2


class Stopwatch:
    """One side's stopwatch: every block's buffers drawn from the judge's ``prepare`` seed and
    each block warmed up once, before the first go (none of it timed)."""

    def __init__(self, fn: Callable, blocks: Sequence[Block], seed: int, device: str) -> None:
        import torch

        self.torch, self.fn, self.blocks, self.device = torch, fn, list(blocks), device
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.inputs: dict[tuple[str, str], tuple] = {}
        for i, b in enumerate(self.blocks):
            if b.key not in self.inputs:
                self.inputs[b.key] = self._draw(gen, b)
                self._calls(i, [(ALIGN, ALIGN)])

    def _draw(self, gen: Any, block: Block) -> tuple:
        """A block's x buffer of random values in runs of random scale (normalising matters), its
        dy buffer of standard normal values (dx grows as dy / rms: scaled runs of both took a
        float16 dx to 8.1e3 of 65504 on CPU), its weight and the projection's vectors."""
        torch, f32 = self.torch, self.torch.float32
        dtype, (m, n) = getattr(torch, block.dtype), block.shape
        size = (2 * m * n + n + 63) // 64 * 64
        xs = _buffer(gen, size, dtype, self.device)
        dys = None
        if block.mode != "forward":
            dys = torch.randn(size, generator=gen, device=self.device, dtype=f32).to(dtype)
        w = torch.rand(n, generator=gen, device=self.device, dtype=f32).add_(0.5).to(dtype)
        u = torch.randn(m, generator=gen, device=self.device, dtype=f32)
        v = torch.randn(n, generator=gen, device=self.device, dtype=f32)
        return xs, dys, w, u, v, _scaled(v, dtype)

    def block(self, i: int, seed: int) -> list[float]:
        """Block ``i``'s calls on windows at offsets drawn from the go ``seed``: per output the
        projection u.(Y v) summed over the calls (dw: dw.v), then per output its scale (the first
        call's norm x sqrt(calls): the projection's standard deviation)."""
        torch = self.torch
        block, (m, n) = self.blocks[i], self.blocks[i].shape
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        room = (self.inputs[block.key][0].numel() - m * n) // ALIGN
        starts = torch.randint(0, room, (block.reps, 2), generator=gen, device=self.device)
        return self._calls(i, starts.mul_(ALIGN).tolist())

    def _calls(self, i: int, starts: Sequence[Sequence[int]]) -> list[float]:
        torch, f32 = self.torch, self.torch.float32
        block, (m, n) = self.blocks[i], self.blocks[i].shape
        xs, dys, w, u, v, v_low = self.inputs[block.key]
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        norms = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k, (a, b) in enumerate(starts):
            a += ALIGN if a % n == 0 else 0  # never a row-aligned window: rows differ between calls
            x = xs[a : a + m * n].view(m, n)
            if block.mode == "forward":
                outs = [_plain(self.fn(x, w))]
            else:
                x = x.detach().requires_grad_()
                wg = w.detach().requires_grad_()
                self.fn(x, wg).backward(dys[b : b + m * n].view(m, n))
                outs = [_plain(x.grad), _plain(wg.grad)]
            # one read of each output, in its own dtype (a GEMV accumulates in fp32)
            low = v_low if outs[0].dtype == v_low.dtype else _scaled(v, outs[0].dtype)
            acc[0] += u @ (outs[0] @ low).to(f32) / PROJECTION_SCALE
            if len(outs) == 2:
                acc[1] += outs[1].to(f32) @ v  # dw: n elements
            if k == 0:  # the scale a projection's disagreement is judged against
                for j, o in enumerate(outs):
                    norms[j] = o.to(f32).norm().double() * math.sqrt(len(starts))
        k = outputs(block)
        return acc[:k].tolist() + norms[:k].tolist()  # .tolist() waits for the GPU


def _buffer(gen: Any, size: int, dtype: Any, device: str) -> Any:
    """``size`` normal values (a multiple of 64) in runs of 64 at log-normal scales."""
    import torch

    scale = torch.randn(size // 64, 1, generator=gen, device=device, dtype=torch.float32).mul_(1.5).exp_()
    values = torch.randn(size // 64, 64, generator=gen, device=device, dtype=torch.float32)
    return values.mul_(scale).view(-1).to(dtype)


def _scaled(v: Any, dtype: Any) -> Any:
    """The projection's vector in an output's dtype: v x PROJECTION_SCALE."""
    return (v * PROJECTION_SCALE).to(dtype)


def _plain(t: Any) -> Any:
    """``t`` itself when a plain tensor: a subclass could answer the projection without the values."""
    import torch

    if type(t) is not torch.Tensor:
        raise TypeError(f"the op returned a {type(t).__name__}, not a torch.Tensor, to the stopwatch")
    return t


def read_answer(line: str, block: Block, seed: int) -> list[float]:
    """A block's projections and scales; ValueError unless the answer echoes the go ``seed`` and
    holds 2 x outputs(block) finite floats."""
    data = json.loads(line)
    if not isinstance(data, dict) or data.get("go") != seed:
        raise ValueError("the stopwatch's answer does not echo the judge's go")
    sums, size = data.get("sums"), 2 * outputs(block)
    if not isinstance(sums, list) or len(sums) != size:
        raise ValueError(f"the stopwatch's answer must hold {size} figures for {block.case} {block.mode}")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in sums):
        raise ValueError(
            f"the stopwatch's answer for {block.case} {block.mode} holds a projection that is not a finite number"
        )
    return [float(s) for s in sums]


@dataclass(frozen=True)
class Side:
    """One round of one side, per block: the judge's seconds, the answer (projections, then
    scales), and what the side's own rows claim the block's calls cost (reps x its median)."""

    seconds: Sequence[float]
    sums: Sequence[Sequence[float]]
    claimed: Sequence[float]


def judge(
    base: Mapping[int, Side],
    head: Mapping[int, Side],
    blocks: Sequence[Block],
    tolerance: float,
    consistency: float,
    sums_tolerance: float,
    accepted: Mapping[tuple[str, str], float] | None = None,
    share: float = 0.0,
    coarse: float = math.inf,
    single: float = math.inf,
    any_round: float = math.inf,
    min_rounds: int = 1,
) -> tuple[str, float | None, str]:
    """(verdict, ratio, note). A (case, mode) is *judged* where base's rows claim at least
    ``share`` of base's stopwatch seconds for it; below, the stopwatch times mostly its own work.
    `error` when a projection differs from base's by more than ``sums_tolerance`` of its scale,
    when no round pairs or nothing is judged, or when, in a group of cases, head's seconds beyond
    what its rows claim pass base's by more than ``consistency`` of head's seconds over its judged
    blocks (``single`` in any one alone), ``coarse`` over the others, or ``any_round`` in any one
    round for either (head's rows hide time); `regression` when head/base over the judged blocks
    passes 1 + ``tolerance`` (an ``accepted`` block's base scaled by its factor). A block's
    seconds: the median of its repeats; then the upper median over at least ``min_rounds``."""
    pairs = sorted(set(base) & set(head))
    if len(pairs) < max(min_rounds, 1):
        return "error", None, f"the stopwatch cannot judge: {len(pairs)} rounds of both sides answered"
    for k in pairs:
        for block, b_sums, h_sums in zip(blocks, base[k].sums, head[k].sums):
            n = outputs(block)
            for i, (b, h) in enumerate(zip(b_sums[:n], h_sums[:n])):
                if not abs(h - b) <= sums_tolerance * b_sums[n + i]:
                    why = f"head's stopwatch outputs differ from base's ({h:.6g} vs {b:.6g})"
                    return "error", None, f"round {k}, {block.case} {block.mode}: {why}"
    firsts = [b for b in blocks if b.repeat == 0]
    base = {k: _by_key(base[k], blocks) for k in pairs}
    head = {k: _by_key(head[k], blocks) for k in pairs}
    blocks = firsts
    shares = [
        statistics.median(min(base[k].claimed[i] / max(base[k].seconds[i], 1e-12), 1.0) for k in pairs)
        for i in range(len(blocks))
    ]
    judged = [i for i in range(len(blocks)) if shares[i] >= share]
    others = [i for i in range(len(blocks)) if shares[i] < share]
    left_out = ", ".join(f"{blocks[i].case} {blocks[i].mode} ({shares[i]:.1%})" for i in others)
    if not judged:
        why = f"base's op is under {share:.0%} of the stopwatch's time in every block: {left_out}"
        return "error", None, f"the stopwatch cannot judge these shapes ({why}); add a large one"
    allowed = {i: (accepted or {}).get(blocks[i].key, 1.0) for i in judged}
    ratio = statistics.median_high(
        sum(head[k].seconds[i] for i in judged) / sum(base[k].seconds[i] * allowed[i] for i in judged)
        for k in pairs
    )

    def per_group(idx: list[int], limit: float) -> dict[str, list[float]]:
        names = dict.fromkeys(blocks[i].group for i in idx)
        return {g: _hidden(base, head, [i for i in idx if blocks[i].group == g], pairs, limit) for g in names}

    fine, loose = per_group(judged, consistency), per_group(others, coarse)
    alone = {f"{blocks[i].case} {blocks[i].mode}": _hidden(base, head, [i], pairs, single) for i in judged}
    base_ms = statistics.median(sum(base[k].seconds[i] for i in judged) for k in pairs) * 1e3
    note = (
        f"head/base {ratio:.3f} by the judge's clock over the blocks where the op is at least "
        f"{share:.0%} of it (base's {base_ms:.1f} ms), upper median over {len(pairs)} rounds; time "
        f"head's rows do not show: {_figures(fine)} of head's"
        + (f"; {LOOSE} ({left_out}): {_figures(loose)}, limit {coarse:.0%}" if others else "")
    )
    # each fine block alone too (a group's sum could offset a block forged low with another
    # whose rows claim more than it takes), and every round (a head may forge only some rounds)
    for hidden, limit, how in ((fine, consistency, ""), (loose, coarse, ""), (alone, single, " alone")):
        for name, values in hidden.items():
            if (value := statistics.median_high(values)) > limit:
                return "error", ratio, _disagrees(f"{name}: {value:+.1%}{how}", note)
    for hidden, how in ((loose, ""), (alone, " alone")):
        for name, values in hidden.items():
            if (worst := max(values)) > any_round:
                where = f"{name}: {worst:+.1%}{how} in round {pairs[values.index(worst)]}"
                return "error", ratio, _disagrees(where, note)
    if ratio > 1.0 + tolerance:
        return "regression", ratio, f"{note}, beyond {tolerance:.0%}"
    return "pass", ratio, note


def _disagrees(where: str, note: str) -> str:
    return f"the judge's clock disagrees with head's own times ({where}): {note}"


def _hidden(base, head, idx, pairs, limit: float) -> list[float]:
    """Per round, over blocks ``idx``: head's seconds beyond its claims less base's, of head's
    seconds; no block offsets others by more than ``limit`` of its own seconds (a row that claims
    more than its calls take cannot buy room for another)."""
    out = []
    for k in pairs:
        diffs = [
            max(head[k].seconds[i] - head[k].claimed[i] - base[k].seconds[i] + base[k].claimed[i],
                -limit * head[k].seconds[i])
            for i in idx
        ]  # fmt: skip
        out.append(sum(diffs) / sum(head[k].seconds[i] for i in idx))
    return out


def _figures(hidden: Mapping[str, Sequence[float]]) -> str:
    return ", ".join(f"{g} {statistics.median_high(v):+.1%}" for g, v in hidden.items())


def _by_key(side: Side, blocks: Sequence[Block]) -> Side:
    """``side`` per (case, mode), in the order of the first repeat: seconds the median over the
    repeats, what the rows claim once."""
    keys = [b.key for b in blocks if b.repeat == 0]
    seconds = {key: [s for b, s in zip(blocks, side.seconds) if b.key == key] for key in keys}
    claimed = {b.key: c for b, c in zip(blocks, side.claimed)}
    return Side([statistics.median(seconds[key]) for key in keys], [], [claimed[key] for key in keys])
