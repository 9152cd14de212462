"""The op's contract on any machine: bad input raises a clear error before any launch, the
fallback is explicit and observable, and the reference's backward is right (float64 gradcheck).
No kernel runs here."""

import math
import subprocess
import sys
import warnings

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import launch, ops
from rmsnorm_kernel.launch import UnsupportedInput
from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference
from rmsnorm_suite.walkthrough import oraclecheck


def x_(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# (description, call, expected exception, message fragment)
BAD_INPUT = [
    (
        "integer x",
        lambda: rmsnorm_kernel.rms_norm(torch.ones(2, 4, dtype=torch.int32)),
        TypeError,
        "x must be",
    ),
    ("bool x", lambda: rmsnorm_kernel.rms_norm(torch.ones(2, 4, dtype=torch.bool)), TypeError, "x must be"),
    (
        "x not a tensor",
        lambda: rmsnorm_kernel.rms_norm([[1.0, 2.0]], 2),
        TypeError,
        "x must be a torch.Tensor",
    ),
    (  # torch promotes it: valid, not run by the kernels (allow_fallback computes it)
        "integer weight",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), weight=torch.ones(4, dtype=torch.int64)),
        UnsupportedInput,
        "weight has dtype int64",
    ),
    ("weight shape", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), 4, torch.ones(5)), ValueError, "weight"),
    (
        "weight shape vs x",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), weight=torch.ones(5)),
        ValueError,
        "normalized_shape",
    ),
    (
        "normalized_shape vs x",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), (3,)),
        ValueError,
        "normalized_shape",
    ),
    ("normalized_shape type", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), "4"), TypeError, "normalized_shape"),
    ("eps string", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), eps="1e-6"), TypeError, "eps"),
    ("scalar x", lambda: rmsnorm_kernel.rms_norm(torch.tensor(1.0)), ValueError, "normalized_shape"),
    ("residual shape", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), residual=x_(2, 5)), ValueError, "residual"),
    (
        "residual dtype",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), residual=torch.ones(2, 4, dtype=torch.int8)),
        TypeError,
        "residual",
    ),
    (
        "residual_dtype alone",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), residual_dtype=torch.float32),
        ValueError,
        "residual_dtype",
    ),
    (
        "out_dtype int",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), out_dtype=torch.int32),
        TypeError,
        "out_dtype",
    ),
    ("casting", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), casting="mistral"), ValueError, "casting"),
    ("offset without weight", lambda: rmsnorm_kernel.rms_norm(x_(2, 4), offset=1.0), ValueError, "offset"),
    (
        "offset nan",
        lambda: rmsnorm_kernel.rms_norm(x_(2, 4), weight=torch.ones(4), offset=math.nan),
        ValueError,
        "offset",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "fragment"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_raises_before_launch(case, call, error, fragment):
    before = dict(rmsnorm_kernel.CALLS)
    with pytest.raises(error, match=fragment):
        call()
    assert rmsnorm_kernel.CALLS == before, "nothing may run when the input is rejected"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="device mismatch needs a CUDA device beside the CPU"
)
def test_weight_on_other_device():
    with pytest.raises(ValueError, match="device"):
        rmsnorm_kernel.rms_norm(x_(2, 4).cuda(), weight=torch.ones(4))


def test_float64_raises_by_default():
    with pytest.raises(UnsupportedInput, match="allow_fallback"):
        rmsnorm_kernel.rms_norm(x_(3, 8, dtype=torch.float64))


def test_a_fresh_process_counts_fallbacks_and_kernel_calls_from_zero():
    """CALLS, read without reset_counters(), shows only the calls made: a process whose one call
    fell back counts one fallback and no kernel call (a run that stayed off the kernels shows
    zero). Its own process, as every test before it here may have counted."""
    code = (
        "import torch, rmsnorm_kernel\n"
        "assert dict(rmsnorm_kernel.CALLS) == {'forward': 0, 'backward': 0, 'fallback': 0}, dict(rmsnorm_kernel.CALLS)\n"
        "x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)\n"
        "rmsnorm_kernel.rms_norm(x, allow_fallback=True).sum().backward()\n"
        "print(dict(rmsnorm_kernel.CALLS))"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "{'forward': 0, 'backward': 0, 'fallback': 1}"


def test_float64_fallback_with_a_residual_adds_in_float64():
    """The fallback (torch ops) keeps float64 input in float64: h = x + residual is float64's
    own sum, exactly, and y is the float64 reference of it (an h summed in float32 is ~1e-8
    off, which float64's comparison sees)."""
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=1e-6, residual=r, allow_fallback=True)
    assert h.dtype == y.dtype == torch.float64
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, rms_norm_reference(x + r, w, 1e-6), rtol=1e-15, atol=1e-15)


