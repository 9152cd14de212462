"""The compiled host path, an accelerator in its own folder: builds and loads ``csrc/host.cpp``
(the operators ``torch.ops.rmsnorm_kernel_host.rms_norm`` and ``.rms_norm_residual``, with
Autograd, CUDA and Meta kernels and a launcher in C++, for the common eager call on CUDA, with or without a residual)
and turns recorded Python launches into their plans.

``RMSNORM_KERNEL_HOST`` chooses: ``auto`` (the default: the compiled path where it builds, else
the Python path with one log line saying why), ``compiled`` (an error where it cannot build) or
``python`` (never build it). The first use on a machine compiles the extension with torch's C++
extension tooling (a C++ compiler and ninja); later processes load the cached build.

Both paths run the same compiled Triton kernels with the same launch parameters: launch.py
chooses them, and the C++ side replays what a recorded Python call launched. This module imports
only downward (contract, launch): ops hands it the Python path's functions (``install``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import struct
import time
from pathlib import Path

import torch

from rmsnorm_kernel import contract, launch

logger = logging.getLogger("rmsnorm_kernel")

ENV = "RMSNORM_KERNEL_HOST"
MODES = ("auto", "compiled", "python")
SOURCE = Path(__file__).with_name("csrc") / "host.cpp"

# torch.dtype <-> c10::ScalarType code, for the dtypes the kernels run (contract.table's codes).
SCALAR_TYPES = dict(zip(contract.KERNEL_DTYPES, contract.table()["dtypes"]))
DTYPES = {code: dtype for dtype, code in SCALAR_TYPES.items()}

# Bytes of each scalar type in a kernel signature, as Triton's launcher passes it.
_INT_BYTES = {"i1": 1, "u1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}
_FLOAT_FORMATS = {"fp32": ("<f", "<I", 4), "f32": ("<f", "<I", 4), "fp64": ("<d", "<Q", 8)}

_UNSET = object()
_extension = _UNSET
# The loaded extension's common_call (rms_norm's first step), None until it loads or where the
# Python path serves: rms_norm reads this attribute on every call.
entry = None
# Called once the extension has loaded (sharding.py's: DTensor's rules for its operators).
on_load: list = []


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def extension():
    """The loaded extension, or None where the Python path serves (``RMSNORM_KERNEL_HOST=python``,
    or the build failed under ``auto``). Built or loaded on the first call, remembered after."""
    global _extension
    if _extension is _UNSET:
        _extension = _load()
    return _extension


def unloaded() -> bool:
    """Whether no call has tried to load the extension yet."""
    return _extension is _UNSET


def entry_after_load():
    """``entry`` once the extension has been loaded (or its load tried): None where the Python
    path serves."""
    extension()
    return entry


def _load():
    chosen = mode()
    if chosen == "python":
        return None
    try:
        ext = _build()
    except Exception as exc:  # noqa: BLE001 - any build or load failure means the Python path
        if chosen == "compiled":
            raise RuntimeError(f"{ENV}=compiled, but the compiled host path cannot be built: {exc}") from exc
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "rmsnorm_kernel: compiled host path unavailable (%s); eager calls take the Python host path "
            "(%s=python skips this attempt)",
            reason[:300],
            ENV,
        )
        return None
    ext.set_callbacks(_plan_forward, _plan_backward, _composite_backward)
    table = contract.table()
    ext.set_contract(table["dtypes"], table["castings"], table["default_eps"])
    global entry
    entry = ext.common_call
    for hook in on_load:
        hook()
    return ext


@contextlib.contextmanager
def python_path(keep_extension: bool = False):
    """Calls inside take the Python host path (the tests and tools/host_paths.py compare them).
    ``keep_extension``: the loaded extension's operators stay, only its C++ entry is off."""
    global _extension, entry
    saved = _extension, entry
    _extension, entry = (_extension if keep_extension else None), None
    try:
        yield
    finally:
        _extension, entry = saved


def _build():
    import triton
    from torch.utils import cpp_extension

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if not (include / "cuda.h").is_file():
        raise RuntimeError(f"this Triton has no cuda.h under {include.name}/")
    # The name changes with the source, torch and Triton: a cached build is always this one's.
    versions = f"{torch.__version__} {triton.__version__}".encode()
    name = f"rmsnorm_kernel_host_{hashlib.sha256(SOURCE.read_bytes() + versions).hexdigest()[:12]}"
    built = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
    if built.exists():  # import it directly: torch's loader would run the build tool to check it
        spec = importlib.util.spec_from_file_location(name, built)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        return ext
    started = time.perf_counter()
    logger.warning("rmsnorm_kernel: building the compiled host path (first use on this machine)...")
    ext = cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_include_paths=[str(include)],
        extra_cflags=["-O2"],
        extra_ldflags=["-ldl"],
        verbose=False,
    )
    logger.warning("rmsnorm_kernel: compiled host path built in %.0f s", time.perf_counter() - started)
    return ext


def counts() -> tuple[int, int]:
    """(forward, backward) calls the compiled path ran without Python (0, 0 where not loaded)."""
    ext = _extension
    return (0, 0) if ext is _UNSET or ext is None else ext.counts()


