"""Shared markers for the suite: where a test can run, and why it skips elsewhere."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

requires_interpret = pytest.mark.skipif(
    not INTERPRET, reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1 (nox -s interpret)"
)
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (nox -s gpu)")

# Parametrize a numeric test over the devices that run the real kernels.
KERNEL_DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.interpret, requires_interpret], id="interpret"),
    pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda], id="cuda"),
]

# Reports a test hands to the end of the run (the mutant catalogue's table): printed by
# pytest_terminal_summary after the results, not among the progress dots.
TERMINAL_REPORTS: list[tuple[str, str]] = []


def pytest_terminal_summary(terminalreporter):
    for title, text in TERMINAL_REPORTS:
        terminalreporter.write_sep("=", title)
        terminalreporter.write_line(text)
