"""The timing harness without a GPU: bytes and bandwidth arithmetic, the provider registry, the
message shown where CUDA is absent, and the plumbing of a run (on CPU tensors with stand-in
CUDA events), down to the results file, the table and the plot."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import sys
import time

import pytest
import torch

from rmsnorm_suite import (
    bench,
    cases,
    cli,
    gate,
    harness,
    numerics,
    plots,
    providers,
    results,
    thresholds,
    timing,
    worker,
)

ROOT_THRESHOLDS = thresholds.load_thresholds()  # the thresholds shipped with the suite

# (shape name, mode, fewest bytes moved): forward 2 M N elem, forward+backward 5 M N elem
BYTES = [
    ("32768x4096-bfloat16", "forward", 2 * 32768 * 4096 * 2),
    ("32768x4096-bfloat16", "forward_backward", 5 * 32768 * 4096 * 2),
    ("4096x4096-float32", "forward", 2 * 4096 * 4096 * 4),
    ("128x257-float16", "forward_backward", 5 * 128 * 257 * 2),
    ("1x4096-bfloat16", "forward", 2 * 4096 * 2),
]


@pytest.mark.parametrize("shape, mode, expected", BYTES)
def test_cases_carry_the_bytes_moved(shape, mode, expected):
    case = cases.bench_shape(shape)
    assert case.nbytes[mode] == expected == cases.bytes_moved(cases.bench_shape(shape), mode)


# (bytes, milliseconds, TB/s)
BANDWIDTH = [
    (2 * 32768 * 4096 * 2, 0.1337, 536870912 / 0.1337e-3 / 1e12),  # 4.0155 TB/s
    (10**12, 1000.0, 1.0),  # a terabyte in a second
    (4 * 2**30, 1.0107679963111877, 4.249211799022668),  # the H200 copy ceiling of the peers' anchor run
]


@pytest.mark.parametrize("nbytes, ms, tbs", BANDWIDTH)
def test_bandwidth(nbytes, ms, tbs):
    assert results.bandwidth_tbs(nbytes, ms) == pytest.approx(tbs, rel=1e-12)


def test_copy_counts_read_and_write():
    assert timing.copy_bytes(2**30, 2) == 4 * 2**30


@pytest.mark.parametrize("ms", [0.0, -1.0])
def test_bandwidth_rejects_non_positive_time(ms):
    with pytest.raises(ValueError, match="ms must be > 0"):
        results.bandwidth_tbs(100, ms)


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


def test_provider_registry():
    plain = [p for p in providers.PROVIDERS if not providers.PROVIDERS[p].residual]
    assert plain == ["kernel", "eager", "native", "compiled", "liger", "quack"]
    assert all(providers.provider_available(p) for p in providers.CORE_PROVIDERS)
    assert [p for p in plain if providers.PROVIDERS[p].requires is None] == list(providers.CORE_PROVIDERS)


@pytest.mark.parametrize("peer, module", [("liger", "liger_kernel.ops.rms_norm"), ("quack", "quack.rmsnorm")])
def test_peers_listed_only_when_importable(peer, module):
    try:
        importlib.import_module(module)
        importable = True
    except Exception:
        importable = False
    assert providers.provider_available(peer) is importable
    assert (peer in providers.available_providers()) is importable


def test_unknown_provider_is_named():
    with pytest.raises(ValueError, match="unknown provider 'apex'"):
        providers.get_provider("apex")


@pytest.mark.parametrize("provider", ["eager", "native"])
def test_cpu_providers_match_the_float64_oracle(provider):
    torch.manual_seed(0)
    x, w, dy = torch.randn(17, 257), 1 + 0.1 * torch.randn(257), torch.randn(17, 257)
    fn = providers.get_provider(provider).build(cases.EPS)
    y64, dx64, dw64 = numerics.oracle(x, w, dy, cases.EPS)
    errs = harness.provider_errors(fn, x, w, dy, (y64, dx64, dw64), harness.MODES)
    assert set(errs) == {"forward", "forward_backward"}
    assert set(errs["forward_backward"]) == {"dx", "dw"}
    # fp32 compute against float64: a few fp32 roundings at most
    assert max(errs["forward"]["y"], *errs["forward_backward"].values()) < 1e-6


def test_select_cases():
    assert [c.name for c in harness.select_cases(["small"])] == [
        s.name for s in cases.BENCH_SHAPES if s.group == "small"
    ]
    assert len(harness.select_cases(["all"])) == len(cases.BENCH_SHAPES)
    assert [c.name for c in harness.select_cases(["1x4096-bfloat16", "small"])][0] == "1x4096-bfloat16"
    assert len(harness.select_cases(["1x4096-bfloat16", "small"])) == 4  # no duplicate
    with pytest.raises(ValueError, match="unknown benchmark shape '3x3-float32'"):
        harness.select_cases(["3x3-float32"])


# ---------------------------------------------------------------------------------------------
# Without CUDA
# ---------------------------------------------------------------------------------------------

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the behaviour on machines without CUDA"
)


@no_cuda
def test_run_without_cuda_raises_a_clear_error():
    with pytest.raises(timing.BenchUnavailable, match="CUDA is not available"):
        harness.run_benchmarks(harness.select_cases(["small"]), ["native"])


@no_cuda
def test_benchmark_command_without_cuda(capsys, tmp_path):
    assert cli.main(["benchmark", "--shapes", "small", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "skipped" in err
    assert not list(tmp_path.iterdir())


def test_benchmark_command_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--samples"):
        cli.main(["benchmark", "--samples", "0"])
    with pytest.raises(ValueError, match="unknown provider"):
        cli.main(["benchmark", "--providers", "apex"])
    for lead in ("-1", "nan", "20000"):
        with pytest.raises(ValueError, match="--lead-us"):
            cli.main(["benchmark", "--lead-us", lead])


# ---------------------------------------------------------------------------------------------
# A run on CPU tensors with stand-in CUDA events
# ---------------------------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(timing, "require_cuda", lambda: None)
    monkeypatch.setattr(
        harness, "environment_info", lambda: {"device": "cpu stand-in", "torch": torch.__version__}
    )
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(timing, "capture_graph", FakeGraph)


class FakeGraph:
    """Stands in for a captured CUDA graph on CPU: a replay runs the calls again."""

    def __init__(self, call, reps):
        call()  # warm-up, as the real capture does
        self.call, self.reps = call, reps

    def replay(self):
        for _ in range(self.reps):
            self.call()


def tiny(m: int, n: int, dtype: torch.dtype, group: str) -> cases.Case:
    return cases.Case.bench(m, n, dtype, group)


TINY = [tiny(8, 64, torch.float32, "small"), tiny(4, 33, torch.bfloat16, "large")]


def _broken(eps):
    def fn(x, w):
        raise RuntimeError("this provider always fails")

    return fn


@pytest.fixture
def cpu_run(fake_cuda, monkeypatch):
    monkeypatch.setitem(providers.PROVIDERS, "broken", providers.Provider("broken", _broken, "always fails"))
    return harness.run_benchmarks(
        TINY, ["native", "eager", "broken"], harness.MODES, samples=6, blocks=3, warmup_ms=0.1,
        copy_elements=4096, flush_bytes=1024, progress=False, git=results.Git("f" * 40, False),
    )  # fmt: skip


def test_run_records_every_sample_and_summary(cpu_run):
    rows = cpu_run.index()
    assert len(rows) == len(TINY) * 3 * 2
    assert cpu_run.copy.bytes == 2 * 4096 * 2
    for case in TINY:
        for mode in harness.MODES:
            row = rows["native", case.name, mode]
            whole, device = row.whole, row.device
            assert row.status == "ok" and row.bytes == case.nbytes[mode]
            assert len(whole.samples_ms) == 18 and len(whole.block_medians_ms) == 3
            assert whole.median_ms == statistics.median(whole.samples_ms)
            assert whole.tbs == pytest.approx(case.nbytes[mode] / (whole.median_ms * 1e-3) / 1e12)
            assert whole.fraction_of_copy == pytest.approx(whole.tbs / cpu_run.copy.tbs)
            assert set(row.errors) == set(thresholds.QUANTITIES[mode])
            # GPU-only samples: as many as the host-inclusive ones, per call
            assert row.device_error is None and 1 <= row.device_reps <= timing.DEVICE_MAX_REPS
            assert len(device.samples_ms) == 18 and len(device.block_medians_ms) == 3
            assert device.median_ms == statistics.median(device.samples_ms)
            # host clock samples: one per whole-call sample, one median per block, no bandwidth
            host = row.host
            assert len(host.samples_ms) == 18 and len(host.block_medians_ms) == 3
            assert host.median_ms == statistics.median(host.samples_ms) and host.tbs is None
            blocks = [host.samples_ms[k * 6 : (k + 1) * 6] for k in range(3)]
            assert list(host.block_medians_ms) == [statistics.median(b) for b in blocks]
            assert device.fraction_of_copy == pytest.approx(device.tbs / cpu_run.copy.tbs)


def test_run_times_a_copy_of_each_shapes_x(cpu_run):
    """Each shape of a forward run gets x.clone() timed both ways: the forward's bytes moved by a
    copy, with the shape's fields for the plot."""
    assert set(cpu_run.same_bytes_copy) == {case.name for case in TINY}
    for case in TINY:
        entry = cpu_run.same_bytes_copy[case.name]
        assert entry.error is None and (entry.m, entry.n, entry.group) == (case.m, case.n, case.group)
        assert entry.bytes == case.nbytes["forward"] == 2 * case.m * case.n * case.dtype.itemsize
        assert entry.median_ms > 0 and entry.device_median_ms > 0
        assert entry.tbs == pytest.approx(entry.bytes / (entry.median_ms * 1e-3) / 1e12)


