"""``RMSNorm``, a drop-in ``torch.nn.RMSNorm`` backed by the Triton kernels, and
``swap_rms_norm``, which puts it into a model wherever it computes what the module there
computes, decided by behaviour on probes (docs/features.md, Swapping into a model).
"""

from __future__ import annotations

import inspect
import logging
import numbers
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from rmsnorm_kernel import composite, kernels
from rmsnorm_kernel.contract import (
    CASTING_CODES,
    KERNEL_DTYPES,
    OUT_DTYPE_RULES,
    PROMOTING_CASTINGS,
    UnsupportedInput,
    default_eps,
    default_out_dtype,
    real_number,
    rule_dtype,
)
from rmsnorm_kernel.contract import dtype_name as _dtype_name
from rmsnorm_kernel.ops import _autocast_float32, rms_norm

logger = logging.getLogger(__name__)


def _check_eps(eps) -> float | None:
    """eps as torch takes it: None (torch's default) or any real number (bools and NumPy scalars
    too, as rms_norm reads them); stored as a float, which keeps rms_norm's fast path."""
    if eps is None:
        return None
    if not real_number(eps):
        raise TypeError(f"eps must be a real number or None, got {type(eps).__name__}")
    return float(eps)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm``'s constructor, parameters and ``state_dict``; the forward runs the
    kernels. Keyword-only extras: ``offset``, ``casting``, ``out_dtype`` (None, a dtype, or the
    rule "input" or "promoted", resolved per call) and ``allow_fallback`` (torch ops for input the
    kernels do not run, as torch.nn.RMSNorm computes it). ``forward(x, residual=None)`` returns
    ``y``, or ``(y, h)``. docs/features.md, The module.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
        casting: str = "default",
        out_dtype: torch.dtype | str | None = None,
        allow_fallback: bool = True,
    ) -> None:
        eps = _check_eps(eps)
        if casting not in CASTING_CODES:
            raise ValueError(f"casting must be one of {sorted(CASTING_CODES)}, got {casting!r}")
        if (
            isinstance(offset, bool)
            or not isinstance(offset, numbers.Real)
            or not float("-inf") < offset < float("inf")
        ):
            raise ValueError(f"offset must be a finite float, got {offset!r}")
        if offset and not elementwise_affine:
            raise ValueError(
                "offset needs a weight: y = x * r * (offset + weight); elementwise_affine is False"
            )
        if not (out_dtype is None or out_dtype in OUT_DTYPE_RULES or out_dtype in KERNEL_DTYPES):
            raise ValueError(
                f"out_dtype must be None, {' or '.join(map(repr, OUT_DTYPE_RULES))}, or one of "
                f"float32, float16, bfloat16; got {out_dtype!r}"
            )
        super().__init__(
            normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype
        )
        self.offset = float(offset)
        self.casting = casting
        self.out_dtype = out_dtype
        self.allow_fallback = bool(allow_fallback)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out_dtype = self.out_dtype
        # A rule (contract.rule_dtype) resolved here for a tensor x; anything else (an fx Proxy,
        # whose dtype is not known) hands rms_norm the rule, which a trace records as given.
        if type(out_dtype) is str and isinstance(x, torch.Tensor):
            weight = self.weight
            out_dtype = rule_dtype(out_dtype, x.dtype, weight)
            # The casting mode's own dtype: pass None, which keeps rms_norm's fast path (with a
            # residual too: h then has x's dtype). Not under CUDA autocast, where None would give
            # F.rms_norm's dtype there (float32 in torch releases that list rms_norm).
            if out_dtype == default_out_dtype(x.dtype, weight, self.casting) and not _autocast_float32(x):
                out_dtype = None
        return rms_norm(
            x,
            self.normalized_shape,
            self.weight,
            self.eps,
            residual=residual,
            offset=self.offset,
            casting=self.casting,
            out_dtype=out_dtype,
            allow_fallback=self.allow_fallback,
        )

    def __prepare_scriptable__(self):
        """What torch.jit.script compiles in place of this module: TorchScript cannot compile the
        op's Python. torch.nn.RMSNorm (sharing this weight Parameter) where the options are
        torch's; else _ScriptableRMSNorm, composite.py's formula in torch ops."""
        if self.offset or self.casting != "default" or self.out_dtype is not None:
            return _ScriptableRMSNorm(self).train(self.training)
        same = nn.RMSNorm(self.normalized_shape, self.eps, self.elementwise_affine, device="meta")
        same.weight = self.weight
        return same.train(self.training)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.offset:
            extra += f", offset={self.offset}"
        if self.casting != "default":
            extra += f", casting={self.casting!r}"
        if self.out_dtype is not None:
            extra += f", out_dtype={self.out_dtype!r}"
        if not self.allow_fallback:
            extra += ", allow_fallback=False"
        return extra


