"""The judge's stopwatch: its plan, its answers on CPU, and its judgement of made-up rounds."""

from __future__ import annotations

import json

import pytest
import torch

from rmsnorm_suite import harness, stopwatch
from rmsnorm_suite.stopwatch import Side


def test_every_case_and_mode_is_a_block_with_bounded_calls():
    cases_ = harness.select_cases(["all"])
    blocks = stopwatch.plan(cases_, ["forward", "forward_backward"], "cuda", (4, 64))
    keys = [(c.name, m) for c in cases_ for m in ("forward", "forward_backward")]
    assert [(b.key, b.repeat) for b in blocks] == [(k, r) for r in range(stopwatch.REPEATS) for k in keys]
    assert {b.group for b in blocks} == {"large", "medium", "small"}
    for b, case in zip(blocks[::2], cases_):
        assert 1 <= b.reps <= stopwatch.MAX_REPS
        assert b.reps == stopwatch.MAX_REPS or b.reps * case.nbytes["forward"] >= stopwatch.BLOCK_BYTES


def _op(x, w, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


HOST_BLOCKS = [
    stopwatch.Block("a", "small", "forward", (4, 64), "float32", 5),
    stopwatch.Block("a", "small", "forward_backward", (4, 64), "float32", 5),
]


def test_same_seeds_same_answers_and_another_op_differs():
    one = stopwatch.Stopwatch(_op, HOST_BLOCKS, seed=3, device="cpu")
    two = stopwatch.Stopwatch(_op, HOST_BLOCKS, seed=3, device="cpu")
    assert one.block(0, 11) == two.block(0, 11)
    assert one.block(1, 12) == two.block(1, 12)
    assert len(one.block(1, 12)) == 4  # dx and dw projections, then their scales
    assert one.block(0, 11) != one.block(0, 13)  # other windows

    def unnormalised(x, w, eps=1e-6):
        return x * w

    wrong = stopwatch.Stopwatch(unnormalised, HOST_BLOCKS, seed=3, device="cpu").block(0, 11)
    right = one.block(0, 11)
    assert abs(wrong[0] - right[0]) > 0.02 * right[1]


def test_a_subclass_output_is_refused():
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="not a torch.Tensor"):
        stopwatch.Stopwatch(lambda x, w: _op(x, w).as_subclass(Sub), HOST_BLOCKS[:1], 1, "cpu")


def test_an_answer_must_echo_go_and_hold_finite_figures():
    block = HOST_BLOCKS[1]
    assert stopwatch.read_answer(json.dumps({"go": 5, "sums": [1, 2, 3, 4]}), block, 5) == [1, 2, 3, 4]
    for bad in (
        {"go": 6, "sums": [1, 2, 3, 4]},
        {"go": 5, "sums": [1, 2]},
        {"go": 5, "sums": [1, 2, 3, float("inf")]},
    ):
        with pytest.raises(ValueError):
            stopwatch.read_answer(json.dumps(bad), block, 5)


def test_a_float16_projection_of_large_outputs_stays_finite():
    # y near float16's top: its GEMV against an unscaled vector overflows 65504
    block = stopwatch.Block("wide", "small", "forward", (4, 257), "float16", 5)
    watch = stopwatch.Stopwatch(lambda x, w: torch.full_like(x, 3e4), [block], seed=5, device="cpu")
    _, _, _, u, v, _ = watch.inputs[block.key]
    assert abs(3e4 * float(v.sum())) > 65504  # each row's y . v, in float16, overflows unscaled
    sums = watch.block(0, 11)
    assert all(torch.tensor(sums).isfinite()), sums
    exact = 5 * float(u.double().sum() * 3e4 * v.double().sum())  # 5 calls of the same y
    assert sums[0] == pytest.approx(exact, rel=2e-3)


def test_a_float16_dx_stays_far_from_overflow_on_the_judges_data():
    # dx grows as dy / rms(x): x keeps its scaled runs, dy is unit normal (scaled, 8.1e3 was seen)
    block = stopwatch.Block("narrow", "small", "forward_backward", (128, 257), "float16", 3)
    worst = 0.0
    for seed in range(4):
        watch = stopwatch.Stopwatch.__new__(stopwatch.Stopwatch)
        watch.torch, watch.device = torch, "cpu"
        xs, dys, w, *_ = watch._draw(torch.Generator().manual_seed(seed), block)
        for start in range(0, xs.numel() - 128 * 257, 1024):
            x = xs[start : start + 128 * 257].view(128, 257).float().requires_grad_()
            y = torch.nn.functional.rms_norm(x, (257,), w.float(), 1e-3)
            y.backward(dys[start : start + 128 * 257].view(128, 257).float())
            worst = max(worst, x.grad.abs().max().item())
    assert worst < 65504 / 512, worst  # 18-33 here; 214-1387 with dy in scaled runs