def test_table_lists_the_copies_of_x(cpu_run):
    lines = bench.format_table(cpu_run).splitlines()
    start = lines.index("copy of x (x.clone(), the forward's bytes):")
    entry = cpu_run.same_bytes_copy[TINY[0].name]
    assert lines[start + 1].split()[:3] == [TINY[0].name, f"{entry.median_ms * 1e3:.1f}", "us,"]
    assert len(lines) == start + 1 + len(TINY)


def test_run_errors_are_small_for_fp32_compute_paths(cpu_run):
    for row in cpu_run.results:
        if row.provider in ("native", "eager") and row.dtype == "float32":
            assert all(v < 1e-6 for v in row.errors.values())


def test_a_provider_that_cannot_be_captured_keeps_its_host_figures(fake_cuda, monkeypatch):
    def refuse(call, reps):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(timing, "capture_graph", refuse)
    run = harness.run_benchmarks(
        TINY[:1], ["native"], ["forward"], samples=4, blocks=2, warmup_ms=0.1, copy_elements=4096,
        flush_bytes=1024, progress=False, git=results.Git(),
    )  # fmt: skip
    (row,) = run.results
    assert row.status == "ok" and len(row.whole.samples_ms) == 8 and row.whole.median_ms > 0
    assert "not permitted" in row.device_error and row.device.samples_ms == ()
    assert row.device.median_ms is None
    assert "-" in bench.format_table(run).splitlines()[-1]


