"""Fixtures the suite's test modules share (their plain helpers: tests/suite/_fixtures.py)."""

from __future__ import annotations

import pytest

from rmsnorm_suite import pullrequest
from tests.suite._fixtures import BaseRounds


@pytest.fixture
def host_timing(monkeypatch, tmp_path):
    """Workers time on the CPU with the host clock; the hostile files' marker path."""
    monkeypatch.setattr(pullrequest, "WORKER_TIMING", "host")
    marker = tmp_path / "hostile-code-ran"
    monkeypatch.setenv("RMSNORM_TEST_MARKER", str(marker))
    return marker


@pytest.fixture(scope="session")
def base_rounds():
    return BaseRounds()


@pytest.fixture
def shared_base(base_rounds, monkeypatch):
    """The base's rounds shared with the other verdicts over the same base (BaseRounds)."""
    base_rounds.install(monkeypatch)
    return base_rounds