class _ScriptableRMSNorm(nn.Module):
    """RMSNorm with an offset, a casting or an out_dtype in torch ops TorchScript compiles, the
    weight Parameter shared: the composite's formula (reference.py), y only, as nn.RMSNorm's
    forward takes x only. out_dtype: 0 the casting's own, 1 x's ("input"), 2 "promoted", 3 fixed."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.normalized_shape = list(norm.normalized_shape)
        self.eps_float32 = default_eps(torch.float32) if norm.eps is None else norm.eps
        self.eps_float64 = default_eps(torch.float64) if norm.eps is None else norm.eps
        self.offset = norm.offset
        self.round_first = norm.casting in PROMOTING_CASTINGS  # Llama's x * r in x's dtype
        rule = norm.out_dtype
        self.rule = 0 if rule is None else 1 if rule == "input" else 2 if rule == "promoted" else 3
        self.out_dtype = rule if isinstance(rule, torch.dtype) else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if x.dim() < k or list(x.shape[x.dim() - k :]) != self.normalized_shape:
            raise RuntimeError(f"normalized_shape {self.normalized_shape} must match the trailing dims of x")
        wide = x.dtype == torch.float64
        cdt = torch.float64 if wide else torch.float32
        xf = x.flatten(x.dim() - k).to(cdt)  # the normalised dims as one, as composite.py's
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + (self.eps_float64 if wide else self.eps_float32))
        y = xf * r
        if self.round_first:
            y = y.to(x.dtype).to(cdt)
        out = x.dtype
        weight = self.weight
        if weight is not None:
            y = y * (self.offset + weight.reshape(-1).to(cdt))
            if self.rule == 2 or (self.rule == 0 and self.round_first):
                out = torch.promote_types(x.dtype, weight.dtype)
        if self.rule == 3:
            out = self.out_dtype
        return y.to(out).view(x.shape)


class LastDimRMSNorm(nn.Module):
    """RMSNorm without a weight over the last dimension, whatever its size: what ``swap_rms_norm``
    puts in place of a weightless module that is not a ``torch.nn.RMSNorm`` (such modules take
    any width, where ``RMSNorm`` fixes ``normalized_shape``). The output has x's dtype."""

    def __init__(self, eps: float | None = None) -> None:
        super().__init__()
        self.eps = _check_eps(eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x's dtype under CUDA autocast too, where rms_norm's own rule would follow F.rms_norm's
        out_dtype = x.dtype if isinstance(x, torch.Tensor) and _autocast_float32(x) else None
        return rms_norm(x, None, None, self.eps, residual=residual, out_dtype=out_dtype)

    def __prepare_scriptable__(self):
        """What torch.jit.script compiles in place of this module (as RMSNorm's)."""
        return _ScriptableLastDim(self.eps).train(self.training)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class _ScriptableLastDim(nn.Module):
    """LastDimRMSNorm in torch ops TorchScript compiles: F.rms_norm over the last dim."""

    def __init__(self, eps: float | None) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, [x.shape[-1]], None, self.eps)


# ---------------------------------------------------------------------------------------------
# swap_rms_norm
# ---------------------------------------------------------------------------------------------

# Probe tolerance, |replacement - original| <= atol + rtol |original| per element, by the coarser
# of x's and the output's dtype. The op does not import the suite: these equal the suite's
# TOLERANCES (tests/op/test_swap.py checks that none is looser).
PROBE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # dtype: (atol, rtol)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (1e-2, 1e-2),
}
# Probe rows: seeded normal rows at these scales. 1e-3 makes eps a large part of mean(x^2), so a
# wrong eps shows; 1e2 shows a formula that loses precision at large activations.
PROBE_SCALES = (1.0, 1e-3, 1e2)
PROBE_LEADING = (2, 3)  # leading dims of a probe input: 6 rows, 3-D as in a transformer
PROBE_WIDTH = 40  # last dim for a weightless module, which takes any width
PROBE_SEED = 0
# Probe weights beside the module's own, so that a weight cannot hide a formula: at the default
# all-ones weight, w, w^2 and |w| agree, and so does an output scaled by mean(w). Seeded normal
# weights of each sign, at two scales (offset + w differs from w at every scale but one).
PROBE_WEIGHT_SCALES = (1.0, 0.25)