def test_fallback_is_explicit_counted_and_warns_once(monkeypatch):
    monkeypatch.setattr(ops, "_warned_fallback", False)
    rmsnorm_kernel.reset_counters()
    x = x_(3, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64) + 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1 = rmsnorm_kernel.rms_norm(x, weight=w, allow_fallback=True)
        y2 = rmsnorm_kernel.rms_norm(x, weight=w, allow_fallback=True)
    assert rmsnorm_kernel.CALLS["fallback"] == 2
    assert rmsnorm_kernel.CALLS["forward"] == 0
    assert sum("reference implementation" in str(c.message) for c in caught) == 1
    # eps left out: torch's default, float64's epsilon for float64 input
    torch.testing.assert_close(y1, rms_norm_reference(x, w, torch.finfo(torch.float64).eps), rtol=0, atol=0)
    assert torch.equal(y1, y2)


# The fallback's warning is the previous test's subject; here only the returned h is.
@pytest.mark.filterwarnings("ignore:rmsnorm_kernel. input on cpu with dtype:RuntimeWarning")
def test_fallback_residual_returns_h():
    x, r = x_(2, 6, dtype=torch.float64), x_(2, 6, dtype=torch.float64)
    y, h = rmsnorm_kernel.rms_norm(x, residual=r, allow_fallback=True)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, rms_norm_reference(x + r, None, torch.finfo(torch.float64).eps))


