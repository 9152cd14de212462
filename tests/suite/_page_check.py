"""The asv page's data check, shared by the page test and the tests of `nox -s history`.

Standard library only (no torch): the offline rehearsal runs the page test in a Python without
the suite's dependencies (docs/ci.md, "The offline rehearsal")."""

from __future__ import annotations

from pathlib import Path

from rmsnorm_suite.history import blank_graphs


def assert_every_graph_has_data(html: Path) -> None:
    """The page at ``html`` has graphs, and each has a data point (a graph whose every recorded
    value is null draws empty axes, which the rendering checks would pass)."""
    graphs = list((html / "graphs").rglob("*.json"))
    assert graphs, "the published page has no graphs"
    blank = blank_graphs(html)
    assert not blank, f"{len(blank)} of {len(graphs)} graphs have no data point: {blank[:5]}"