def test_residual_benchmark_has_device_time_unless_asked_not_to(fake_cuda, monkeypatch, tmp_path):
    seen = {}

    def record(cases_, providers, modes, **kwargs):
        seen.update(kwargs, providers=providers)
        raise timing.BenchUnavailable("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_benchmarks", record)
    monkeypatch.setitem(providers._IMPORTABLE, "liger_residual", False)
    with pytest.raises(timing.BenchUnavailable):
        cli.main(["benchmark", "--residual", "--shapes", "1x4096-bfloat16", "--out", str(tmp_path)])
    assert seen["device_time"] is True and "kernel_residual" in seen["providers"]
    with pytest.raises(timing.BenchUnavailable):
        cli.main(
            [
                "benchmark",
                "--residual",
                "--no-device-time",
                "--shapes",
                "1x4096-bfloat16",
                "--out",
                str(tmp_path),
            ]
        )
    assert seen["device_time"] is False
    with pytest.raises(timing.BenchUnavailable):
        cli.main(["benchmark", "--shapes", "1x4096-bfloat16", "--out", str(tmp_path)])
    assert seen["device_time"] is True


def test_a_captured_call_outlives_its_graph_replays(fake_cuda, monkeypatch):
    """A real CUDA graph keeps raw addresses, not the Python objects: the harness must keep the
    captured call (and the leaf tensors it closes over) alive as long as it replays the graph."""
    import gc
    import weakref

    class AddressOnlyGraph:
        def __init__(self, call, reps):
            self.call_ref = weakref.ref(call)
            self.reps = reps

        def replay(self):
            assert self.call_ref() is not None, "the captured call was freed before a replay"

    monkeypatch.setattr(timing, "capture_graph", AddressOnlyGraph)
    x, w, dy = (torch.randn(4, 16) for _ in range(3))
    fn = providers.get_provider("eager").build(1e-6)
    graphs: dict = {}
    tally = harness._Tally()
    for _ in range(2):  # two blocks: the second replays the graph captured in the first
        harness._time_device(tally, graphs, ("eager", "forward_backward"), fn, x, w, dy, 3, None)
        gc.collect()
    assert tally.device_error is None and len(tally.device_samples_ms) == 6