# ---------------------------------------------------------------------------------------------
# The reference: the tutorial's worked examples, and its backward against float64 autograd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [([1.0, 1.0], [0.848528, 1.131371]), ([2.0, 0.5], [1.697056, 0.565685])],
)
def test_reference_worked_example(gamma, expected):
    y = rms_norm_reference(
        torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.tensor(gamma, dtype=torch.float64)
    )
    torch.testing.assert_close(y[0], torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_reference_backward_worked_example():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    dx, dw = rms_norm_backward_reference(
        x, torch.ones(2, dtype=torch.float64), torch.tensor([[1.0, 2.0]]).double()
    )
    torch.testing.assert_close(
        dx[0], torch.tensor([-0.090510, 0.067882], dtype=torch.float64), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("shape", oraclecheck.GRADCHECK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("offset", oraclecheck.GRADCHECK_OFFSETS)
def test_reference_gradcheck_and_explicit_backward(shape, offset):
    """float64 gradcheck of the reference, and its explicit backward against autograd: the check
    the `reference` command and the verdict report (rmsnorm_suite.walkthrough.oraclecheck)."""
    row = oraclecheck.reference_check(shape, offset)
    assert row["gradcheck"], row.get("gradcheck_error")
    assert row["formula_vs_autograd"], row.get("formula_error")


# ---------------------------------------------------------------------------------------------
# The module: a drop-in torch.nn.RMSNorm
# ---------------------------------------------------------------------------------------------


def test_module_is_a_drop_in():
    ours = rmsnorm_kernel.RMSNorm((4, 8), eps=1e-5)
    theirs = torch.nn.RMSNorm((4, 8), eps=1e-5)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert rmsnorm_kernel.RMSNorm(8, elementwise_affine=False).weight is None
    assert (
        rmsnorm_kernel.RMSNorm(8).eps is None
    )  # None means torch's default: finfo(float32).eps for fp16, bf16 and fp32


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"casting": "mistral"}, "casting"),
        ({"offset": float("nan")}, "offset"),
        ({"offset": "1"}, "offset"),
        ({"offset": 1.0, "elementwise_affine": False}, "offset needs a weight"),
    ],
)
def test_module_rejects_bad_options_at_construction(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        rmsnorm_kernel.RMSNorm(8, **kwargs)


def test_swap_rms_norm_rejects_non_module():
    with pytest.raises(TypeError, match="model"):
        rmsnorm_kernel.swap_rms_norm("not a model")


# ---------------------------------------------------------------------------------------------
# Launch plans: every row width the two-walk backward takes fits its four chunk accumulators
# ---------------------------------------------------------------------------------------------


def _two_walk_widths():
    """Both ends of the two-walk backward's range and each side of every chunk boundary in it."""
    low, high, chunk = launch.BACKWARD_MAX_TILE + 1, launch.TWO_WALK_MAX, launch.TWO_WALK_BACKWARD_CHUNK
    edges = {low, high} | {v for k in range(1, high // chunk + 1) for v in (k * chunk, k * chunk + 1)}
    return sorted(v for v in edges if low <= v <= high)


@pytest.mark.parametrize("n", _two_walk_widths())
def test_two_walk_backward_plan_covers_its_widths(n):
    rows, num_warps, per_sm, constexprs = launch._backward_chunked_plan(n, True, False, True, 0)
    chunk, chunks = constexprs[-2:]
    assert chunks == math.ceil(n / chunk) and 1 <= chunks <= 4  # backward_chunked has four accumulators
    assert num_warps * 32 <= chunk and min(per_sm) >= 1 and rows == 1


# The persistent backward's program count (132 SMs, as an H200): (row blocks, (programs per SM,
# with few rows)) -> programs. Never more programs than blocks; the few-rows count only where each
# program would get fewer than FEW_ROW_BLOCKS blocks.
BACKWARD_PROGRAMS = [
    (1, (2, 1), 1),
    (17, (2, 1), 17),
    (256, (2, 1), 132),  # 256 < 2 * 256: one program per SM
    (527, (2, 1), 132),  # 527 < 2 * 264
    (528, (2, 1), 264),  # exactly two blocks per program: the usual count
    (1024, (2, 1), 264),
    (4096, (2, 1), 264),
    (256, (4, 4), 256),  # widths without a few-rows count keep theirs
    (100000, (4, 4), 528),
]


# The dw reduction's launch over a (programs, N) scratch: (N, programs) -> (programs of the
# reduction, warps, BLOCK_P, BLOCK_C). A tall scratch in 16-column strips (8 warps from 256 rows),
# a short one in strips of N / 256 columns (16 to 256); never wider than N, never more rows per
# step than the scratch has (rounded up to a power of two).
REDUCE_PLANS = [
    ((1024, 528), (64, 8, 32, 16)),
    ((4096, 264), (256, 8, 32, 16)),
    ((16384, 132), (1024, 4, 32, 16)),
    ((65536, 33), (256, 4, 32, 256)),
    ((131072, 33), (512, 4, 32, 256)),
    ((32768, 66), (256, 4, 32, 128)),
    ((4096, 17), (256, 4, 32, 16)),
    ((257, 64), (17, 4, 32, 16)),
    ((8, 200), (1, 4, 32, 8)),
    ((1, 2), (1, 4, 2, 1)),
]


@pytest.mark.parametrize(("n_programs", "expected"), REDUCE_PLANS)
def test_reduce_plan(n_programs, expected):
    n, programs = n_programs
    (grid, one, other), num_warps, (block_p, block_c) = launch._reduce_plan(n, programs)
    assert (grid, num_warps, block_p, block_c) == expected and (one, other) == (1, 1)
    assert grid * block_c >= n > (grid - 1) * block_c  # every column, by one program


@pytest.mark.parametrize(("blocks", "per_sm", "expected"), BACKWARD_PROGRAMS)
def test_backward_program_count(blocks, per_sm, expected):
    assert launch.TUNING.FEW_ROW_BLOCKS == 2  # the table above is written for it
    assert launch.backward_programs(blocks, per_sm, 132) == expected


def test_backward_plans_give_both_program_counts():
    for n in (1, 257, 1024, 2048, 4096):
        _rows, _warps, per_sm, _constexprs = launch._backward_tile_plan(n, True, False, True, 0)
        assert len(per_sm) == 2 and min(per_sm) >= 1
    assert launch.TUNING.BACKWARD_TILE[4096][2] == (2, 1)  # measured: tools/kernel_lab.py small


@pytest.mark.parametrize(("n", "prefetch"), [(257, False), (1000, True), (2048, False), (4096, True)])
def test_backward_tile_prefetch_where_measured(n, prefetch):
    """The tile backward prefetches its next row block at the widths where it was measured faster
    (N = 1024 and 4096, tools/kernel_lab.py prefetch), and only there."""
    *_, constexprs = launch._backward_tile_plan(n, True, False, True, 0)
    assert constexprs[-1] is prefetch


# Tile forward (rows per program, warps) by (N, few rows): at N = 4096 8 warps with at most
# EVEN_MAX_ROWS rows, where a launch's latency is its time (docs/performance-notes.md, few-row
# warps), 2 with more (tools/kernel_lab.py launch and reorder2); at the narrow widths fewer warps and, at 128, more rows per program with
# many rows (tools/kernel_lab.py narrow); 256 keeps the narrow default.
FORWARD_TILE_LAUNCH = [
    (128, True, 8, 4),
    (128, False, 16, 4),
    (256, False, 4, 4),
    (257, True, 2, 4),
    (257, False, 2, 1),
    (1024, True, 1, 4),
    (1024, False, 1, 1),
    (2048, False, 1, 4),
    (4096, True, 1, 8),
    (4096, False, 1, 2),
]


@pytest.mark.parametrize(("n", "few_rows", "rows", "warps"), FORWARD_TILE_LAUNCH)
def test_forward_tile_launch(n, few_rows, rows, warps):
    """The table's entries, as the plans take them where batch invariance is off."""
    plan = launch._forward_tile_plan(n, True, False, 0, few_rows, True, invariant=False)
    assert (plan.rows, plan.num_warps) == tuple(launch.forward_config(n, few_rows)[1:]) == (rows, warps)


@pytest.mark.parametrize("n", sorted({n for n, *_ in FORWARD_TILE_LAUNCH} | {1, 7, 64, 4000}))
def test_batch_invariant_tile_plans_differ_only_in_masks(n):
    """Batch invariance (the default): a launch of few rows takes the many-row plan's rows per
    program and warps (which fix the order of a row's sum of squares) and the correctly rounded r;
    only EVEN (masks dropped, no value changed) may differ."""
    assert launch.BATCH_INVARIANT
    names = ["HAS_WEIGHT", "HAS_RESIDUAL", "CASTING", "BLOCK_N", "ROWS", "EVEN", "STORE_RSTD", "NEWTON_R"]
    few = launch._forward_tile_plan(n, True, False, 0, True, True, invariant=True)
    many = launch._forward_tile_plan(n, True, False, 0, False, True, invariant=True)
    assert (few.rows, few.num_warps) == (many.rows, many.num_warps) == tuple(launch.forward_config(n)[1:])
    few_c, many_c = dict(zip(names, few.constexprs)), dict(zip(names, many.constexprs))
    assert few_c["NEWTON_R"] is many_c["NEWTON_R"] is False
    assert {k for k in names if few_c[k] != many_c[k]} <= {"EVEN"}


# Two-walk forward launches by row width: (N, warps, chunk, y's store hint, walks unrolled).
# Up to TWO_WALK_MAX 16 warps and 8192-wide chunks; beyond it 32 warps, 16384-wide chunks, y's
# stores hinted to leave L2 first, and the walks unrolled up to four chunks (65536 is four full
# chunks, 65537 needs a fifth).
FORWARD_WALK_PLANS = [
    (4097, 16, 8192, "", False),
    (16384, 16, 8192, "", False),
    (16385, 32, 16384, "evict_first", True),
    (65536, 32, 16384, "evict_first", True),
    (65537, 32, 16384, "evict_first", False),
    (262144, 32, 16384, "evict_first", False),
]


@pytest.mark.parametrize(("n", "warps", "chunk", "store", "unroll"), FORWARD_WALK_PLANS)
def test_forward_walk_plan(n, warps, chunk, store, unroll):
    num_warps, constexprs = launch._forward_looped_plan(n, True, False, 0, True, False, True)
    # HAS_WEIGHT, HAS_RESIDUAL, CASTING, BLOCK_N, FIRST_WALK_POLICY, SECOND_WALK_POLICY, STORE_POLICY,
    # UNROLL_WALKS, N, CONTIGUOUS, HAS_OFFSET, STORE_RSTD
    assert (num_warps, constexprs[3], constexprs[6], constexprs[7], constexprs[8]) == (
        warps,
        chunk,
        store,
        unroll,
        n,
    )
    assert constexprs[4:6] == ("evict_last", "evict_first")
    assert constexprs[9:] == (True, False, True)  # CONTIGUOUS, HAS_OFFSET, STORE_RSTD as asked