# The hooks a module can carry that a replacement would not.
_HOOK_ATTRIBUTES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class SwapReport(list):
    """What ``swap_rms_norm`` did: a list of the qualified names of the replaced modules (so
    ``swap_rms_norm(model) == [...]`` works as it did), with ``skipped``, a dict from the
    qualified name of each module that looks like an RMSNorm and was left as it was to the
    reason, and ``settings``, a dict from each replaced name to the replacement's repr."""

    def __init__(self, replaced=(), skipped=None, settings=None):
        super().__init__(replaced)
        self.skipped: dict[str, str] = dict(skipped or {})
        self.settings: dict[str, str] = dict(settings or {})


@dataclass(frozen=True)
class _Candidate:
    offset: float
    casting: str
    eps: float | None
    out_dtype: str | None  # an OUT_DTYPE_RULES rule, or None for the casting mode's own


class _Refused(Exception):
    """A module that swap_rms_norm leaves as it was; the message is the reason."""


def _eps_attributes(module: nn.Module) -> dict[str, object]:
    """The module's own attributes whose name contains "eps" (eps, variance_epsilon, ...)."""
    return {k: v for k, v in vars(module).items() if "eps" in k.lower() and not k.startswith("_")}


def _looks_like_rms_norm(module: nn.Module) -> bool:
    """A torch.nn.RMSNorm, a class named like one, or a leaf module with an eps attribute and no
    parameter but a 1-D weight: the modules whose fate the report gives."""
    if isinstance(module, nn.RMSNorm) or "rmsnorm" in type(module).__name__.lower():
        return True
    if not _eps_attributes(module) or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight = params.pop("weight", None)
    return not params and (weight is None or weight.dim() == 1)


def _structure(module: nn.Module) -> tuple[nn.Parameter | None, tuple[int, ...] | None, list]:
    """(weight, normalized_shape, eps candidates) of a module the replacement can stand in for,
    else _Refused with the reason. normalized_shape is None for a weightless module that takes
    any width."""
    hooks = [a.strip("_").replace("_", " ") for a in _HOOK_ATTRIBUTES if getattr(module, a, None)]
    if hooks:
        raise _Refused(f"has {', '.join(hooks)}, which the replacement would not run")
    children = [name for name, _ in module.named_children()]
    if children:
        raise _Refused(f"has submodules ({', '.join(children)}), which the replacement would not run")
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    if buffers:
        raise _Refused(f"has buffers ({', '.join(buffers)}), which the replacement would drop")
    params = dict(module.named_parameters(recurse=False))
    weight = params.pop("weight", None)
    if params:
        raise _Refused(f"has parameters other than weight ({', '.join(params)})")
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        raise _Refused("its forward has no inspectable signature") from None
    extra = list(signature.parameters)[1:]
    if not signature.parameters or extra:
        raise _Refused(f"its forward takes more than the input ({', '.join(extra) or 'none'})")
    if weight is not None and weight.dtype not in KERNEL_DTYPES:
        raise _Refused(
            f"its weight is {_dtype_name(weight.dtype)}; the kernels run float32, float16 and bfloat16"
        )
    if isinstance(module, nn.RMSNorm):
        eps = module.eps
        if eps is None:  # torch's default; the explicit value too, for an op that resolves None otherwise
            return weight, tuple(module.normalized_shape), [None, default_eps(torch.float32)]
        if not real_number(eps):  # what F.rms_norm reads as a float (bools too), as RMSNorm takes
            raise _Refused(f"its eps is a {type(eps).__name__}, not a real number")
        return weight, tuple(module.normalized_shape), [float(eps)]
    if weight is not None and weight.dim() != 1:
        raise _Refused(f"its weight has shape {tuple(weight.shape)}; the replacement takes a 1-D weight")
    eps = [
        float(v)
        for v in _eps_attributes(module).values()
        if isinstance(v, numbers.Real) and not isinstance(v, bool)
    ]
    if not eps:
        raise _Refused("has no eps attribute (a real number named eps, variance_epsilon, ...)")
    return weight, (tuple(weight.shape) if weight is not None else None), list(dict.fromkeys(eps))