def test_a_non_finite_answer_names_its_block():
    with pytest.raises(ValueError, match="a forward_backward holds a projection"):
        stopwatch.read_answer(json.dumps({"go": 5, "sums": [1, 2, float("nan"), 4]}), HOST_BLOCKS[1], 5)


BLOCKS = [
    stopwatch.Block("big", "large", "forward", (8, 8), "bfloat16", 10),
    stopwatch.Block("tiny", "small", "forward", (8, 8), "bfloat16", 10),
]
SUMS = [[1.0, 10.0], [2.0, 10.0]]


def _side(seconds, claimed, sums=SUMS):
    return Side(seconds, sums, claimed)


def _judge(base, head):
    return stopwatch.judge(base, head, BLOCKS, tolerance=0.10, consistency=0.05, sums_tolerance=0.02)


def test_the_same_op_passes():
    base = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(3)}
    head = {k: _side([0.0101, 0.0040], [0.0071, 0.002]) for k in range(3)}
    assert _judge(base, head)[0] == "pass"


def test_an_honest_slow_head_regresses_and_a_forging_one_is_an_error():
    base = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(3)}
    honest = {k: _side([0.013, 0.0052], [0.010, 0.0032]) for k in range(3)}
    assert _judge(base, honest)[0] == "regression"
    # the small group 10x slower, its rows forged to base's: the large group alone passes
    forged = {k: _side([0.010, 0.040], [0.007, 0.002]) for k in range(3)}
    verdict, _, note = _judge(base, forged)
    assert verdict == "error" and "(small: " in note


def test_one_noisy_round_of_three_does_not_decide():
    base = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(3)}
    head = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(3)}
    head[1] = _side([0.030, 0.012], [0.007, 0.002])
    assert _judge(base, head)[0] == "pass"


def test_a_block_counts_the_median_of_its_repeats():
    blocks = [
        stopwatch.Block(b.case, b.group, b.mode, b.shape, b.dtype, b.reps, r)
        for r in range(3)
        for b in BLOCKS
    ]
    base = {k: Side([0.010, 0.004] * 3, SUMS * 3, [0.007, 0.002] * 3) for k in range(3)}
    hiccup = {
        k: Side([0.010, 0.004, 0.010, 0.012, 0.010, 0.004], SUMS * 3, [0.007, 0.002] * 3) for k in range(3)
    }
    slow = {k: Side([0.010, 0.012] * 3, SUMS * 3, [0.007, 0.002] * 3) for k in range(3)}
    judge = stopwatch.judge
    assert judge(base, hiccup, blocks, tolerance=0.1, consistency=0.05, sums_tolerance=0.02)[0] == "pass"
    assert judge(base, slow, blocks, tolerance=0.1, consistency=0.05, sums_tolerance=0.02)[0] == "error"


def test_outputs_unlike_base_are_an_error_and_no_pair_cannot_judge():
    base = {0: _side([0.01, 0.004], [0.007, 0.002])}
    head = {0: _side([0.01, 0.004], [0.007, 0.002], sums=[[1.0, 10.0], [2.5, 10.0]])}
    verdict, _, note = _judge(base, head)
    assert verdict == "error" and "tiny forward" in note
    assert _judge(base, {})[0] == "error"


def test_an_accepted_regression_is_allowed_its_factor_here_too():
    base = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(3)}
    slower = {k: _side([0.013, 0.004], [0.010, 0.002]) for k in range(3)}  # big forward x1.3, rows honest
    args = dict(tolerance=0.10, consistency=0.05, sums_tolerance=0.02)
    assert stopwatch.judge(base, slower, BLOCKS, **args)[0] == "regression"
    assert stopwatch.judge(base, slower, BLOCKS, **args, accepted={("big", "forward"): 1.3})[0] == "pass"
    assert (
        stopwatch.judge(base, slower, BLOCKS, **args, accepted={("tiny", "forward"): 1.3})[0] == "regression"
    )


def test_a_block_where_the_op_is_a_small_share_is_held_only_to_the_coarse_limit():
    """Base's rows claim 70% of the big block's stopwatch time and 20% of the tiny one's: at a 40%
    floor the tiny block's spread (its projections and autograd, not the op) is held to the coarse
    limit only, and the ratio leaves it out; a head several times slower than its rows there
    still fails."""
    base = {k: _side([0.010, 0.010], [0.007, 0.002]) for k in range(3)}
    noisy = {k: _side([0.010, 0.016], [0.007, 0.002]) for k in range(3)}  # tiny +60%, rows the same
    args = dict(tolerance=0.10, consistency=0.05, sums_tolerance=0.02)
    assert stopwatch.judge(base, noisy, BLOCKS, **args)[0] == "error"  # every block judged finely
    verdict, ratio, note = stopwatch.judge(base, noisy, BLOCKS, **args, share=0.4, coarse=0.4)
    assert (verdict, ratio) == ("pass", 1.0), note
    assert "where the op is less (tiny forward (20.0%)): small +37.5%, limit 40%" in note
    forged = {k: _side([0.010, 0.030], [0.007, 0.002]) for k in range(3)}  # tiny 3x, rows base's
    verdict, _, note = stopwatch.judge(base, forged, BLOCKS, **args, share=0.4, coarse=0.4)
    assert verdict == "error" and "(small: " in note, note


