"""pytest-benchmark comparisons (GPU); see test_rmsnorm_benchmarks.py and docs/gate.md."""