def _device_of(module: nn.Module, weight: torch.Tensor | None, model: nn.Module) -> torch.device:
    """The weight's device; for a weightless module, that of the model's first tensor, else the
    current CUDA device where there is one (a module without tensors runs wherever its input is)."""
    if weight is not None:
        return weight.device
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probe_dtypes(weight: torch.Tensor | None) -> tuple[torch.dtype, ...]:
    """The weight's dtype, and bf16 activations beside an fp32 weight; every kernel dtype
    without a weight."""
    if weight is None:
        return KERNEL_DTYPES
    if weight.dtype == torch.float32:
        return (torch.float32, torch.bfloat16)
    return (weight.dtype,)


def _probe_inputs(shape: tuple[int, ...], dtypes, device) -> list[torch.Tensor]:
    """Seeded normal rows, each at one of PROBE_SCALES in turn, in each dtype."""
    generator = torch.Generator().manual_seed(PROBE_SEED)  # local: the global RNG is not touched
    rows = PROBE_LEADING[0] * PROBE_LEADING[1]
    scales = torch.tensor([PROBE_SCALES[i % len(PROBE_SCALES)] for i in range(rows)])
    base = torch.randn(*PROBE_LEADING, *shape, generator=generator)
    base = base * scales.view(*PROBE_LEADING, *[1] * len(shape))
    return [base.to(dtype).to(device) for dtype in dtypes]


