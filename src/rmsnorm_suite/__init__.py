"""rmsnorm_suite: the regression suite of rmsnorm-kernel (case table, checks, benchmarks, gate, verdict,
walkthrough and training commands). The op itself is the ``rmsnorm_kernel`` package, which imports nothing
from here."""