def test_a_failing_provider_is_recorded_not_fatal(cpu_run):
    broken = [r for r in cpu_run.results if r.provider == "broken"]
    assert len(broken) == len(TINY) * 2
    assert all(
        r.status == "failed" and "always fails" in r.error and r.whole.median_ms is None for r in broken
    )


def test_host_samples_are_the_host_clock_around_each_timed_call(fake_cuda):
    """time_cuda's host_ms: one figure per timed sample (none for the warm-up), each the host's time
    in the call; a call that spends 2 ms on the host reads at least 2 ms."""
    host = []
    timing.time_cuda(lambda: time.sleep(0.002), samples=4, min_warmup=1, warmup_ms=0.0, host_ms=host)
    assert len(host) == 4 and all(2.0 <= h < 200 for h in host), host


def test_a_host_lead_queues_a_gpu_wait_before_every_flush(fake_cuda, monkeypatch):
    """time_cuda's lead_us: before every call, timed or warm-up, a GPU wait of lead_us at the
    measured clock, queued ahead of the flush (so the call waits behind both); none without it."""
    log = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)), raising=False)
    monkeypatch.setattr(timing, "sleep_cycles_per_us", lambda: 1500.0)

    class Flush:
        def zero_(self):
            log.append(("flush", None))

    def call():
        log.append(("call", None))

    timing.time_cuda(call, samples=4, min_warmup=1, warmup_ms=0.0, flush=Flush(), lead_us=40.0)
    calls = [i for i, (what, _) in enumerate(log) if what == "call"]
    assert len(calls) == 4 + 3  # the untimed first call, the estimate, one warm-up, 4 samples
    assert all(log[i - 2 : i] == [("sleep", 60_000), ("flush", None)] for i in calls), log
    log.clear()
    timing.time_cuda(call, samples=4, min_warmup=1, warmup_ms=0.0, flush=Flush())
    assert not [e for e in log if e[0] == "sleep"]


