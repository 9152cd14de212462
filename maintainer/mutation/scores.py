"""A file's score: mutants killed over the non-equivalent ones run, with its Wilson interval
(the mutants are a sample) and the floor it may not drop below.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

CONFIDENCE = 0.95


def wilson_interval(killed: int, total: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of the proportion killed/total (0..1); (0, 1) when total is 0."""
    if not 0 <= killed <= total:
        raise ValueError(f"killed must be in 0..total, got {killed} of {total}")
    if total == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = killed / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass
class Score:
    target: str
    file: str
    floor: float
    population: int  # mutants of the configured operators this device can run
    planned: int  # in the session (the sample)
    run: int = 0
    killed: int = 0
    equivalent: int = 0  # survivors argued equivalent (maintainer/mutation/equivalent.toml)
    incompetent: int = 0  # did not compile (Triton): neither killed nor survived, not counted

    @property
    def non_equivalent(self) -> int:
        return self.run - self.equivalent

    @property
    def percent(self) -> float | None:
        return 100.0 * self.killed / self.non_equivalent if self.non_equivalent else None

    @property
    def interval(self) -> tuple[float, float]:
        lo, hi = wilson_interval(self.killed, self.non_equivalent)
        return 100 * lo, 100 * hi

    @property
    def below_floor(self) -> bool:
        return self.percent is not None and self.percent < self.floor


def floor_failures(scores: list[Score]) -> list[str]:
    return [
        f"{s.file}: {s.percent:.1f}% killed, below its floor of {s.floor:g}%" for s in scores if s.below_floor
    ]
