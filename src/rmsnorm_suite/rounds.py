"""One side's rounds of pr-verdict merged into one run, as the gate judges it.

Each round of a side is a run of its own (its samples, its medians, its errors); the gate wants
one run per side whose rows hold every sample, one median per round (the gate's independent
units, paired with the other side's by round index), and the worst error seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from rmsnorm_suite import results


def merge_rounds(
    runs: Sequence[results.Run | Mapping[str, Any]], label: str, commit: str | None
) -> results.Run:
    """One run from several rounds of one side: samples concatenated, one median per round (whole
    call, device and host: the gate's units), the largest error seen, failed when any round failed."""
    if not runs:
        raise ValueError(f"no rounds to merge for {label}")
    runs = [results.as_run(run) for run in runs]
    merged: dict[results.Key, _Merged] = {}
    for k, run in enumerate(runs):
        k = run.round if run.round is not None else k
        for row in run.results:
            into = merged.setdefault(row.key, _Merged(row))
            if not row.ok:
                if into.error is None:
                    into.error = f"round {k}: {row.error}"
                continue
            into.samples.extend(row.whole.samples_ms)
            into.medians.append(median(row.whole.samples_ms))
            if row.host.samples_ms:
                into.host_samples.extend(row.host.samples_ms)
                into.host_medians.append(median(row.host.samples_ms))
            if row.device_error or not row.device.samples_ms:
                into.device_error = (
                    into.device_error or f"round {k}: {row.device_error or 'no device samples'}"
                )
            else:
                into.device_samples.extend(row.device.samples_ms)
                into.device_medians.append(median(row.device.samples_ms))
            for q, v in row.errors.items():
                into.errors[q] = max(v, into.errors.get(q, v))
    copies = [run.copy.tbs for run in runs if run.copy.tbs is not None]
    copy_tbs = median(copies) if copies else None
    first = runs[0]
    rounds = [run.round if run.round is not None else k for k, run in enumerate(runs)]
    return results.Run(
        tuple(m.row(copy_tbs) for m in merged.values()),
        label=label,
        created=first.created,
        machine=first.machine,
        git=results.Git(commit, False),
        # round_indices: the rounds merged, in order; the gate pairs two runs' rounds by them
        settings={**first.settings, "rounds": len(runs), "round_indices": rounds},
        copy=results.CopyCeiling(tbs=copy_tbs, rounds_tbs=tuple(copies)),
        features=merge_features(runs),
    )


def merge_features(runs: Sequence[results.Run]) -> dict[str, results.Feature]:
    """Per feature figure over the rounds: failed if any round failed, else the largest value and
    the cases every round measured; unsupported only where no round measured it. A round without
    the figure voids it (failed), and so does a round that reports it unsupported while another
    measured it (an op that drops an option in some rounds): the note names those rounds."""
    keys = list(dict.fromkeys(k for run in runs for k in run.features))
    out: dict[str, results.Feature] = {}
    for key in keys:
        seen = [run.features.get(key) for run in runs]
        failed = [f for f in seen if f is None or f.status == "failed"]
        values = [f.value for f in seen if f is not None and f.status == "ok"]
        dropped = [_round_name(run, i) for i, (run, f) in enumerate(zip(runs, seen))
                   if f is not None and f.status == "unsupported"]  # fmt: skip
        if failed:
            note = "a round did not report it" if failed[0] is None else failed[0].note
            out[key] = results.Feature("failed", note=note)
        elif values and dropped:
            note = f"unsupported in round(s) {', '.join(dropped)}, measured in others"[:300]
            out[key] = results.Feature("failed", note=note)
        elif values:
            nan = [v for v in values if v != v]
            measured = [set(f.cases) for f in seen if f.status == "ok"]
            first = next(f for f in seen if f.status == "ok")
            cases = tuple(c for c in first.cases if all(c in m for m in measured))
            note = next((f.note for f in seen if f.note), None)
            out[key] = results.Feature("ok", nan[0] if nan else max(values), note, cases)
        else:
            out[key] = results.Feature("unsupported", note=seen[0].note)
    return out


def _round_name(run: results.Run, index: int) -> str:
    return str(run.round) if run.round is not None else f"#{index + 1}"


@dataclass
class _Merged:
    """One (provider, shape, mode) while its rounds are merged: the first round's row, and what
    the rounds add to it."""

    first: results.Row
    error: str | None = None  # the first failed round's
    samples: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    device_samples: list[float] = field(default_factory=list)
    device_medians: list[float] = field(default_factory=list)
    device_error: str | None = None
    host_samples: list[float] = field(default_factory=list)
    host_medians: list[float] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)

    def row(self, copy_tbs: float | None) -> results.Row:
        ok, nbytes = self.error is None, self.first.bytes
        return dataclasses.replace(
            self.first,
            status="ok" if ok else "failed",
            error=self.error,
            errors=self.errors,
            whole=results.timing(self.samples, self.medians, nbytes, copy_tbs, summarise=ok),
            device=results.timing(self.device_samples, self.device_medians, nbytes, copy_tbs, summarise=ok),
            device_error=self.device_error,
            # rounds pair by position: a round without host samples voids the others'
            host=(
                results.timing(self.host_samples, self.host_medians, None, None, summarise=ok)
                if len(self.host_medians) == len(self.medians)
                else results.Timing()
            ),
        )
