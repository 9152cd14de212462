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
from tests.suite._fixtures import INIT, MANY_ROW_PLAN, OPS, OPS_RESIDUAL, attack_heads_repo, feature_rows

ATTACKS = {
    # the check's function swapped in inference.CHECKS (a dict the guard does not hold)
    "check-table-swapped": (
        MANY_ROW_PLAN,
        "from rmsnorm_suite import inference as _inf\n"
        "_inf.CHECKS['batch'] = lambda impl, device, cases: "
        "_inf.Finding('batch invariance', {'batch_invariance': 0.0})\n",
    ),
    # the check's cases swapped for a batch of one row (plain dicts the guard does not hold)
    "case-table-swapped": (
        MANY_ROW_PLAN,
        "import torch as _torch\nfrom rmsnorm_suite import inference as _inf\n"
        "for _t in (_inf.HOST_CASES, *_inf.CASES.values()):\n"
        "    _t['batch'] = (_inf.BatchCase(1, 64, _torch.float32, False),)\n",
    ),
    # the figures rewritten on their way to the results: dataclasses.replace is not held
    "dataclasses-replace-forges-figures": (
        MANY_ROW_PLAN,
        "import dataclasses as _dc\n_real_replace = _dc.replace\n"
        "def _replace(obj, /, **kw):\n"
        "    if 'features' in kw:\n"
        "        kw['features'] = {k: type(v)('ok', 0.0, v.note) if v.status == 'ok' else v\n"
        "                          for k, v in kw['features'].items()}\n"
        "    return _real_replace(obj, **kw)\n"
        "_dc.replace = _replace\n",
    ),
    # the check's Finding reached through the caller's frames: its figures dict made to store 0
    "finding-rewritten-through-frames": (
        MANY_ROW_PLAN,
        "import sys as _sys\n"
        "class _Zero(dict):\n"
        "    def __setitem__(self, k, v):\n        dict.__setitem__(self, k, 0.0)\n"
        "def _forge():\n    f = _sys._getframe(1)\n    while f is not None:\n"
        "        fd = f.f_locals.get('finding')\n"
        "        if hasattr(fd, 'figures') and not isinstance(fd.figures, _Zero):\n"
        "            fd.figures = _Zero(fd.figures)\n"
        "        f = f.f_back\n"
        "_plan = rms_norm\n"
        "def rms_norm(x, *a, **k):\n    if x.shape[0] >= 257:\n        _forge()\n"
        "    return _plan(x, *a, **k)\n",
    ),
    # outputs returned as a Tensor subclass whose != says "equal": nothing patched at all. The
    # no-grad (inference) path is batch dependent; the autograd path is not.
    "tensor-subclass-hides-bits": (
        OPS_RESIDUAL,
        "class _Same(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
        "        if func in (torch.Tensor.__ne__, torch.Tensor.ne, torch.ne):\n"
        "            with torch._C.DisableTorchFunctionSubclass():\n"
        "                return torch.zeros(args[0].shape, dtype=torch.bool)\n"
        "        return super().__torch_function__(func, types, args, kwargs or {})\n"
        "_plain = rms_norm\n"
        "def rms_norm(x, weight=None, eps=1e-6, residual=None):\n"
        "    if torch.is_grad_enabled() or x.shape[0] < 257:\n"
        "        return _plain(x, weight, eps, residual)\n"
        "    with torch.no_grad():\n"
        "        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)\n"
        "        y = h * (h.double().pow(2).mean(-1, keepdim=True).to(h.dtype) + eps).rsqrt()\n"
        "        y = (y * weight if weight is not None else y).as_subclass(_Same)\n"
        "    return y if residual is None else (y, h.as_subclass(_Same))\n",
    ),
    # head drops the residual that base has: the residual case is "unsupported", the plain one
    # measured, and the figure is "ok" (docs/gate.md: a feature base has and head lacks is a
    # regression)
    "residual-dropped": (OPS.format(cost=0.0), ""),
    # an AttributeError in the op (the commonest Python bug) on a batch of 7 rows: counted as
    # "not supported", the 1-row pick measured, the row passes
    "crash-on-seven-rows-as-unsupported": (
        OPS_RESIDUAL,
        "_plain = rms_norm\n"
        "def rms_norm(x, *a, **k):\n"
        "    if x.shape[0] == 7:\n"
        "        raise AttributeError(\"'NoneType' object has no attribute 'stride'\")\n"
        "    return _plain(x, *a, **k)\n",
    ),
}


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
