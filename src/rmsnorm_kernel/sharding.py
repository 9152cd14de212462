"""DTensor sharding rules for the op's operators: ``rmsnorm_kernel::forward`` and ``::backward``
(with and without a residual), qk_norm's ``::qk_forward`` and ``::qk_backward``, and the compiled
host path's ``rmsnorm_kernel_host::rms_norm`` and ``::rms_norm_residual``, so that a DTensor
(tensor and sequence parallel, FSDP2's parameters) reaches the kernels on each rank's local rows.
docs/features.md, Distributed: the placements.

The rule, per mesh dimension, is torch's own for ``aten._fused_rms_norm`` (``F.rms_norm`` on a
DTensor): rows are independent, so x sharded on any dimension but the last (the normalised one)
passes through, its outputs (y, h, r) sharded on the same dimension; the weight replicated; a
replicated x gives replicated outputs. The weight's gradient from row-sharded input is
``Partial("sum")``: each rank's sum over its own rows, reduced where it is used, as torch's.
qk_norm's rule is that rule for q and for k side by side (a head is a row: tensor parallel's
heads pass through as sequence parallel's tokens do), q's and k's placements chosen apart; a
per-head (H, D) weight goes with its tensor's heads (sharded on them, or replicated). A
normalised dimension that arrives sharded is not among the rule's inputs: DTensor redistributes
it (gathers the rows whole) before the kernels run, as it does for ``F.rms_norm``, rather than
refusing the call or computing r from a reduction of partial sums of squares across the mesh
(docs/features.md says why).

Registration needs ``torch.distributed.tensor``, whose import takes longer than this package's:
the rules are registered when it is imported (now, where it already is; else by a hook on its
import), and the host path's when its extension loads (``host.on_load``). Nothing here runs
without DTensor.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

import torch

from rmsnorm_kernel import host, ops, qknorm  # noqa: F401 - ops and qknorm define the operators ruled here

DTENSOR_MODULE = "torch.distributed.tensor"

_lock = threading.Lock()
_registered: set[str] = set()


# ---------------------------------------------------------------------------------------------
# The rules: for one mesh dimension, the acceptable (output placements, input placements), one
# entry per output and one per argument (None: not a tensor, or an absent optional one).
# ---------------------------------------------------------------------------------------------


def _row_dims(x) -> range:
    """The dims of x that index rows: all but the last (the kernels normalise over the last)."""
    return range(len(x.shape) - 1)


def _forward_rule(x, weight, residual, eps, offset, casting, out_dtype, residual_dtype):
    # rmsnorm_kernel::forward -> (y, rstd, h); h is an empty tensor without a residual.
    from torch.distributed.tensor import Replicate, Shard

    r = Replicate()
    rules = [([r, r, r], [r, r if weight is not None else None, r if residual is not None else None])]
    for d in _row_dims(x):
        s = Shard(d)
        outputs = [s, s, s if residual is not None else r]
        inputs = [s, r if weight is not None else None, s if residual is not None else None]
        rules.append((outputs, inputs))
    return [(out, inp + [None] * 5) for out, inp in rules]


def _backward_rule(dy, dh, xh, weight, rstd, offset, casting, need_dw, dx_dtype):
    # rmsnorm_kernel::backward -> (dx, dw); dw is an empty tensor unless need_dw and a weight.
    from torch.distributed.tensor import Partial, Replicate, Shard

    r = Replicate()
    has_w, has_dh = weight is not None, dh is not None
    with_dw = has_w and bool(need_dw)

    def inputs(p):
        return [p, p if has_dh else None, p, r if has_w else None, p, None, None, None, None]

    rules = [([r, r], inputs(r))]
    for d in _row_dims(xh):
        # each rank sums dw over its own rows: the whole dw is the sum over the mesh
        rules.append(([Shard(d), Partial("sum") if with_dw else r], inputs(Shard(d))))
    return rules


def _host_rule(x, weight, eps, offset, casting, out_dtype):
    # rmsnorm_kernel_host::rms_norm -> y
    from torch.distributed.tensor import Replicate, Shard

    r = Replicate()
    w = r if weight is not None else None
    rules = [([r], [r, w, None, None, None, None])]
    rules += [([Shard(d)], [Shard(d), w, None, None, None, None]) for d in _row_dims(x)]
    return rules


def _host_residual_rule(x, residual, weight, eps, offset, casting, out_dtype, residual_dtype):
    # rmsnorm_kernel_host::rms_norm_residual -> (y, h)
    from torch.distributed.tensor import Replicate, Shard

    r = Replicate()
    w = r if weight is not None else None
    rest = [None] * 5
    rules = [([r, r], [r, r, w, *rest])]
    rules += [([Shard(d), Shard(d)], [Shard(d), Shard(d), w, *rest]) for d in _row_dims(x)]
    return rules


def _qk_placements(q, k) -> list[tuple]:
    """The (q's, k's) placements of qk_norm's rules: each of q and k replicated or sharded on a
    row dim (tokens, heads), the two chosen apart (their rows are independent, and Hq and Hk
    may differ: a GQA k whose few heads are replicated while q's are sharded); both replicated
    first, then q and k sharded on the same dim, as the other rules list theirs. The pairs q and
    k already have lead, the more replicated first: where moving costs nothing (a mesh dim of one
    rank) DTensor takes the first cheapest, and torch's own ops keep the placements they got."""
    from torch.distributed.tensor import Replicate, Shard

    r = Replicate()
    qs, ks = [Shard(d) for d in _row_dims(q)], [Shard(d) for d in _row_dims(k)]
    same = [(s, s) for s in qs if s in ks]
    mixed = [(a, b) for a in [r, *qs] for b in [r, *ks] if (a, b) != (r, r) and a != b]
    pairs = [(r, r), *same, *mixed]
    held = set(zip(getattr(q, "placements", ()), getattr(k, "placements", ())))
    own = sorted((p for p in pairs if p in held), key=lambda p: -sum(a == r for a in p))
    return [*own, *(p for p in pairs if p not in own)]


def _qk_weight(p, t, w):
    """A weight's placement beside its tensor ``t`` in ``p``: a per-head (H, D) weight is sharded
    on its heads where t's heads (dim -2) are, each rank's rows meeting their own heads' weights;
    else replicated (None for no weight)."""
    from torch.distributed.tensor import Replicate, Shard

    if w is None:
        return None
    if len(w.shape) == 2 and p == Shard(len(t.shape) - 2):
        return Shard(0)
    return Replicate()


def _qk_forward_rule(q, k, q_weight, k_weight, eps, offset, casting, q_out_dtype, k_out_dtype):
    # rmsnorm_kernel::qk_forward -> (yq, rq, yk, rk); r is y's shape without the last dim.
    return [
        ([p, p, pk, pk], [p, pk, _qk_weight(p, q, q_weight), _qk_weight(pk, k, k_weight), *[None] * 5])
        for p, pk in _qk_placements(q, k)
    ]


def _qk_backward_rule(dyq, dyk, q, k, q_weight, k_weight, rq, rk, offset, casting, need_dw):
    # rmsnorm_kernel::qk_backward -> (dq, dwq, dk, dwk); dw empty unless need_dw and weights.
    from torch.distributed.tensor import Partial, Replicate, Shard

    with_dw = q_weight is not None and bool(need_dw)

    def dw(p, w_at):
        if not with_dw:
            return Replicate()
        if w_at == Shard(0):  # a per-head dw of sharded heads: each rank's own heads, whole
            return w_at
        # each rank sums dw over its own rows: the whole dw is the sum over the mesh
        return Partial("sum") if isinstance(p, Shard) else Replicate()

    rules = []
    for p, pk in _qk_placements(q, k):
        wq, wk = _qk_weight(p, q, q_weight), _qk_weight(pk, k, k_weight)
        rules.append(([p, dw(p, wq), pk, dw(pk, wk)], [p, pk, p, pk, wq, wk, p, pk, None, None, None]))
    return rules


RULES = {
    "rmsnorm_kernel::forward": _forward_rule,
    "rmsnorm_kernel::backward": _backward_rule,
    "rmsnorm_kernel::qk_forward": _qk_forward_rule,
    "rmsnorm_kernel::qk_backward": _qk_backward_rule,
}
HOST_RULES = {
    "rmsnorm_kernel_host::rms_norm": _host_rule,
    "rmsnorm_kernel_host::rms_norm_residual": _host_residual_rule,
}


def _overload(name: str):
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op).default


