"""The judge's GPU telemetry: NVML readings per round (a stand-in NVML here), what makes a round
noisy, and pr-verdict redoing noisy rounds within its bound, then erring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from rmsnorm_suite import pullrequest, sandbox, telemetry
from rmsnorm_suite.thresholds import load_thresholds
from tests.suite._fixtures import git


class FakeNVML:
    """The calls of pynvml the sampler makes, with readings the test sets."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0

    def __init__(self, reasons=0, pids=()):
        self.reasons, self.pids = reasons, list(pids)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetTemperature(self, handle, kind):
        return 41

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.reasons

    def nvmlDeviceGetComputeProcesses(self, handle):
        return [SimpleNamespace(pid=p) for p in self.pids]


def test_a_clean_round_is_not_noisy():
    sampler = telemetry.Sampler(FakeNVML(reasons=telemetry.POWER_CAP), index=0)
    sampler.read(os.getpid())
    summary = sampler.round.summary()
    assert summary["noisy"] is None and summary["power_capped"] and summary["sm_mhz"] == [1980, 1980, 1980]


def test_a_slowdown_or_a_foreign_process_makes_a_round_noisy():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        # the round's own process (a child of the round's root) is not foreign; another is
        sampler = telemetry.Sampler(FakeNVML(reasons=0x40, pids=[child.pid, other.pid, 2**22 + 7]), index=0)
        sampler.read(child.pid)
        noisy = sampler.round.noisy()
        assert sampler.round.unresolved == {2**22 + 7}  # a pid of another namespace: not judged
        assert "hw_thermal" in noisy and f"pids [{other.pid}]" in noisy
        assert telemetry.descends_from(child.pid, os.getpid()) and not telemetry.descends_from(
            other.pid, child.pid
        )
    finally:
        for proc in (child, other):
            proc.kill()
            proc.wait()


def test_a_reading_nvml_lacks_is_reported_not_held_against_the_round():
    """An older NVML names the reasons call differently; a GPU may not give a reading at all."""
    lib = FakeNVML(reasons=0x8)
    lib.nvmlDeviceGetCurrentClocksThrottleReasons = lib.nvmlDeviceGetCurrentClocksEventReasons
    del FakeNVML.nvmlDeviceGetCurrentClocksEventReasons  # restored below
    try:
        lib.nvmlDeviceGetTemperature = lambda *a: (_ for _ in ()).throw(RuntimeError("not supported"))
        sampler = telemetry.Sampler(lib, index=0)
        sampler.start(os.getpid())
        summary = sampler.stop().summary()
    finally:
        FakeNVML.nvmlDeviceGetCurrentClocksEventReasons = lambda self, handle: self.reasons
    assert summary["missing"] == ["nvmlDeviceGetTemperature: RuntimeError"] and summary["temp_c_max"] is None
    assert summary["slowdowns"] == ["hw_slowdown"] and summary["sm_mhz"][0] == 1980  # the older name read


class NoisyFirst:
    """A sampler whose first ``noisy`` rounds were throttled (or the attempts numbered ``at``)."""

    def __init__(self, noisy, at=()):
        self.left, self.round, self.at, self.count = noisy, telemetry.Round(), set(at), 0

    def start(self, pid):
        noisy = self.left > 0 or self.count in self.at
        self.round = telemetry.Round(sm_mhz=[1980], reasons=0x8 if noisy else 0)
        self.left, self.count = self.left - 1, self.count + 1

    def stop(self):
        return self.round


@pytest.mark.skipif(bool(sandbox.check()), reason=f"no sandbox here: {sandbox.check()}")
@pytest.mark.parametrize(
    "noisy, at, status, redone",
    # (1, (2,)): round 0's first side, then its second side after the first's redo
    [(1, (2,), "pass", 2), (5, (), "error", 2)],
)
def test_noisy_rounds_are_redone_within_the_bound(tmp_path, monkeypatch, noisy, at, status, redone):
    """Noisy rounds are redone with new stopwatch seeds, within the bound; a noisy second side redoes
    its whole round, in order, so both sides of every round run on the same seeds."""
    repo = tmp_path / "repo"
    (repo / "src" / "rmsnorm_kernel").mkdir(parents=True)
    (repo / "src" / "rmsnorm_suite").mkdir()
    (repo / "src" / "rmsnorm_suite" / "__init__.py").write_text("")
    (repo / "src" / "rmsnorm_kernel" / "__init__.py").write_text(
        "def rms_norm(x, weight=None, eps=1e-6):\n    y = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()\n"
        "    return y * weight if weight is not None else y\n"
    )
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "op")
    sha = git(repo, "rev-parse", "HEAD")
    thresholds = tmp_path / "th.toml"
    thresholds.write_text(
        "[gate]\nmin_samples = 2\n[clock]\ntolerance = 0.5\ncheckpoint = 50.0\n[stopwatch]\ntolerance = 3.0\nconsistency = 0.95\nshare = 0.0\nsingle = 0.95\nany_round = 3.0\n[telemetry]\nredo = 2\n[features]\nbatch_invariance = 0\n"
        "[latency.large.forward]\nfactor = 100.0\nalpha = 0.01\n"
        "[numerics.bfloat16]\ngrowth = 1.05\nceiling = {y = 0.01}\n"
    )
    monkeypatch.setattr(pullrequest, "WORKER_TIMING", "host")
    monkeypatch.setattr(pullrequest, "_sampler", lambda: (NoisyFirst(noisy, at), None))
    out = tmp_path / "v"
    argv = ["--repo", str(repo), "--base", sha, "--head", sha, "--out", str(out), "--thresholds", str(thresholds),
            "--shapes", "32768x4096-bfloat16", "--modes", "forward", "--rounds", "3", "--samples", "4",
            "--skip-gpu-tests"]  # fmt: skip
    from rmsnorm_suite import cli

    attempts = []  # (side, round, the stopwatch's seeds) of every attempt
    real = pullrequest.run_round

    def spy(box, spec, *args):
        attempts.append((spec["label"], spec["round"], tuple(args[-1])))
        return real(box, spec, *args)

    monkeypatch.setattr(pullrequest, "run_round", spy)
    cli.main(["pr-verdict", *argv])
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == status, data["summary"]
    assert data["pr"]["rounds_redone"] == redone
    # a redo draws new stopwatch seeds: a side never meets go seeds it has seen
    for side in ("base", "head"):
        mine = [seeds for label, _, seeds in attempts if label == side]
        assert len(set(mine)) == len(mine), attempts
    if status == "error":
        assert "noisy: clocks held down (hw_slowdown)" in data["summary"]
    else:  # every round's sides ran on the same seeds: the stopwatch pairs all three
        last = {(label, k): seeds for label, k, seeds in attempts}
        assert all(last["base", k] == last["head", k] for k in range(3)), attempts
        watch = next(r for r in data["rows"] if r["check"] == "stopwatch")
        assert "over 3 rounds" in watch["note"], watch
    if at:  # the first side redone alone; a noisy second side: the whole round again, in order
        order = [(label, k) for label, k, _ in attempts][:5]
        assert order == [("base", 0), ("base", 0), ("head", 0), ("base", 0), ("head", 0)], attempts
        assert attempts[0][2] != attempts[1][2] == attempts[2][2] != attempts[3][2] == attempts[4][2]
    assert len(data["telemetry"]) == 6 and all(v["samples"] == 1 for v in data["telemetry"].values())
    assert load_thresholds(thresholds).telemetry_redo == 2