def test_a_run_records_its_host_lead(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    monkeypatch.setattr(timing, "sleep_cycles_per_us", lambda: 1500.0)
    run = harness.run_benchmarks(
        TINY[:1], ["native"], ["forward"], samples=3, blocks=1, warmup_ms=0.1, copy_elements=4096,
        flush_bytes=1024, progress=False, git=results.Git("f" * 40, False), lead_us=200.0,
    )  # fmt: skip
    assert run.settings["lead_us"] == 200.0
    assert "host lead 200 us" in bench.format_table(run).splitlines()[0]
    with pytest.raises(ValueError, match="lead_us"):
        harness.run_benchmarks(TINY[:1], ["native"], lead_us=-5.0)


def test_op_host_path_reads_whether_the_entry_loaded(monkeypatch):
    """ "compiled" once the op's C++ entry is set, "python" before or without it, None for an op
    without the choice; a run with the kernel records it under machine."""
    import types

    host = types.ModuleType("rmsnorm_kernel.host")
    monkeypatch.setitem(sys.modules, "rmsnorm_kernel.host", host)
    host.entry = None
    assert harness.op_host_path() == "python"
    host.entry = object()
    assert harness.op_host_path() == "compiled"
    monkeypatch.delitem(sys.modules, "rmsnorm_kernel.host")
    assert harness.op_host_path() is None


def test_table_counts_the_blocks_a_provider_was_slower_than_the_kernel(cpu_run):
    """Block i of each provider ran in the same turn: the table pairs them and counts the blocks
    in which the provider's median was above the kernel's."""
    case, mode = TINY[0].name, "forward"
    rows = cpu_run.index()
    kernel = dataclasses.replace(
        rows["native", case, mode],
        provider="kernel",
        whole=dataclasses.replace(rows["native", case, mode].whole, block_medians_ms=(2.0, 2.0, 2.0)),
    )
    eager = rows["eager", case, mode]
    eager = dataclasses.replace(
        eager, whole=dataclasses.replace(eager.whole, block_medians_ms=(1.0, 3.0, 2.5))
    )
    run = dataclasses.replace(cpu_run, results=(kernel, eager))
    lines = bench.format_table(run).splitlines()
    assert "slower in" in lines[2]
    kernel_line, eager_line = lines[4], lines[5]
    assert kernel_line.split()[2] == "kernel" and eager_line.split()[2] == "eager"
    # the last five columns: slower in, ratio 90%, gpu us, gpu copy%, host us
    assert kernel_line.split()[-5:-3] == ["-", "-"]
    assert eager_line.split()[-5] == "2/3"
    assert eager_line.split()[-1] == f"{eager.host.median_ms * 1e3:.1f}"
    low, high = map(float, eager_line.split()[-4].split("-"))
    assert low < 1 < high  # ratios 0.5, 1.5 and 1.25: not decided
    # rows of different block counts are not paired
    short = dataclasses.replace(eager, whole=dataclasses.replace(eager.whole, block_medians_ms=(9.0,)))
    assert bench._slower_blocks(short.whole, kernel.whole) == "-"
    assert bench._ratio_interval(short.whole, kernel.whole) == "-"


def test_ratio_interval_decides_a_steady_difference(cpu_run):
    """Twice the kernel's time in every block, with some spread: the interval lies above 1; half
    of it, below 1."""
    t = cpu_run.results[0].whole
    kernel = dataclasses.replace(t, block_medians_ms=(2.0, 2.1, 1.9, 2.0))
    slower = dataclasses.replace(t, block_medians_ms=(3.9, 4.3, 3.7, 4.1))
    faster = dataclasses.replace(t, block_medians_ms=(1.0, 1.1, 0.9, 1.0))
    low, high = map(float, bench._ratio_interval(slower, kernel).split("-"))
    assert 1 < low < 2 < high
    low, high = map(float, bench._ratio_interval(faster, kernel).split("-"))
    assert low < 0.5 < high < 1


def test_results_file_round_trip_and_table(cpu_run, tmp_path):
    path = results.write(cpu_run, tmp_path)
    assert path.name.startswith("bench-") and path.name.endswith("-ffffffffff.json")
    again = results.load(path)
    assert again == cpu_run
    table = bench.format_table(again)
    assert "copy ceiling" in table and table.count("FAILED") == 4
    assert "8x64-float32" in table and "4x33-bfloat16" in table


def test_the_gate_can_judge_a_run_against_itself(cpu_run):
    verdict = gate.judge(cpu_run, cpu_run, ROOT_THRESHOLDS, provider="native")
    assert verdict.status == "error"  # 18 samples per side; regression.toml asks for 20
    lax = thresholds.Thresholds(
        ROOT_THRESHOLDS.latency,
        ROOT_THRESHOLDS.numerics,
        min_samples=5,
        device_latency=ROOT_THRESHOLDS.device_latency,
        family=ROOT_THRESHOLDS.family,  # the rules' level is the family's (regression.toml [family])
    )
    verdict = gate.judge(cpu_run, cpu_run, lax, provider="native")
    assert verdict.status == "pass", verdict.summary


def test_worker_writes_its_round(fake_cuda, tmp_path):
    out = tmp_path / "round.json"
    spec = {
        "cases": [harness.case_to_json(TINY[0])], "providers": ["native"], "modes": ["forward"],
        "samples": 5, "warmup_ms": 0.1, "copy_elements": 1024, "label": "head", "round": 3,
        "commit": "abc", "out": str(out),
    }  # fmt: skip
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    assert worker.main([str(spec_path)]) == 0
    run = results.load(out)
    assert (run.label, run.round, run.git.commit) == ("head", 3, "abc")
    assert len(run.results) == 1 and len(run.results[0].whole.samples_ms) == 5
    assert run.same_bytes_copy == {}  # the gate reads the kernel's rows only: no copies timed


def test_worker_refuses_a_package_from_elsewhere(fake_cuda, tmp_path, capsys):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"expect_op_under": str(tmp_path / "src"), "out": "x"}))
    assert worker.main([str(spec_path)]) == 2
    assert "expected under" in capsys.readouterr().err


def test_case_json_round_trip():
    case = cases.bench_shape("4096x4096-bfloat16")
    assert harness.case_from_json(json.loads(json.dumps(harness.case_to_json(case)))) == case


# ---------------------------------------------------------------------------------------------
# The plot and the performance page
# ---------------------------------------------------------------------------------------------


