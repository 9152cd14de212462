"""A second hostile review of the inference features' rows (host stand-in, CPU).

Each test states a property the gate's documentation claims; one that does not hold is marked
``xfail(strict=True)`` (it fails, XPASS, once the hole is closed, so the mark must then be
removed). None is open now: the guard holds InferenceImpl's fields, keeps its modules from
construction and binds what it reads at import, the checks bind their run-time lookups, and a
round's unsupported voids the merged figure. The heads are the first review's batch-dependent op (a "many-row plan" for 257 rows or
more, tests/suite/test_feature_attacks.py) plus an attack that needs no frame walk, no caller
recognition and no write to the result pipe (the routes docs/ci.md lists as open).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import types

import pytest
import torch

from rmsnorm_suite import guard, inference, results, rounds
from tests.suite._fixtures import MANY_ROW_PLAN, OPS_RESIDUAL, attack_heads_repo, feature_rows


# The residual op with out_dtype (fp32 y, or fp8/int8 codes with per-row scales by torch's own
# sequence) and qk_norm, so that the quant and QK-norm rows run end to end under pr-verdict (the
# first review's op lacks both). The heads keep its batch-dependent plan.
def _full(ops: str) -> str:
    return ops.replace(
        "def rms_norm(x, weight=None, eps=1e-6, residual=None):",
        "def rms_norm(x, weight=None, eps=1e-6, residual=None, out_dtype=None):\n"
        "    if out_dtype is not None:\n"
        "        return _quantised(x, weight, eps, residual, out_dtype)",
    ) + (
        "QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}\n"
        "def _quantised(x, weight, eps, residual, out_dtype):\n"
        "    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)\n"
        "    y = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), weight.float(), eps)\n"
        "    if out_dtype == torch.float32:\n"
        "        return y if residual is None else (y, h)\n"
        "    q = QMAX[out_dtype]\n"
        "    s = (y.abs().amax(-1, keepdim=True) / q).clamp(min=float(torch.tensor(1.0 / (q * 512.0))))\n"
        "    v = y / s\n"
        "    v = torch.round(v) if out_dtype == torch.int8 else v\n"
        "    y_q = v.clamp(-q - (out_dtype == torch.int8), q).to(out_dtype)\n"
        "    return (y_q, s) if residual is None else (y_q, s, h)\n"
        "def qk_norm(q, k, q_weight, k_weight, eps=1e-6):\n"
        "    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)\n"
    )


OPS_FULL, FULL_MANY_ROW_PLAN = _full(OPS_RESIDUAL), _full(MANY_ROW_PLAN)
assert FULL_MANY_ROW_PLAN != OPS_FULL
INIT_FULL = "from rmsnorm_kernel.ops import rms_norm, qk_norm\n"

ATTACKS = {
    # The worker measures ``inference.op_impl``, a frozen dataclass instance: frozen only guards
    # ``setattr``; ``object.__setattr__`` changes its fields in place, and the guard holds no
    # instance (nor does comparing gate_figures.__defaults__ see a change inside the same object).
    # The check then measures torch's own norm, not the op.
    "op-impl-fields-swapped": (
        FULL_MANY_ROW_PLAN,
        "from rmsnorm_suite import inference as _inf\n"
        "def _ref(x, w, r, eps):\n"
        "    h = x if r is None else (x.float() + r.float()).to(x.dtype)\n"
        "    return torch.nn.functional.rms_norm(h, (h.shape[-1],), w, eps), h\n"
        "def _fwd(x, w, r, eps):\n"
        "    with torch.no_grad():\n"
        "        y, h = _ref(x, w, r, eps)\n"
        "    return y, (h if r is not None else None)\n"
        "object.__setattr__(_inf.op_impl, 'forward', _fwd)\n"
        "object.__setattr__(_inf.op_impl, 'norm', lambda x, w, r, eps: _ref(x, w, r, eps)[0])\n",
    ),
    # The guard finds the trusted modules with importlib.import_module and reads them with
    # vars(): neither is held. Served a copy of each module's namespace taken at import, the
    # guard sees nothing change, and any function of the checks can then be rebound.
    "guard-blinded-through-import-module": (
        FULL_MANY_ROW_PLAN,
        "import importlib as _il, types as _types\n"
        "from rmsnorm_suite import guard as _g, inference as _inf\n"
        "_copies = {m: dict(vars(_il.import_module(m))) for m in _g.TRUSTED}\n"
        "_real = _il.import_module\n"
        "def _import_module(name, package=None):\n"
        "    if name in _copies:\n"
        "        m = _types.ModuleType(name)\n"
        "        m.__dict__.update(_copies[name])\n"
        "        return m\n"
        "    return _real(name, package)\n"
        "_il.import_module = _import_module\n"
        "_inf._differing = lambda a, b: 0\n",
    ),
}


@pytest.fixture(scope="module")
def second_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("prv-feature-attacks-2") / "repo"
    return attack_heads_repo(repo, INIT_FULL, OPS_FULL, FULL_MANY_ROW_PLAN, ATTACKS)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_second_feature_attack_does_not_pass(second_repo, host_timing, shared_base, tmp_path, attack):
    repo, base, heads = second_repo
    data, rows = feature_rows(repo, base, heads[attack], tmp_path / "verdict")
    row = rows.get("batch invariance")
    assert data["status"] in ("regression", "error"), (data["summary"], row)
    assert row is None or row["verdict"] != "pass", (data["status"], row)


def test_quant_and_qk_rows_run_end_to_end(second_repo, host_timing, shared_base, tmp_path):
    """The control head (the batch-dependent plan, no attack) on an op with out_dtype and qk_norm:
    the quant and QK-norm rows are measured on both sides and pass; the batch row regresses."""
    repo, base, heads = second_repo
    data, rows = feature_rows(repo, base, heads["control"], tmp_path / "verdict")
    assert data["status"] == "regression", data["summary"]
    assert rows["batch invariance"]["verdict"] == "regression", rows["batch invariance"]
    features = {c: r["verdict"] for c, r in rows.items() if c.startswith(("quant", "qk"))}
    assert len(features) == 6 and set(features.values()) == {"pass"}, features


# What the checks called at run time, looked up then (not bound at import), that the guard did not
# hold: the checks now bind them at import and the guard names each replaced.
UNHELD = {
    # torch_quantise's int8 reference rounds with torch.round: an op that truncates its int8
    # codes reads 0 quant_bits once torch.round is torch.trunc
    "torch.round": (torch, "round", torch.trunc),
    # codes_apart (quant_quanta) orders fp8 codes with torch.where
    "torch.where": (torch, "where", lambda c, a, b: torch.zeros_like(a)),
    # _worst: with isnan always true the "worst" figure is the last case's, not the largest
    "math.isnan": (math, "isnan", lambda v: True),
    # _worst's max, _check's float, _differing's int: builtins of the checks
    "builtins.max": (__import__("builtins"), "max", min),
    "builtins.float": (__import__("builtins"), "float", lambda v=0.0: 0.0),
    "builtins.int": (__import__("builtins"), "int", lambda v=0: 0),
    "builtins.sum": (__import__("builtins"), "sum", lambda it, start=0: 0),
}


@pytest.mark.parametrize("name", list(UNHELD))
def test_guard_holds_what_the_checks_call_at_run_time(name, monkeypatch):
    owner, attr, value = UNHELD[name]
    held = guard.Guard()
    monkeypatch.setattr(owner, attr, value)
    try:
        named = held.replaced()
    finally:
        monkeypatch.undo()
    assert named, f"{name} replaced and the guard names nothing"


def test_guard_holds_the_impl_the_worker_measures():
    held = guard.Guard()
    original = inference.op_impl.forward
    object.__setattr__(inference.op_impl, "forward", lambda *a: None)
    try:
        named = held.replaced()
    finally:
        object.__setattr__(inference.op_impl, "forward", original)
    assert named, "op_impl.forward replaced in place and the guard names nothing"


def test_guard_is_not_blinded_by_import_module(monkeypatch):
    held = guard.Guard()
    copies = {m: dict(vars(importlib.import_module(m))) for m in guard.TRUSTED}
    real = importlib.import_module

    def served(name, package=None):
        if name in copies:
            module = types.ModuleType(name)
            module.__dict__.update(copies[name])
            return module
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", served)
    monkeypatch.setattr(inference, "_differing", lambda a, b: 0)
    try:
        named = held.replaced()
    finally:
        monkeypatch.undo()
    assert named, "inference._differing rebound and the guard names nothing"


def test_an_int8_truncating_op_fails_quant_bits_with_torch_round_replaced(monkeypatch):
    """torch.round replaced after import does not change the int8 reference (bound at import)."""
    import torch.nn.functional as F

    def norm32(x, w, r, eps):
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)

    def quantise(x, w, r, eps, out_dtype):
        y = norm32(x, w, r, eps)
        s = (y.abs().amax(-1, keepdim=True) / 127.0).clamp(min=inference.min_scale(out_dtype))
        return torch.trunc(y / s).clamp(-128, 127).to(out_dtype), s  # truncates: a real bug

    impl = inference.InferenceImpl("t", None, None, quantise, norm32, None, None)
    table = (("quant", ((8, 16, 64, torch.float32, torch.int8, False),)),)
    honest = inference.run(impl, "cpu", "quant", table)
    assert honest.figures["quant_bits"] > 0
    monkeypatch.setattr(torch, "round", torch.trunc)
    forged = inference.run(impl, "cpu", "quant", table)
    assert forged.figures["quant_bits"] == honest.figures["quant_bits"] > 0


def test_a_figure_unsupported_in_some_rounds_is_not_ok():
    """A head that drops qk_norm at random in most rounds (no knowledge of the seed needed) has
    its figure judged on the few rounds that measured it: a flaky op is caught less often."""
    F_ = results.Feature
    runs = [
        results.Run((), features={"qk_bits": F_("unsupported", note="no qk_norm")}),
        results.Run((), features={"qk_bits": F_("unsupported", note="no qk_norm")}),
        results.Run((), features={"qk_bits": F_("ok", 0.0, None, ("qkv 3..5x(4+2+2)x16-float32",))}),
    ]
    merged = rounds.merge_features(runs)["qk_bits"]
    assert merged.status == "failed", merged
    assert "#1, #2" in merged.note, merged


def _options_of(monkeypatch, rms_norm) -> frozenset:
    monkeypatch.setattr(inference, "_op", lambda: types.SimpleNamespace(rms_norm=rms_norm))
    return inference._op_options()


def test_an_unreadable_signature_reads_as_every_option(monkeypatch):
    """A C function (no signature to read) is not taken as lacking residual and out_dtype."""
    with pytest.raises(ValueError):
        inspect.signature(max)
    assert {"residual", "out_dtype"} <= _options_of(monkeypatch, max)


def test_a_wraps_wrapper_narrowing_the_signature_keeps_its_options(monkeypatch):
    """functools.wraps reports the wrapped function's narrower signature; the wrapper's own
    (``**kw``) takes every keyword."""

    def narrow(x, weight=None, eps=1e-6):
        return x

    @functools.wraps(narrow)
    def rms_norm(*args, **kwargs):
        return args[0]

    assert "out_dtype" not in inspect.signature(rms_norm).parameters
    assert {"residual", "out_dtype"} <= _options_of(monkeypatch, rms_norm)


def test_a_plain_signature_without_the_options_still_lacks_them(monkeypatch):
    def rms_norm(x, weight=None, eps=1e-6):
        return x

    assert _options_of(monkeypatch, rms_norm) == frozenset({"rms_norm"})
