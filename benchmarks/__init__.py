"""asv benchmarks of rmsnorm-kernel (see bench_rmsnorm.py and docs/gate.md)."""
