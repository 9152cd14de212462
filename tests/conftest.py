"""Shared markers for the suite: where a test can run, and why it skips elsewhere."""

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from rmsnorm_kernel import host

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


@pytest.fixture(scope="module")
def built_extension():
    """The compiled host path's extension, built here or loaded from the build cache (CPU machines
    too: the GPU is only needed to launch), for tests of what it registers and decides; host's
    state is restored, so other tests keep the path they had. Skips where it cannot build."""
    if INTERPRET:
        pytest.skip("built once by the CPU tests; the interpreter never uses it")
    return _extension_here()


@pytest.fixture(scope="module")
def interpreted_extension():
    """The extension under TRITON_INTERPRET=1, for its operators called directly on CPU tensors:
    their C++ autograd runs, and every forward and backward they ask for runs the Python path
    (the interpreter's launches are never planned). rms_norm itself never takes it on CPU."""
    if not INTERPRET:
        pytest.skip("calls the operators on CPU tensors: needs TRITON_INTERPRET=1 (nox -s interpret)")
    return _extension_here()


def _extension_here():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: the extension cannot build")
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        pytest.skip("no Python headers here: the extension cannot build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(host.ENV, "compiled")
        patch.setattr(host, "_extension", host._UNSET)
        patch.setattr(host, "entry", host.entry)
        return host.extension()


# Reports a test hands to the end of the run (the mutant catalogue's table): printed by
# pytest_terminal_summary after the results, not among the progress dots. They travel on the test's
# report, so a pytest-xdist worker's reports reach the terminal too. Without -v only each report's
# first paragraph is shown (one summary line in CI's log); the file named in the title has the rest.
TERMINAL_REPORTS: list[tuple[str, str]] = []
_REPORTED: list[tuple[str, str]] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and TERMINAL_REPORTS:
        report.user_properties.extend(("terminal report", entry) for entry in TERMINAL_REPORTS)
        TERMINAL_REPORTS.clear()
    return report


def pytest_runtest_logreport(report):
    _REPORTED.extend(tuple(value) for key, value in report.user_properties if key == "terminal report")


# GPU tests this run left out (deselected by -m, or skipped for want of CUDA), counted where
# they are collected (each pytest-xdist worker hands its count back) and said in one line.
_GPU_LEFT_OUT: dict[str, set[str]] = {"deselected": set(), "skipped": set()}


def pytest_deselected(items):
    _GPU_LEFT_OUT["deselected"].update(i.nodeid for i in items if i.get_closest_marker("gpu"))


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        _GPU_LEFT_OUT["skipped"].update(i.nodeid for i in items if i.get_closest_marker("gpu"))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker
        session.config.workeroutput["gpu_left_out"] = {k: sorted(v) for k, v in _GPU_LEFT_OUT.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for kind, ids in getattr(node, "workeroutput", {}).get("gpu_left_out", {}).items():
        _GPU_LEFT_OUT[kind].update(ids)


def pytest_terminal_summary(terminalreporter, config):
    left_out = _GPU_LEFT_OUT["deselected"] | _GPU_LEFT_OUT["skipped"]
    if left_out:
        terminalreporter.write_line(
            f"{len(left_out)} GPU tests left out here ({len(_GPU_LEFT_OUT['deselected'])} deselected, "
            f"{len(_GPU_LEFT_OUT['skipped'] - _GPU_LEFT_OUT['deselected'])} without CUDA): "
            "`nox -s gpu` on a CUDA machine runs them (`-m multigpu`: `nox -s gpu-distributed`, 2+ GPUs)"
        )
    for title, text in _REPORTED:
        terminalreporter.write_sep("=", title)
        if config.get_verbosity() > 0:
            terminalreporter.write_line(text)
            continue
        paragraphs = [p for p in text.strip().split("\n\n") if not p.startswith("#")]
        terminalreporter.write_line(paragraphs[0] if paragraphs else text.strip().splitlines()[0])