def test_the_share_is_bases_so_head_cannot_take_its_group_out_of_judgement():
    """A head that forges its rows to nothing in the large group still has it judged (the share is
    read from base's rows), and hiding time there is an error."""
    base = {k: _side([0.010, 0.010], [0.007, 0.002]) for k in range(3)}
    forged = {k: _side([0.020, 0.010], [0.0, 0.002]) for k in range(3)}
    verdict, _, note = stopwatch.judge(
        base, forged, BLOCKS, tolerance=0.10, consistency=0.05, sums_tolerance=0.02, share=0.4
    )
    assert verdict == "error" and "(large: " in note


def test_no_group_over_the_share_cannot_judge():
    base = {k: _side([0.010, 0.010], [0.002, 0.002]) for k in range(3)}
    verdict, ratio, note = stopwatch.judge(
        base, base, BLOCKS, tolerance=0.10, consistency=0.05, sums_tolerance=0.02, share=0.4
    )
    assert verdict == "error" and ratio is None and "cannot judge these shapes" in note, note


def test_the_share_floor_is_declared_once_and_checked(tmp_path):
    from rmsnorm_suite.thresholds import load_thresholds

    assert load_thresholds().stopwatch_share == 0.4  # regression.toml [stopwatch] share
    for bad in ("-0.1", "1.5", "true"):
        path = tmp_path / "t.toml"
        path.write_text(f"[stopwatch]\nshare = {bad}\n")
        with pytest.raises(ValueError, match="stopwatch.share"):
            load_thresholds(path)


def test_a_block_forged_low_cannot_hide_behind_another_of_its_group():
    """Two finely judged blocks of one group: head hides 0.008 s in the first and claims 0.008 s
    more than it takes in the second. The second buys at most `consistency` of its seconds, so
    the group's sum still shows the first; and the first alone passes `single`."""
    blocks = [
        stopwatch.Block("a", "large", "forward", (8, 8), "bfloat16", 10),
        stopwatch.Block("b", "large", "forward_backward", (8, 8), "bfloat16", 10),
    ]
    sums = [[1.0, 10.0], [2.0, 3.0, 10.0, 10.0]]
    base = {k: Side([0.010, 0.010], sums, [0.007, 0.007]) for k in range(3)}
    offset = {k: Side([0.015, 0.010], sums, [0.004, 0.015]) for k in range(3)}
    args = dict(tolerance=1.0, consistency=0.05, sums_tolerance=0.02, share=0.4, coarse=0.4)
    verdict, _, note = stopwatch.judge(base, offset, blocks, **args, single=0.2)
    # the inflated block buys the group at most `consistency` of its own seconds: +30.0% shows
    assert verdict == "error" and "(large: +30.0%)" in note, note
    verdict, _, note = stopwatch.judge(base, offset, blocks, **{**args, "consistency": 1.0}, single=0.2)
    assert verdict == "error" and "(a forward: +53.3% alone)" in note, note
    assert stopwatch.judge(base, base, blocks, **args, single=0.2)[0] == "pass"


def test_a_head_that_forges_a_minority_of_rounds_fails_the_round_limit():
    """Six rounds: head's tiny block ten times slower in all of them, its rows honest in four and
    copied from base's in two. The upper median sees only honest rounds; every round is held to
    any_round, and the forged ones pass it."""
    base = {k: _side([0.010, 0.020], [0.007, 0.005]) for k in range(6)}
    head = {k: _side([0.010, 0.065], [0.007, 0.050 if k > 1 else 0.005]) for k in range(6)}
    args = dict(tolerance=0.10, consistency=0.05, sums_tolerance=0.02, share=0.4, coarse=0.4, single=0.2)
    assert stopwatch.judge(base, head, BLOCKS, **args)[0] == "pass"  # the upper median alone
    verdict, _, note = stopwatch.judge(base, head, BLOCKS, **args, any_round=0.6)
    assert verdict == "error" and "in round 0" in note, note


def test_too_few_paired_rounds_cannot_judge():
    base = {k: _side([0.010, 0.004], [0.007, 0.002]) for k in range(2)}
    verdict, ratio, note = stopwatch.judge(
        base, base, BLOCKS, tolerance=0.10, consistency=0.05, sums_tolerance=0.02, min_rounds=3
    )
    assert (verdict, ratio) == ("error", None) and "2 rounds of both sides answered" in note
