"""asv benchmarks: every provider at every shape of ``cases.BENCH_SHAPES``, forward and forward+backward.

asv's own timers measure host wall time; these benchmarks instead report the figures of the
project's harness (:mod:`rmsnorm_suite.harness`: CUDA events around whole calls, L2 flushed before
each sample, three blocks of samples, the median; the GPU time alone from CUDA-graph
replays; and the host's time per call) as ``track_`` values, so that the asv history,
the gate, pytest-benchmark's extra info and docs/performance.md all show the same numbers.

Only figures where larger is worse are tracked (times and errors): asv's Regressions page flags
every increase, so a bandwidth going up would be listed as a regression. asv keeps no spread for a
``track_`` value, so the fastest and slowest sample of each median are tracked beside it
(``track_min_ms``, ``track_max_ms``). Each benchmark has one graph per provider and shape: the
page's ``p-shape`` selection (``#bench_rmsnorm.Forward.track_median_ms?p-shape='4096x4096-bfloat16'``)
shows one shape, every provider a line; docs/gate.md lists the links.

One ``setup_cache`` (shared by both classes: asv keys it by its source line) measures everything
once, with the device-to-device copy ceiling of the same run. With ``RMSNORM_BENCH_RESULTS`` naming
a results file of the harness (``rmsnorm-kernel benchmark``), the suite records that run instead
of measuring again, so one measurement feeds both the asv history and docs/performance.md; it
must be a run of the commit asv files the results under. Without CUDA, or for a peer that
does not import here, ``setup`` raises NotImplementedError and asv records the benchmark as
skipped.
"""

from __future__ import annotations

import os

import torch

from rmsnorm_suite import cases, harness, providers, results, timing

SHAPES = [s.name for s in cases.BENCH_SHAPES]
PROVIDERS = [name for name, p in providers.PROVIDERS.items() if not p.residual]  # plain RMSNorm only


def _tracked(row: results.Row) -> dict:
    """What the track_ methods report of one row, keyed as they read it."""
    out = {"status": row.status, "error": row.error, "errors": dict(row.errors)}
    for prefix, t in (("", row.whole), ("device_", row.device), ("host_", row.host)):
        out[f"{prefix}median_ms"] = t.median_ms
        out[f"{prefix}min_ms"] = min(t.samples_ms) if t.samples_ms else None
        out[f"{prefix}max_ms"] = max(t.samples_ms) if t.samples_ms else None
    return out


class _Suite:
    mode = ""
    params = (SHAPES, PROVIDERS)
    param_names = ("shape", "provider")
    timeout = 600

    def setup_cache(self):
        saved = os.environ.get("RMSNORM_BENCH_RESULTS")
        if saved:  # a run of the harness made just before, for this commit: record it, measure nothing
            run = results.load(saved)
        elif not torch.cuda.is_available():
            return {"skip": timing.cuda_message()}
        else:
            run = harness.run_benchmarks(
                harness.select_cases(["all"]), providers.available_providers(), harness.MODES, progress=False
            )
        # asv tracks the median and the spread of the samples; the cache keeps those, not the samples
        rows = {key: _tracked(row) for key, row in run.index().items()}
        return {"rows": rows, "copy_tbs": run.copy.tbs, "machine": dict(run.machine)}

    setup_cache.timeout = 3600

    def setup(self, cache, shape, provider):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        row = cache["rows"].get((provider, shape, self.mode))
        if row is None:
            raise NotImplementedError(f"{provider} is not importable here")
        if row["status"] != "ok":
            raise NotImplementedError(f"{provider} failed at {shape} {self.mode}: {row['error']}")
        self.row = row

    def track_median_ms(self, cache, shape, provider):
        """Whole call, host and GPU: the median of the harness's samples."""
        return self.row["median_ms"]

    track_median_ms.unit = "ms"

    def track_min_ms(self, cache, shape, provider):
        """The fastest whole-call sample of the same run (with track_max_ms: the spread)."""
        return self.row["min_ms"]

    track_min_ms.unit = "ms"

    def track_max_ms(self, cache, shape, provider):
        """The slowest whole-call sample of the same run."""
        return self.row["max_ms"]

    track_max_ms.unit = "ms"

    def track_gpu_median_ms(self, cache, shape, provider):
        """GPU time alone: CUDA-graph replays, no host work per call (None: not capturable)."""
        return self.row["device_median_ms"]

    track_gpu_median_ms.unit = "ms"

    def track_gpu_min_ms(self, cache, shape, provider):
        return self.row["device_min_ms"]

    track_gpu_min_ms.unit = "ms"

    def track_gpu_max_ms(self, cache, shape, provider):
        return self.row["device_max_ms"]

    track_gpu_max_ms.unit = "ms"

    def track_host_median_ms(self, cache, shape, provider):
        """Host time alone: the host clock around the whole calls (None: a run from before it)."""
        return self.row["host_median_ms"]

    track_host_median_ms.unit = "ms"


class Forward(_Suite):
    mode = "forward"

    def track_error_y(self, cache, shape, provider):
        """Relative L2 error of y against the float64 oracle."""
        return self.row["errors"]["y"]

    track_error_y.unit = "relative L2 error"


class ForwardBackward(_Suite):
    mode = "forward_backward"

    def track_error_dx(self, cache, shape, provider):
        """Relative L2 error of dx against the float64 oracle."""
        return self.row["errors"]["dx"]

    track_error_dx.unit = "relative L2 error"

    def track_error_dw(self, cache, shape, provider):
        """Relative L2 error of dw against the float64 oracle."""
        return self.row["errors"]["dw"]

    track_error_dw.unit = "relative L2 error"