def _probe_weights(weight: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The module's weight, then seeded normal weights of its shape, dtype and device."""
    if weight is None:
        return [None]
    generator = torch.Generator().manual_seed(PROBE_SEED + 1)
    drawn = [torch.randn(weight.shape, generator=generator) * scale for scale in PROBE_WEIGHT_SCALES]
    return [weight.detach(), *(w.to(dtype=weight.dtype, device=weight.device) for w in drawn)]


def _with_weight(module: nn.Module, weight: torch.Tensor | None, x: torch.Tensor):
    """module(x) with ``weight`` in place of its weight (the module itself for its own)."""
    if weight is None or weight is getattr(module, "weight", None):
        return module(x)
    return torch.func.functional_call(module, {"weight": weight}, (x,), strict=True)


def _error_ratio(got: torch.Tensor, expected: torch.Tensor, x_dtype: torch.dtype) -> float:
    """max |got - expected| / (atol + rtol |expected|) at the probe tolerance (<= 1 is a match);
    infinite where one is non-finite and the other differs."""
    dtype = max(x_dtype, expected.dtype, key=lambda d: torch.finfo(d).eps)
    atol, rtol = PROBE_TOLERANCES[dtype]
    g, e = got.double(), expected.double()
    same = (g == e) | (g.isnan() & e.isnan())
    ratio = ((g - e).abs() / (atol + rtol * e.abs())).masked_fill(same, 0.0)
    ratio = ratio.nan_to_num(nan=float("inf"))
    return ratio.max().item() if ratio.numel() else 0.0


def _out_dtype_rules(probes, outputs, weight) -> list[str]:
    """The OUT_DTYPE_RULES that give the dtype the module returned on every probe."""
    return [
        rule
        for rule in OUT_DTYPE_RULES
        if all(y.dtype == rule_dtype(rule, x.dtype, weight) for x, y in zip(probes, outputs))
    ]


def _candidates(weight, eps_values, rules, follows_torch: bool) -> list[_Candidate]:
    """Settings to try, in order of preference where two fit equally well. ``follows_torch``: the
    module is a torch.nn.RMSNorm, whose forward is F.rms_norm."""
    forms = (
        [(0.0, "default"), (0.0, "llama"), (1.0, "gemma"), (1.0, "llama")]
        if weight is not None
        else [(0.0, "default")]
    )
    out = []
    for offset, casting in forms:
        # The casting mode's own output dtype where it fits, else the rule that does. Only a
        # torch.nn.RMSNorm gets None, which follows F.rms_norm under CUDA autocast as well; any
        # other module's dtype comes from its own code, which autocast leaves as it is.
        own = "promoted" if casting == "llama" else "input"
        out_dtype = (None if follows_torch else own) if own in rules else rules[0]
        out.extend(_Candidate(offset, casting, eps, out_dtype) for eps in eps_values)
    return out


def _reference(x: torch.Tensor, weight, normalized_shape, candidate: _Candidate) -> torch.Tensor:
    """The candidate's formula in plain torch (the op's composite path: reference.rms_norm_reference
    over the flattened normalised dims)."""
    shape = tuple(normalized_shape) if normalized_shape is not None else (x.shape[-1],)
    w = weight.reshape(-1) if weight is not None else None
    eps = default_eps(x.dtype) if candidate.eps is None else candidate.eps
    if candidate.out_dtype is None:
        out_dtype = default_out_dtype(x.dtype, w, candidate.casting)
    else:
        out_dtype = rule_dtype(candidate.out_dtype, x.dtype, w)
    return composite.rms_norm(
        x, shape, weight, eps, None, None, candidate.offset, candidate.casting, out_dtype
    )


def _replacement(module: nn.Module, weight, normalized_shape, candidate: _Candidate) -> nn.Module:
    if normalized_shape is None:
        new = LastDimRMSNorm(eps=candidate.eps)
    else:
        new = RMSNorm(
            normalized_shape,
            eps=candidate.eps,
            elementwise_affine=weight is not None,
            device="meta",  # the original's weight Parameter takes the place of the new one
            offset=candidate.offset,
            casting=candidate.casting,
            out_dtype=candidate.out_dtype,
        )
        if weight is not None:
            new.weight = weight
    new.train(module.training)
    return new


def _run_original(module: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    try:
        y = _with_weight(module, weight, x)
    except Exception as error:  # the original cannot take a plain input: nothing to compare
        first = str(error).splitlines()[0] if str(error) else ""
        raise _Refused(
            f"its forward raised {type(error).__name__} on a {_dtype_name(x.dtype)} input of shape "
            f"{tuple(x.shape)}: {first}"
        ) from None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise _Refused(f"its forward returns {got} for an input of shape {tuple(x.shape)}")
    if y.dtype not in KERNEL_DTYPES:
        raise _Refused(f"its forward returns {_dtype_name(y.dtype)}")
    return y


def _restore_attributes(module: nn.Module, before: dict) -> list[str]:
    """Put back the module attributes its forward assigned during the probes; their names."""
    after = vars(module)
    changed = []
    for key in before.keys() | after.keys():
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        if old is new:
            continue
        try:
            same = bool(old == new)
        except Exception:  # a tensor of several elements, say: not the same object, so changed
            same = False
        if not same:
            changed.append(key)
            if old is _MISSING:
                del after[key]
            else:
                after[key] = old
    return sorted(changed)


_MISSING = object()


def _decide(module: nn.Module, structure, device) -> nn.Module:
    """The replacement for ``module``, checked on the probes (each input with each probe weight),
    else _Refused with the reason."""
    weight, normalized_shape, eps_values = structure
    shape = normalized_shape if normalized_shape is not None else (PROBE_WIDTH,)
    inputs = _probe_inputs(shape, _probe_dtypes(weight), device)
    probes = [(x, w) for w in _probe_weights(weight) for x in inputs]
    own = weight.detach() if weight is not None else None
    before = dict(vars(module))
    try:
        with warnings.catch_warnings():  # what the original says about a probe is not the user's concern
            warnings.simplefilter("ignore")
            outputs = [_run_original(module, x, w if w is not own else None) for x, w in probes]
    finally:
        changed = _restore_attributes(module, before)
    if changed:
        raise _Refused(f"its forward sets attributes ({', '.join(changed)}), which the replacement would not")
    xs = [x for x, _ in probes]
    rules = _out_dtype_rules(xs, outputs, weight)
    if not rules:
        got = ", ".join(f"{_dtype_name(y.dtype)} for {_dtype_name(x.dtype)}" for x, y in zip(inputs, outputs))
        raise _Refused(f"its output dtype ({got}) is neither the input's nor the promoted dtype")
    scored = []
    for candidate in _candidates(weight, eps_values, rules, isinstance(module, nn.RMSNorm)):
        error = max(
            _error_ratio(_reference(x, w, normalized_shape, candidate), y, x.dtype)
            for (x, w), y in zip(probes, outputs)
        )
        scored.append((error, candidate))
    scored.sort(key=lambda item: item[0])  # stable: ties keep the order of preference
    closest = None
    for error, candidate in scored:
        if error > 1.0:
            break
        new = _replacement(module, weight, normalized_shape, candidate)
        results = [_with_weight(new, w if w is not own else None, x) for x, w in probes]
        kernel_error = max(_error_ratio(r, y, x.dtype) for x, y, r in zip(xs, outputs, results))
        if kernel_error <= 1.0 and all(r.dtype == y.dtype for r, y in zip(results, outputs)):
            return new
        closest = closest or (kernel_error, candidate)
    if closest is None:
        error, candidate = scored[0]
        raise _Refused(
            f"no setting reproduces its forward on the probes (closest: {_describe(candidate)}, "
            f"{error:.3g}x the tolerance)"
        )
    error, candidate = closest
    raise _Refused(
        f"the replacement ({_describe(candidate)}) differs from its forward on the probes "
        f"({error:.3g}x the tolerance)"
    )


def _describe(candidate: _Candidate) -> str:
    text = f"offset={candidate.offset}, casting={candidate.casting!r}, eps={candidate.eps}"
    return text + (f", out_dtype={candidate.out_dtype!r}" if candidate.out_dtype else "")


def swap_rms_norm(model: nn.Module) -> SwapReport:
    """Replace, in place, each module of ``model`` that computes an RMSNorm the kernels compute by
    ``RMSNorm`` (``LastDimRMSNorm`` for a weightless look-alike), sharing its weight Parameter and
    keeping its training mode; each other candidate is left as it was, with the reason. The
    probes run under no_grad, outside autocast, with the RNG state kept. Raises UnsupportedInput
    before changing anything where a candidate sits on a device the kernels cannot run or probe
    (meta; CPU without ``TRITON_INTERPRET=1``). Returns a ``SwapReport``. docs/features.md,
    Swapping into a model, gives the rules.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    paths: dict[int, list[str]] = {}  # a module shared at several paths is replaced at each
    modules: dict[int, nn.Module] = {}
    order: dict[str, int] = {}
    for qualified, module in model.named_modules(remove_duplicate=False):
        order[qualified] = len(order)
        if isinstance(module, RMSNorm | LastDimRMSNorm) or not _looks_like_rms_norm(module):
            continue
        paths.setdefault(id(module), []).append(qualified)
        modules[id(module)] = module
    skipped: dict[str, str] = {}
    todo = []
    for key, module in modules.items():
        name = paths[key][0]
        try:
            if name == "":
                raise _Refused("it is the model itself; swap_rms_norm replaces submodules")
            structure = _structure(module)
            todo.append((key, module, structure, _device_of(module, structure[0], model)))
        except _Refused as reason:
            skipped[name] = str(reason)
    unrunnable = [  # a meta tensor has no values to probe, interpreter or not
        (paths[key][0], device)
        for key, _, _, device in todo
        if device.type == "meta" or (device.type != "cuda" and not kernels.INTERPRET)
    ]
    if unrunnable:
        where = ", ".join(f"{name} on {device}" for name, device in unrunnable[:3])
        more = ", ..." if len(unrunnable) > 3 else ""
        raise UnsupportedInput(
            "swap_rms_norm: the kernels run CUDA tensors (CPU ones only under TRITON_INTERPRET=1), and "
            f"{len(unrunnable)} RMSNorm module(s) are elsewhere ({where}{more}); "
            "move the model to the GPU, then swap"
        )
    replacements = {}
    cuda = {
        d.index if d.index is not None else torch.cuda.current_device() for *_, d in todo if d.type == "cuda"
    }
    with torch.random.fork_rng(devices=sorted(cuda)), torch.no_grad():
        for key, module, structure, device in todo:
            name = paths[key][0]
            try:
                with torch.autocast(device.type, enabled=False):
                    replacements[key] = _decide(module, structure, device)
            except _Refused as reason:
                skipped[name] = str(reason)
    report = SwapReport()
    for key, new in replacements.items():
        for qualified in paths[key]:
            parent_name, _, child = qualified.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, new)
            report.append(qualified)
            report.settings[qualified] = repr(new)
            logger.info("swap_rms_norm: %s (%s) -> %r", qualified, type(modules[key]).__name__, new)
    for key, module in modules.items():
        name = paths[key][0]
        if name in skipped:
            for qualified in paths[key]:
                report.skipped[qualified] = skipped[name]
            named = isinstance(module, nn.RMSNorm) or "rmsnorm" in type(module).__name__.lower()
            logger.log(
                logging.WARNING if named else logging.INFO,
                "swap_rms_norm: left %s (%s) as it was: %s",
                name,
                type(module).__name__,
                skipped[name],
            )
    report.sort(key=order.__getitem__)
    return report
