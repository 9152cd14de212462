"""What the GPU did during each pr-verdict round, read by the judge through NVML (nvidia-ml-py),
outside the sandbox, so no commit's code can touch it.

A :class:`Sampler` polls the device every ``PERIOD_S`` while a round runs: SM and memory clocks,
temperature, power, the clock-event (throttle) reasons, and the processes holding the GPU. A
round is *noisy* when a slowdown reason in ``SLOWDOWNS`` was set, or when a process outside the
round's own process tree used the GPU (a pid this process cannot see, as in a container whose
NVML reports the host's pids, is reported, not judged); pr-verdict redoes such a round (``[telemetry] redo`` in
regression.toml bounds how many) and otherwise says so in the verdict.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PERIOD_S = 0.05
# nvmlClocksEventReason* bits that mean the clocks were held down by heat, power brakes or the
# hardware (not the power cap an ordinary load meets, nor idle or application settings)
SLOWDOWNS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
POWER_CAP = 0x4
REASONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")


def nvml() -> Any:
    """The pynvml module, initialised; ImportError or RuntimeError (one line) when it cannot be."""
    try:
        import pynvml
    except ImportError as exc:
        raise ImportError("no NVML: the GPU's clocks cannot be read (pip install nvidia-ml-py)") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML did not start: {exc}") from None
    return pynvml


def device_index() -> int:
    """NVML's index of the device CUDA calls 0 (CUDA_VISIBLE_DEVICES' first entry when numeric)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def descends_from(pid: int, root: int) -> bool:
    """True when ``pid`` is ``root`` or one of its descendants (parent links in /proc)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        seen += 1
    return pid == root


@dataclass
class Round:
    """One round's readings."""

    sm_mhz: list[int] = field(default_factory=list)
    mem_mhz: list[int] = field(default_factory=list)
    temp_c: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    reasons: int = 0
    foreign: set[int] = field(default_factory=set)
    error: str | None = None  # a reading that failed in an unexpected way: reported, not judged
    missing: set[str] = field(default_factory=set)  # readings this NVML or GPU does not give
    unresolved: set[int] = field(default_factory=set)  # GPU processes whose pid is not ours to see

    def noisy(self) -> str | None:
        """Why the round cannot be trusted (a slowdown, a foreign process), or None. Readings
        that could not be taken are reported in :meth:`summary`, not held against the round."""
        slow = [name for bit, name in SLOWDOWNS.items() if self.reasons & bit]
        why = []
        if slow:
            why.append(f"clocks held down ({', '.join(slow)})")
        if self.foreign:
            why.append(f"other processes on the GPU (pids {sorted(self.foreign)[:5]})")
        return "; ".join(why) or None

    def summary(self) -> dict[str, Any]:
        def span(values):
            return [min(values), statistics.median(values), max(values)] if values else None

        return {
            "samples": len(self.sm_mhz),
            "sm_mhz": span(self.sm_mhz),
            "mem_mhz": span(self.mem_mhz),
            "temp_c_max": max(self.temp_c) if self.temp_c else None,
            "power_w_max": round(max(self.power_w), 1) if self.power_w else None,
            "slowdowns": [name for bit, name in SLOWDOWNS.items() if self.reasons & bit],
            "power_capped": bool(self.reasons & POWER_CAP),
            "foreign_pids": sorted(self.foreign),
            "unresolved_pids": sorted(self.unresolved),
            "missing": sorted(self.missing),
            "error": self.error,
            "noisy": self.noisy(),
        }


class Sampler:
    """Polls NVML in a thread between :meth:`start` (with the round's root pid) and :meth:`stop`."""

    def __init__(
        self, lib: Any = None, index: int | None = None, owner: Callable[[int, int], bool] = descends_from
    ):
        self.lib = lib if lib is not None else nvml()
        self.handle = self.lib.nvmlDeviceGetHandleByIndex(device_index() if index is None else index)
        self.owner = owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.round = Round()

    def start(self, root_pid: int) -> None:
        self.round, self._stop = Round(), threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(root_pid,), daemon=True)
        self._thread.start()

    def stop(self) -> Round:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.round

    def _call(self, name: str, *args: Any) -> Any:
        """One NVML reading; None (and the name kept in ``missing``) where this NVML or this GPU
        lacks it: a missing reading is reported, it does not make a round noisy."""
        fn = getattr(self.lib, name, None)
        if fn is None:
            self.round.missing.add(name)
            return None
        try:
            return fn(self.handle, *args)
        except Exception as exc:  # NVMLError_NotSupported and kin
            self.round.missing.add(f"{name}: {type(exc).__name__}")
            return None

    def read(self, root_pid: int) -> None:
        lib, r = self.lib, self.round
        for values, value in (
            (r.sm_mhz, self._call("nvmlDeviceGetClockInfo", getattr(lib, "NVML_CLOCK_SM", 1))),
            (r.mem_mhz, self._call("nvmlDeviceGetClockInfo", getattr(lib, "NVML_CLOCK_MEM", 2))),
            (r.temp_c, self._call("nvmlDeviceGetTemperature", getattr(lib, "NVML_TEMPERATURE_GPU", 0))),
            (r.power_w, self._call("nvmlDeviceGetPowerUsage")),
        ):
            if value is not None:
                values.append(value / 1000.0 if values is r.power_w else value)
        # the reasons' newer name, then the older one
        name = next((n for n in REASONS if hasattr(lib, n)), REASONS[0])
        reasons = self._call(name)
        if reasons is not None:
            r.reasons |= int(reasons)
        for proc in self._call("nvmlDeviceGetComputeProcesses") or ():
            if not Path(f"/proc/{proc.pid}").exists():  # another PID namespace (a container's host)
                r.unresolved.add(proc.pid)
            elif proc.pid != os.getpid() and not self.owner(proc.pid, root_pid):
                r.foreign.add(proc.pid)

    def _poll(self, root_pid: int) -> None:
        while not self._stop.is_set():
            try:
                self.read(root_pid)
            except Exception as exc:  # reported with the readings; the round is judged on the rest
                self.round.error = f"{type(exc).__name__}: {exc}"[:200]
                return
            self._stop.wait(PERIOD_S)
