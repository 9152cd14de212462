"""The guard's reach: every module of the suite that the worker has loaded when the op is
imported is one whose names the guard holds (guard.TRUSTED)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rmsnorm_suite import guard

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_guard_holds_every_suite_module_the_worker_loads():
    """As the sandbox's bootstrap does (``python -I``, the suite first on the path): import the
    worker, build its guard, list the suite's modules then loaded. One that TRUSTED does not name
    (bench.py, were the worker to import it again) could be patched by the op unseen."""
    code = (
        f"import sys; sys.path[:0] = [{str(SRC)!r}]; import json, rmsnorm_suite.worker as w; "
        "w.guard.Guard(); print(json.dumps(sorted(m for m in sys.modules if m.startswith('rmsnorm_suite.'))))"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "rmsnorm_suite.worker" in loaded and "rmsnorm_suite.harness" in loaded, loaded
    assert sorted(set(loaded) - set(guard.TRUSTED)) == []