def register() -> list[str]:
    """Register the rules with DTensor for every operator defined now (the host path's where its
    extension has loaded); returns the operators registered by this call. Imports
    ``torch.distributed.tensor``; a second call registers only what is new."""
    from torch.distributed.tensor.experimental import register_sharding

    done = []
    with _lock:
        rules = dict(RULES)
        if torch._C._dispatch_has_kernel("rmsnorm_kernel_host::rms_norm"):
            rules.update(HOST_RULES)
        for name, rule in rules.items():
            if name not in _registered:
                register_sharding(_overload(name))(rule)
                _registered.add(name)
                done.append(name)
    return done


def registered() -> frozenset[str]:
    """The operators whose rules DTensor has (tests and docs read this)."""
    return frozenset(_registered)


# ---------------------------------------------------------------------------------------------
# When: on torch.distributed.tensor's import, and on the host extension's load
# ---------------------------------------------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch.distributed.tensor`` with the finders after it and registers the rules
    once that module has run; then leaves ``sys.meta_path``."""

    def __init__(self) -> None:
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != DTENSOR_MODULE or self._loader is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            _remove_hook()
        register()


_hook: _AfterImport | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def _on_host_load() -> None:
    if DTENSOR_MODULE in sys.modules:
        register()


def install() -> None:
    """Register now where ``torch.distributed.tensor`` is imported, else on its import; and the
    host path's rules when its extension loads. Called once, by the package's import."""
    global _hook
    host.on_load.append(_on_host_load)
    if DTENSOR_MODULE in sys.modules:
        register()
    elif _hook is None and torch.distributed.is_available():
        _hook = _AfterImport()
        sys.meta_path.insert(0, _hook)


install()