def test_bandwidth_plot(cpu_run, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    png = plots.plot_bandwidth(cpu_run, tmp_path / "bw.png", dtype="bfloat16")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = plots.bandwidth_series(cpu_run, "forward", dtype="bfloat16")
    assert set(series) == {"native", "eager"}  # the failed rows are left out
    rows = cpu_run.index()
    for kind, device in (("whole", False), ("device", True)):
        series = plots.bandwidth_series(cpu_run, "forward", dtype="bfloat16", timing=kind)
        for provider, points in series.items():
            expected = sorted(
                (r.n, r.timing(kind).tbs)
                for (p, _, mode), r in rows.items()
                if p == provider and mode == "forward" and r.dtype == "bfloat16" and r.group == "large"
            )
            assert points == expected
        copies = plots.same_bytes_copy_series(cpu_run, dtype="bfloat16", timing=kind)
        assert copies == sorted(
            (e.n, e.device_tbs if device else e.tbs)
            for e in cpu_run.same_bytes_copy.values()
            if e.dtype == "bfloat16"
        )
    with pytest.raises(ValueError, match="no successful large/medium float16 rows"):
        plots.plot_bandwidth(cpu_run, tmp_path / "none.png", dtype="float16")
    # the memory-bound groups are plotted (65536x1024 is "medium"), the launch-bound one is not
    for group, plotted in (("medium", True), ("small", False)):
        regrouped = dataclasses.replace(
            cpu_run, results=tuple(dataclasses.replace(r, group=group) for r in cpu_run.results)
        )
        assert bool(plots.bandwidth_series(regrouped, "forward", dtype="bfloat16")) is plotted


def test_performance_command_saves_the_run_it_draws(cpu_run, monkeypatch, tmp_path):
    """A fresh `python -m rmsnorm_suite.plots` run writes the page, the plot and a copy of the
    results it drew them from, so `--results` on that copy redraws the same page."""
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    monkeypatch.setattr(harness, "run_benchmarks", lambda *a, **k: cpu_run)
    md, png, saved = tmp_path / "perf.md", tmp_path / "bw.png", tmp_path / "docs" / "results.json"
    paths = ["--markdown", str(md), "--png", str(png)]
    assert plots.main([*paths, "--out", str(tmp_path / "runs"), "--saved", str(saved)]) == 0
    assert results.load(saved) == cpu_run
    page = md.read_text()
    assert plots.main([*paths, "--results", str(saved)]) == 0
    assert md.read_text() == page


def as_kernel(run: results.Run, provider: str = "eager") -> results.Run:
    """The run with ``provider``'s rows standing for the kernel's."""
    rows = tuple(
        dataclasses.replace(r, provider="kernel") if r.provider == provider else r for r in run.results
    )
    return dataclasses.replace(run, results=rows)


def test_performance_markdown(cpu_run):
    run = as_kernel(cpu_run)
    text = plots.performance_markdown(run, "bw.png")
    lines = text.splitlines()
    columns = "| shape | mode | kernel µs | kernel TB/s | of copy | copy of x µs | best peer | peer µs | peer/kernel |"
    table = lines[lines.index(columns) + 2 :][: len(TINY) * 2]
    assert all(line.startswith("| ") and line.count(" | ") == 8 for line in table)
    rows = run.index()
    kernel, native = rows["kernel", "8x64-float32", "forward"], rows["native", "8x64-float32", "forward"]
    copy = run.same_bytes_copy["8x64-float32"]
    cells = table[0].strip("| ").split(" | ")
    assert cells[:3] == ["8x64-float32", "forward", f"{kernel.whole.median_ms * 1e3:.1f}"]
    assert cells[5] == f"{copy.median_ms * 1e3:.1f}"
    assert table[1].strip("| ").split(" | ")[1:2] + table[1].strip("| ").split(" | ")[5:6] == [
        "forward+backward",
        "-",
    ]
    assert cells[6:] == [
        "native",
        f"{native.whole.median_ms * 1e3:.1f}",
        f"{native.whole.median_ms / kernel.whole.median_ms:.2f}",
    ]
    assert "![bandwidth against N per provider, whole calls and GPU time](bw.png)" in text
    # the second table reads the GPU-only figures
    assert lines.count(columns) == 2 and "## GPU time alone" in text
    device_table = lines[len(lines) - lines[::-1].index(columns) + 1 :][: len(TINY) * 2]
    cells = device_table[0].strip("| ").split(" | ")
    assert cells[2] == f"{kernel.device.median_ms * 1e3:.1f}"
    assert cells[5] == f"{copy.device_median_ms * 1e3:.1f}"
    best = min((r for r in (native, rows["broken", "8x64-float32", "forward"]) if r.device.median_ms),
               key=lambda r: r.device.median_ms)  # fmt: skip
    assert cells[6:] == [
        "native",
        f"{best.device.median_ms * 1e3:.1f}",
        f"{best.device.median_ms / kernel.device.median_ms:.2f}",
    ]


# ---------------------------------------------------------------------------------------------
# On a GPU: the harness itself, on two shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nox -s gpu)")
def test_harness_on_the_gpu():
    """A short real run: every row succeeds, the figures are physical (no call beats the copy
    ceiling by more than the L2 could explain), the kernel's errors are within the gate's
    ceilings, and the gate passes a run against itself."""
    chosen = harness.select_cases(["4096x4096-bfloat16", "128x257-float32"])
    run = harness.run_benchmarks(
        chosen, ["kernel", "native"], harness.MODES, samples=25, blocks=3, copy_elements=2**28
    )
    assert 0.5 < run.copy.tbs < 20
    for row in run.results:
        whole, device = row.whole, row.device
        assert row.status == "ok", row.error
        assert len(whole.samples_ms) == 75 and whole.median_ms > 0
        assert whole.fraction_of_copy < 1.5
        # graph replays: captured, GPU time no longer than the whole call, physical bandwidth
        assert row.device_error is None and len(device.samples_ms) == 75
        assert 0 < device.median_ms <= whole.median_ms * 1.05 and device.fraction_of_copy < 1.5
        # the host clock around the same calls: one figure per sample, under a millisecond a call
        assert len(row.host.samples_ms) == 75 and 0 < row.host.median_ms < 1.0
        if row.provider == "kernel":
            ceiling = ROOT_THRESHOLDS.numerics[row.dtype].ceiling
            assert all(value <= ceiling[q] for q, value in row.errors.items()), row.errors
    assert gate.judge(run, run, ROOT_THRESHOLDS).status == "pass"
    # the host path the op's calls took, as RMSNORM_KERNEL_HOST forced it (nox -s gpu forces each)
    forced = os.environ.get("RMSNORM_KERNEL_HOST")
    if forced in ("compiled", "python"):
        assert run.machine["op_host_path"] == forced
    else:
        assert run.machine["op_host_path"] in ("compiled", "python")


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nox -s gpu)")
def test_a_host_lead_hides_host_work_shorter_than_it():
    """A call that spends 400 µs on the host before its launch reads at least most of that without
    a lead (the flush queued before it is shorter) and far less behind a 2 ms lead."""
    flush, y = timing.make_flush(), torch.zeros(1024, device="cuda")

    def call():
        t = time.perf_counter() + 400e-6
        while time.perf_counter() < t:
            pass
        y.add_(1)

    bare = statistics.median(timing.time_cuda(call, samples=15, warmup_ms=0.0, flush=flush))
    led = statistics.median(timing.time_cuda(call, samples=15, warmup_ms=0.0, flush=flush, lead_us=2000.0))
    assert bare > 0.25 and led < 0.1, (bare, led)
    assert 500 < timing.sleep_cycles_per_us() < 5000  # the GPU's clock, in MHz


