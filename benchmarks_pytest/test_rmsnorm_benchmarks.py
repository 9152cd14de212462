"""pytest-benchmark: quick local comparisons of every provider at every benchmark shape.

pytest-benchmark times with a host clock, so each timed call ends with ``torch.cuda.synchronize()``
and the L2 is flushed in the untimed setup: its figures are host latencies (launch, kernel, sync).
The harness's own CUDA-event median of the same call, its GPU time alone and its host time go
into ``extra_info`` beside them.

    nox -s bench                                   # runs and autosaves (.benchmarks/)
    nox -s bench -- --benchmark-compare --benchmark-compare-fail=median:5%
    pytest benchmarks_pytest -k "kernel and 4096x4096" --benchmark-only

docs/gate.md says how these relate to the gate (they do not replace it).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from rmsnorm_suite import cases, harness, providers, results, timing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=timing.cuda_message()),
]

ROUNDS = 50
PROVIDERS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(not providers.provider_available(name), reason=f"{name} not importable"),
    )
    for name in providers.PROVIDERS
    if not providers.PROVIDERS[name].residual  # the fused residual pass is a different operation
]


@pytest.fixture(scope="module")
def flush():
    return timing.make_flush()


@pytest.fixture(scope="module")
def built():
    """One builder call per provider for the module, as in a run of the harness."""
    return {}


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", [s.name for s in cases.BENCH_SHAPES])
def test_rmsnorm(benchmark, flush, built, shape, provider, mode):
    case = cases.bench_shape(shape)
    if provider not in built:
        built[provider] = providers.get_provider(provider).build(cases.EPS)
    x, w, dy = harness.make_inputs(case)
    call, grads = harness.make_call(built[provider], x, w, dy, mode)
    host: list[float] = []
    cuda_ms = statistics.median(
        timing.time_cuda(call, samples=ROUNDS, flush=flush, grads=grads, host_ms=host)
    )
    graph_call, _ = harness.make_call(
        built[provider], x, w, dy, mode, graph=True
    )  # alive while the graph replays
    graph, reps = timing.graph_for(graph_call, flush)
    gpu_ms = statistics.median(timing.time_graph(graph, reps, ROUNDS, flush))
    del graph, graph_call

    def setup():
        for t in grads:
            t.grad = None
        flush.zero_()
        torch.cuda.synchronize()

    def timed():
        call()
        torch.cuda.synchronize()

    benchmark.group = f"{shape} {mode}"
    benchmark.extra_info.update(
        provider=provider,
        cuda_event_median_ms=cuda_ms,
        gpu_only_median_ms=gpu_ms,
        host_median_ms=statistics.median(host),
        tbs=results.bandwidth_tbs(case.nbytes[mode], cuda_ms),
        bytes=case.nbytes[mode],
    )
    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, warmup_rounds=3, iterations=1)
