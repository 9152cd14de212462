"""Maintainer tools, run from a checkout (``nox``) and never installed with the rmsnorm-kernel
wheel, which packages ``src/`` only. The shipped packages (rmsnorm_kernel, rmsnorm_suite) import
nothing of this one (tests/ci/test_architecture.py).
"""