# ---------------------------------------------------------------------------------------------
# The fused residual add + RMSNorm providers
# ---------------------------------------------------------------------------------------------


def test_residual_providers_are_separate_from_the_plain_ones():
    assert set(providers.RESIDUAL_PROVIDERS) == {"kernel_residual", "unfused_residual", "liger_residual"}
    assert not set(providers.available_providers()) & set(providers.RESIDUAL_PROVIDERS)
    assert {"kernel_residual", "unfused_residual"} <= set(providers.available_providers(residual=True))


@pytest.mark.parametrize("shape", cases.BENCH_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", cases.BENCH_MODES)
def test_residual_bytes_match_the_declared_count(shape, mode):
    case = shape
    assert harness._residual_bytes(case, mode) == cases.residual_bytes_moved(shape, mode)


def test_performance_page_ignores_residual_rows():
    from rmsnorm_suite import plots

    def row(provider, ms, residual=False):
        return {
            "provider": provider, "shape": "4096x4096-bfloat16", "m": 4096, "n": 4096, "dtype": "bfloat16",
            "group": "medium", "mode": "forward", "status": "ok", "median_ms": ms, "tbs": 1.0,
            "fraction_of_copy": 0.5, "residual": residual,
        }  # fmt: skip

    run = {
        "schema": 1,
        "results": [row("kernel", 0.030), row("native", 0.040), row("unfused_residual", 0.001, True)],
        "copy": {"tbs": 4.0},
    }
    page = plots.performance_markdown(run)
    assert "native" in page and "unfused_residual" not in page


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_residual_providers_compute_the_same_function_on_cpu():
    torch.manual_seed(0)
    x, r = torch.randn(5, 257), torch.randn(5, 257)
    w = 1 + 0.1 * torch.randn(257)
    fused = providers.get_provider("kernel_residual").build(1e-6)(x, w, r)
    unfused = providers.get_provider("unfused_residual").build(1e-6)(x, w, r)
    torch.testing.assert_close(fused, unfused, atol=cases.TOLERANCES[torch.float32].atol, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The asv suite, driven by hand as asv would
# ---------------------------------------------------------------------------------------------


def _asv_suite():
    return importlib.import_module("benchmarks.bench_rmsnorm")


def test_asv_suite_records_a_saved_results_file(cpu_run, tmp_path, monkeypatch):
    """RMSNORM_BENCH_RESULTS: the suite reports that run's figures, GPU-only ones included, and
    measures nothing (this machine has no CUDA)."""
    suite = _asv_suite()
    run = as_kernel(cpu_run)
    path = results.write(run, tmp_path)
    monkeypatch.setenv("RMSNORM_BENCH_RESULTS", str(path))
    monkeypatch.setattr(harness, "run_benchmarks", lambda *a, **k: pytest.fail("measured again"))
    forward, forward_backward = suite.Forward(), suite.ForwardBackward()
    cache = forward.setup_cache()
    assert all("samples_ms" not in r and "device_samples_ms" not in r for r in cache["rows"].values())
    row = run.index()["kernel", "8x64-float32", "forward"]
    whole, device = row.whole, row.device
    forward.setup(cache, "8x64-float32", "kernel")
    assert forward.track_median_ms(cache, "8x64-float32", "kernel") == whole.median_ms
    assert forward.track_gpu_median_ms(cache, "8x64-float32", "kernel") == device.median_ms
    assert row.host.median_ms is not None
    assert forward.track_host_median_ms(cache, "8x64-float32", "kernel") == row.host.median_ms
    # the spread: the run's fastest and slowest samples, whole call and GPU time alone
    assert forward.track_min_ms(cache, "8x64-float32", "kernel") == min(whole.samples_ms)
    assert forward.track_max_ms(cache, "8x64-float32", "kernel") == max(whole.samples_ms)
    assert forward.track_gpu_min_ms(cache, "8x64-float32", "kernel") == min(device.samples_ms)
    assert forward.track_gpu_max_ms(cache, "8x64-float32", "kernel") == max(device.samples_ms)
    assert whole.samples_ms and min(whole.samples_ms) <= whole.median_ms <= max(whole.samples_ms)
    forward_backward.setup(cache, "4x33-bfloat16", "kernel")
    assert forward_backward.track_error_dw(cache, "4x33-bfloat16", "kernel") == pytest.approx(
        run.index()["kernel", "4x33-bfloat16", "forward_backward"].errors["dw"]
    )
    with pytest.raises(NotImplementedError, match="always fails"):
        forward.setup(cache, "8x64-float32", "broken")
    with pytest.raises(NotImplementedError, match="not importable"):
        forward.setup(cache, "8x64-float32", "liger")


def test_asv_suite_tracks_only_figures_where_larger_is_worse():
    """asv's Regressions page flags every increase: a bandwidth or a fraction of the copy ceiling
    going up would be listed as a regression."""
    suite = _asv_suite()
    for cls in (suite.Forward, suite.ForwardBackward):
        tracked = {name: getattr(cls, name) for name in dir(cls) if name.startswith("track_")}
        assert tracked and all(fn.unit in ("ms", "relative L2 error") for fn in tracked.values()), tracked


def test_asv_suite_lists_plain_providers_only():
    suite = _asv_suite()
    assert "kernel" in suite.PROVIDERS
    assert not set(suite.PROVIDERS) & set(providers.RESIDUAL_PROVIDERS)


def test_a_spec_case_is_its_shape_and_a_forged_name_or_size_is_refused():
    shape = cases.bench_shape("4096x4096-bfloat16")
    spec = harness.case_to_json(shape)
    assert harness.case_from_json(spec) == shape
    for forged in (
        {**spec, "name": "1x1-bfloat16"},
        {**spec, "bytes": {"forward": 1, "forward_backward": 1}},
    ):
        with pytest.raises(ValueError, match="not those of 4096x4096-bfloat16"):
            harness.case_from_json(forged)
