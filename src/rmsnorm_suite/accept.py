"""Accepting one expected regression without bypassing the gate.

A pull request declares a row it makes slower in a commit trailer of the judged range
(``Accept-Regression: device 32768x4096-bfloat16 forward 1.08 why``). The trusted judge reads the
trailers from git's objects and grants one only when a maintainer approved it
(``--accept-approved-by``) and it fits ``[accept]`` of the trusted regression.toml. A granted row
is judged against the accepted factor and reads ``accepted``, never ``pass``; numerics cannot be
accepted. docs/gate.md ("Accepting one expected regression") gives the rules in full.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

TRAILER = "Accept-Regression"
LINE = re.compile(rf"^{TRAILER}\s*:\s*(.*)$", re.IGNORECASE | re.MULTILINE)  # a continuation line is not one
KINDS = ("device", "latency", "host")  # thresholds.CHECK_PREFIXES' values
SHAPE = re.compile(r"[0-9]{1,7}x[0-9]{1,7}-[a-z0-9]{1,16}")
MODES = ("forward", "forward_backward")
MAX_REQUESTS = 32  # trailers read per verdict; the rest are refused unread
MAX_REASON = 200


@dataclass(frozen=True)
class Request:
    """One Accept-Regression line: ``check`` (``kind shape mode``), ``factor``, ``reason``; where it
    came from; who approved it (set by the judge's caller only); ``problem``: why it cannot be read."""

    check: str
    factor: float
    reason: str
    commit: str | None = None
    approved_by: str | None = None
    problem: str | None = None


def parse(value: str, commit: str | None = None) -> Request:
    """A trailer's value (``kind shape mode factor reason``) as a Request; a malformed one keeps its
    text in ``check`` and says why in ``problem``."""
    text = value.strip()[:400]
    parts = text.split(maxsplit=4)
    if len(parts) < 5:
        return Request(text, math.nan, "", commit, problem="expected: KIND SHAPE MODE FACTOR REASON")
    kind, shape, mode, factor_text, reason = parts
    check = f"{kind} {shape} {mode}"
    if kind not in KINDS or not SHAPE.fullmatch(shape) or mode not in MODES:
        return Request(
            check, math.nan, reason[:MAX_REASON], commit, problem=f"not a latency check: {check!r}"
        )
    try:
        factor = float(factor_text)
    except ValueError:
        factor = math.nan
    if not math.isfinite(factor):
        return Request(
            check, math.nan, reason[:MAX_REASON], commit, problem=f"factor {factor_text!r} is not a number"
        )
    return Request(check, factor, reason[:MAX_REASON], commit)


TRAILER_LINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*\s*:\s|^\s+\S")  # "Key: value", or a continuation


def from_message(message: str, commit: str | None = None) -> list[Request]:
    """The Accept-Regression trailers of one commit message: lines of its last paragraph, when
    every line of that paragraph is a trailer (as git reads trailers); quoted text elsewhere in
    the message is not a request."""
    paragraphs = [p for p in message.strip().split("\n\n") if p.strip()]
    if len(paragraphs) < 2:
        return []
    last = paragraphs[-1].strip("\n").splitlines()
    if not all(TRAILER_LINE.match(line) for line in last):
        return []
    return [parse(m.group(1), commit) for m in LINE.finditer("\n".join(last))]


def from_git(repo: str | Path, base: str, head: str) -> list[Request]:
    """The requests in the messages of ``base..head`` (git's objects only), oldest first."""
    out = subprocess.run(
        ["git", "log", "--reverse", "--format=%H%x1f%B%x1e", f"{base}..{head}", "--"],
        cwd=repo,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout.decode("utf-8", "replace")
    requests: list[Request] = []
    for record in out.split("\x1e"):
        if "\x1f" in record:
            sha, message = record.split("\x1f", 1)
            requests += from_message(message, sha.strip())
    return requests


def approve(requests: Iterable[Request], by: str | None) -> list[Request]:
    """The requests as approved by ``by`` (the judge's caller's word; None or "": not approved)."""
    who = (by or "").strip()[:100] or None
    return [replace(r, approved_by=who) for r in requests]


def limit_refusal(check: str, factor: float, limits: Any) -> str | None:
    """Why ``[accept]`` (``limits``, thresholds.AcceptLimits) refuses one row on its own: no row
    allowed, a kind it does not list, a factor outside (1, max_factor]; None where it allows it."""
    kind = check.split(" ", 1)[0]
    if limits.max_rows == 0:
        return "regression.toml [accept] allows no accepted row"
    if kind not in limits.kinds:
        return f"[accept] kinds {list(limits.kinds)} do not include {kind!r}"
    if not 1.0 < factor <= limits.max_factor:
        return f"factor {factor:g} not in (1, {limits.max_factor:g}] ([accept] max_factor)"
    return None


def grant(
    requests: Sequence[Request], limits: Any, checks: Iterable[str]
) -> tuple[dict[str, Request], dict[str, Any]]:
    """Which requests hold (by check name) under ``limits`` (thresholds.AcceptLimits) for a verdict whose
    latency rows are ``checks``, and the record the verdict keeps: every request, granted or
    refused with why. In order: the first ``max_rows`` valid requests are granted."""
    if not requests:
        return {}, {}
    known = set(checks)
    granted: dict[str, Request] = {}
    refused: list[dict[str, Any]] = []
    for i, r in enumerate(requests):
        why = None
        if i >= MAX_REQUESTS:
            why = f"more than {MAX_REQUESTS} requests"
        elif r.problem:
            why = r.problem
        elif not r.approved_by:
            why = "no maintainer approval"
        elif why := limit_refusal(r.check, r.factor, limits):
            pass
        elif r.check not in known:
            why = "names no latency row of this verdict"
        elif r.check in granted:
            why = "the row was already accepted by an earlier line"
        elif len(granted) >= limits.max_rows:
            why = f"more than [accept] max_rows = {limits.max_rows} rows"
        if why:
            refused.append({**_record(r), "why": why})
        else:
            granted[r.check] = r
    record = {
        "requested": [_record(r) for r in requests[:MAX_REQUESTS]],
        "granted": [_record(r) for r in granted.values()],
        "refused": refused,
        "limits": {"max_rows": limits.max_rows, "max_factor": limits.max_factor, "kinds": list(limits.kinds)},
    }
    return granted, record


def _record(r: Request) -> dict[str, Any]:
    d = asdict(r)
    d["factor"] = r.factor if math.isfinite(r.factor) else None  # JSON has no NaN
    return {k: v for k, v in d.items() if v is not None}


def summary(acceptance: Mapping[str, Any], rows: Sequence[Any]) -> str:
    """What the verdict's summary adds: rows accepted, requests granted and refused."""
    accepted = [r.check for r in rows if r.verdict == "accepted"]
    granted, refused = acceptance.get("granted", []), acceptance.get("refused", [])
    text = f" [Accept-Regression: {len(granted)} granted"
    if granted:
        text += " (" + ", ".join(f"{g['check']} <= {g['factor']:g}" for g in granted[:4]) + ")"
    text += f", {len(accepted)} row(s) accepted"
    if refused:
        text += f", {len(refused)} refused: " + "; ".join(f"{x['check']}: {x['why']}" for x in refused[:3])
    return text + "]"