def reset_counts() -> None:
    ext = _extension
    if ext is not _UNSET and ext is not None:
        ext.reset_counts()


def clear_plans() -> None:
    """Forget every plan (after launch.py's constants change, as tools/tune_sweep.py does)."""
    ext = _extension
    if ext is not _UNSET and ext is not None:
        ext.clear_plans()


# ---------------------------------------------------------------------------------------------
# Plans: what the C++ side replays
# ---------------------------------------------------------------------------------------------


def plan(recording: launch.Recording, slots: list[torch.Tensor | None]) -> tuple | None:
    """The recorded launches as a plan for host.cpp: (scratch, launches), each scratch buffer
    (elements, ScalarType code, zero-filled) and each launch (CUfunction, grid x, y, z, threads,
    shared bytes, cooperative, pdl, params), a param (slot, bytes, bits) with slot -1 for a
    constant. ``slots`` are the call's fixed slots (None where absent); the scratch buffers the
    launches use follow them. None where the launches cannot be replayed from the key alone:
    a pointer that is no slot's start, two slots at one address, a launch this Triton runs
    with more than a function, grid and parameters, or no launch recorded (the interpreter's
    launches are not: a call there always runs the Python path)."""
    if not recording.launches:
        return None
    where: dict[int, int] = {}
    for i, t in enumerate(slots):
        if t is None:
            continue
        if t.data_ptr() in where:
            return None
        where[t.data_ptr()] = i
    scratch_at = {t.data_ptr(): (t, zero) for t, zero in recording.scratch}
    scratch: list[tuple] = []
    launches = []
    for launcher, key, grid, args, constexprs in recording.launches:
        compiled = launcher.kernels.get(key)
        if compiled is None:
            return None
        md = compiled.metadata
        if (
            getattr(md, "num_ctas", 1) != 1
            or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0)
            or compiled.function is None
        ):
            return None
        signature = list(compiled.src.signature.values())
        values = (*args, *constexprs)
        if len(signature) != len(values):
            return None
        params = []
        for value, ty in zip(values, signature):
            if ty == "constexpr":
                continue
            if isinstance(ty, str) and ty.startswith("*"):
                ptr = value.data_ptr()
                if ptr not in where:
                    if ptr not in scratch_at:
                        return None
                    t, zero = scratch_at[ptr]
                    where[ptr] = len(slots) + len(scratch)
                    scratch.append((t.numel(), _scalar_code(t.dtype), zero))
                params.append((where[ptr], 8, 0))
            elif ty in _INT_BYTES:
                size = _INT_BYTES[ty]
                params.append((-1, size, int(value) & ((1 << (8 * size)) - 1)))
            elif ty in _FLOAT_FORMATS:
                pack, unpack, size = _FLOAT_FORMATS[ty]
                params.append((-1, size, struct.unpack(unpack, struct.pack(pack, float(value)))[0]))
            else:
                return None
        launches.append(
            (
                int(compiled.function),
                *grid,
                32 * md.num_warps,
                md.shared,
                bool(getattr(md, "launch_cooperative_grid", False)),
                bool(getattr(md, "launch_pdl", False)),
                params,
            )
        )
    return scratch, launches


def _scalar_code(dtype: torch.dtype) -> int:
    """The c10::ScalarType code of a scratch buffer's dtype."""
    return SCALAR_TYPES.get(dtype) or {torch.int32: 3, torch.int64: 4}[dtype]


# Callbacks of the C++ side, set by ``_load``: a call whose plan is not cached runs the Python
# path (recording its launches where ``record``), and a backward the kernels cannot run takes the
# composite formula. The functions are ops's, handed over by ``install`` (ops imports this module).
_python_path = {}


def install(run_forward, run_backward, composite_backward) -> None:
    _python_path.update(forward=run_forward, backward=run_backward, composite=composite_backward)


def _plan_forward(x, weight, residual, eps, offset, casting, out_dtype, h_dtype, want_rstd, record):
    with launch.record() if record else contextlib.nullcontext() as recording:
        y, rstd, h = _python_path["forward"](
            x, weight, residual, eps, offset, casting, DTYPES[out_dtype], DTYPES[h_dtype], want_rstd
        )
    return y, rstd, h, plan(recording, [x, weight, y, rstd, residual, h]) if record else None


def _plan_backward(dy, dh, xh, weight, rstd, offset, casting, need_dw, dx_dtype, record):
    with launch.record() if record else contextlib.nullcontext() as recording:
        dx, dw = _python_path["backward"](
            dy, dh, xh, weight, rstd, offset, casting, need_dw, DTYPES[dx_dtype]
        )
    return dx, dw, plan(recording, [dy, xh, weight, rstd, dx, dw, dh]) if record else None


def _composite_backward(dy, dh, xh, weight, eps, offset, casting, need_dw, dx_dtype):
    return _python_path["composite"](dy, dh, xh, weight, eps, offset, casting, need_dw, DTYPES[dx_dtype])
