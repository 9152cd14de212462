"""Hostile heads against the inference features' rows (host stand-in, CPU).

Each head's op breaks a property its row reports, or crashes in the check, and adds an attack that
needs no clock and nothing the guard holds. The row must not read `pass`. The control head (the
same op, no attack) shows the row does catch the op when left alone.

The base op has a residual; each head's op (unless said) is batch dependent in a way the gate's
other rows cannot see: batches of 257 rows or more take a "many-row plan" that accumulates the
mean square in float64, a few last bits apart from the float32 plan of smaller batches.
"""

from __future__ import annotations

import pytest

from rmsnorm_suite import guard
from tests.suite._fixtures import INIT, MANY_ROW_PLAN, OPS_RESIDUAL, attack_heads_repo, feature_rows
from tests.suite.hostile_catalogue import FEATURE_ATTACKS as ATTACKS


@pytest.fixture(scope="module")
def attack_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("prv-feature-attacks") / "repo"
    return attack_heads_repo(repo, INIT, OPS_RESIDUAL, MANY_ROW_PLAN, ATTACKS)


def test_control_many_row_plan_is_flagged(attack_repo, host_timing, shared_base, tmp_path):
    repo, base, heads = attack_repo
    data, rows = feature_rows(repo, base, heads["control"], tmp_path / "verdict")
    assert rows["batch invariance"]["verdict"] == "regression", rows["batch invariance"]
    # the batch dependence is the only thing wrong with the op
    others = [
        r
        for r in data["rows"]
        if r["verdict"] not in ("pass", "unsupported") and r["check"] != "batch invariance"
    ]
    assert not others, others


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_feature_attack_does_not_pass(attack_repo, host_timing, shared_base, tmp_path, attack):
    repo, base, heads = attack_repo
    data, rows = feature_rows(repo, base, heads[attack], tmp_path / "verdict")
    row = rows.get("batch invariance")
    # REGRESSION on the row, or ERROR for the head as a whole (a table it cannot change in
    # place fails its import; a function it replaced is named by the guard)
    assert data["status"] in ("regression", "error"), (data["summary"], row)
    assert row is None or row["verdict"] != "pass", (data["status"], row)


# State the checks read that a head could change in its own process. The tables are tuples of
# immutable values: changing one in place fails; rebinding a name, or replacing a function the
# checks call, is named by the guard.
IMMUTABLE = {
    "inference.CHECKS": lambda m: m["inference"].CHECKS.__setitem__(0, m["inference"].CHECKS[2]),
    "inference.FIGURES": lambda m: m["inference"].FIGURES.__setitem__(0, ("batch", ())),
    "inference.HOST_CASES": lambda m: m["inference"].HOST_CASES[0][1].__setitem__(0, (1, 1, 64)),
    "inference.CASES": lambda m: m["inference"].CASES[1][1].__setitem__(0, ("batch", ())),
    "inference.QMAX": lambda m: m["inference"].QMAX.__setitem__(1, (m["torch"].int8, 100.0)),
    "inference.QMIN": lambda m: m["inference"].QMIN[1].__setitem__(1, -100.0),
    "inference.TOLERANCES": lambda m: m["inference"].TOLERANCES.__setitem__(
        0, (m["torch"].float32, 1.0, 1.0)
    ),
}
REBOUND = {
    "inference.CHECKS": lambda m: setattr(m["inference"], "CHECKS", (("batch", lambda *a: None),)),
    "inference.HOST_CASES": lambda m: setattr(m["inference"], "HOST_CASES", ()),
    "inference.QMAX": lambda m: setattr(m["inference"], "QMAX", ()),
    "inference.TOLERANCES": lambda m: setattr(m["inference"], "TOLERANCES", ()),
    "inference._NE": lambda m: setattr(m["inference"], "_NE", m["torch"].eq),
    "dataclasses.replace": lambda m: setattr(m["dataclasses"], "replace", lambda obj, **kw: obj),
    "torch.nn.functional.rms_norm": lambda m: setattr(
        m["torch"].nn.functional, "rms_norm", lambda x, *a, **k: x
    ),
    "torch.Tensor.__ne__": lambda m: setattr(m["torch"].Tensor, "__ne__", m["torch"].Tensor.__eq__),
}


@pytest.mark.parametrize("name", list(IMMUTABLE))
def test_the_feature_tables_cannot_change_in_place(name):
    import torch

    from rmsnorm_suite import inference

    with pytest.raises((TypeError, AttributeError)):
        IMMUTABLE[name]({"inference": inference, "torch": torch})


def test_the_checks_tolerances_are_bound_at_import(monkeypatch):
    """cases.TOLERANCES (the walkthrough's dict) changed: the checks' own table is not."""
    import torch

    from rmsnorm_suite import cases, inference

    declared = inference.tolerance(torch.float32)
    monkeypatch.setitem(cases.TOLERANCES, torch.float32, cases.Tolerance(atol=1.0, rtol=1.0))
    assert inference.tolerance(torch.float32) == declared


@pytest.mark.parametrize("name", list(REBOUND))
def test_guard_holds_what_the_feature_checks_read(name, monkeypatch):
    import dataclasses

    import torch

    from rmsnorm_suite import inference

    mods = {"inference": inference, "dataclasses": dataclasses, "torch": torch}
    target, attr = name.rsplit(".", 1)
    owner = {"inference": inference, "dataclasses": dataclasses, "torch.Tensor": torch.Tensor}.get(
        target, torch.nn.functional
    )
    monkeypatch.setattr(owner, attr, getattr(owner, attr))  # restored afterwards
    held = guard.Guard()
    REBOUND[name](mods)
    assert held.replaced(), f"{name} changed and the guard names nothing"


def test_base_failed_and_head_unsupported_gives_a_row():
    """Head without the feature base has (even where base's check failed) is still seen."""
    from rmsnorm_suite import gate, results
    from rmsnorm_suite.thresholds import load_thresholds

    def run(status, value=None, note="x"):
        return results.Run((), features={"batch_invariance": results.Feature(status, value, note)})

    rows = gate.feature_rows(run("failed"), run("unsupported"), load_thresholds())
    assert rows, "head dropped a feature base has (failing) and the verdict shows nothing"


def test_a_partly_unsupported_check_is_not_an_ok_figure():
    """A figure measured on some cases while others raised "unsupported" is not a full ok."""
    import dataclasses

    import torch

    from rmsnorm_suite import inference

    def forward(x, w, r, eps):
        if x.shape[0] == 7:
            raise AttributeError("'NoneType' object has no attribute 'stride'")
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
        return y, (x + r if r is not None else None)

    def norm(x, w, r, eps):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    impl = dataclasses.replace(inference.op_impl, forward=forward, norm=norm)
    figures = inference.gate_figures("cpu", impl, inference.HOST_CASES)
    assert figures["batch_invariance"]["status"] != "ok", figures["batch_invariance"]
