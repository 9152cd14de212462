"""Where the quantised forward's time goes (docs/performance-notes.md, journal, 2026-12-05):
quant_tile at 32768x4096 bf16 under its production plan and under other warps, rows per program
and store widths, and with the division replaced by a reciprocal multiply (with and without one
FMA correction); each variant's time beside a copy of the same size, and its y_q against
production's, byte for byte. Needs CUDA. Usage: PYTHONPATH=src python tools/quant_sweep.py"""

import importlib.util
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

import rmsnorm_kernel
from rmsnorm_kernel import launch, quant

M, N, EPS, STATIC_SCALE = 32768, 4096, 1e-6, 0.05
DIVISION = "    v = tl.div_rn(y, scale)\n"
ARITHMETIC = {  # name -> what replaces quant._quantise's division
    "mul": "    v = y * tl.div_rn(1.0, scale)\n",
    "fma": "    r = tl.div_rn(1.0, scale)\n    q0 = y * r\n    e = tl.fma(-q0, scale, y)\n    v = tl.fma(e, r, q0)\n",
}
# (warps, rows per program, STORE_VEC); None: production's plan
PLANS = (None, (4, 1, 4), (8, 1, 4), (4, 2, 4), (8, 2, 4), (16, 4, 4), (4, 1, 16), (8, 1, 16), (2, 1, 16))
NAMES = "HAS_WEIGHT HAS_RESIDUAL CASTING BLOCK_N ROWS DYNAMIC SCALE_PTR HAS_UB INT8 QMIN QMAX RECIPROCAL STORE_VEC"


def variant_module(folder: Path, name: str, text: str):
    """quant.py with its division replaced by ``text``, imported as a module of its own."""
    source = Path(quant.__file__).read_text()
    assert DIVISION in source, "quant._quantise no longer divides as this tool expects"
    path = folder / f"quant_{name}.py"
    path.write_text(source.replace(DIVISION, text))
    spec = importlib.util.spec_from_file_location(f"quant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def microseconds(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    scales = torch.exp(torch.randn(M, 1, device="cuda", generator=g) * 2)  # rows at log-normal scales
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g) * scales
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    src = torch.empty(M * N * 3 // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = microseconds(lambda: dst.copy_(src))
    ceiling = 2 * src.numel() / (copy * 1e-6)
    print(f"copy of {src.numel() / 2**20:.0f} MiB: {copy:.1f} us, ceiling {ceiling / 1e12:.2f} TB/s")
    for out in (torch.bfloat16, torch.float32):
        t = microseconds(lambda: rmsnorm_kernel.rms_norm(x, weight=w, out_dtype=out))
        print(
            f"plain forward, {out} out: {t:.1f} us, {x.numel() * (2 + out.itemsize) / (t * 1e-6) / ceiling:.1%}"
        )
    with tempfile.TemporaryDirectory() as folder:
        modules = {"div": quant, **{k: variant_module(Path(folder), k, v) for k, v in ARITHMETIC.items()}}
        for out, dynamic in ((torch.float8_e4m3fn, True), (torch.int8, True), (torch.float8_e4m3fn, False)):
            sweep(modules, x, w, out, dynamic, ceiling)


def sweep(modules, x, w, out, dynamic, ceiling) -> None:
    plan = quant._plan(N, True, False, 0, dynamic, False, False, out, True, True, False)
    production = dict(zip(NAMES.split(), plan.constexprs))
    ref_y, ref_s, _ = quant.forward(
        x, w, None, EPS, 0.0, 0, out, None, None if dynamic else STATIC_SCALE, None, (M, N)
    )
    moved = x.numel() * 3 + (M * 4 if dynamic else 0)  # x read, y_q and the scales written
    print(
        f"== {out}, {'per-token' if dynamic else 'static'} scale; production: {plan.num_warps} warps, {production}"
    )
    for arithmetic, module in modules.items():
        launcher = launch.Launcher(module.quant_tile, 7)
        for choice in PLANS if arithmetic == "div" else (None, (8, 1, 4)):
            warps, rows, vec = choice or (plan.num_warps, production["ROWS"], production["STORE_VEC"])
            constexprs = tuple(dict(production, ROWS=rows, STORE_VEC=vec)[k] for k in NAMES.split())
            y = torch.empty(M, N, dtype=out, device="cuda")
            s = torch.empty(M, 1, dtype=torch.float32, device="cuda")
            args = (x, x, w, y, x, x, s, M, N, N, N, EPS, 0.0, STATIC_SCALE, quant.QMAX_INV[out], 1.0,
                    quant._MIN_SCALE[out])  # fmt: skip
            grid = ((M + rows - 1) // rows, 1, 1)

            def call(launcher=launcher, grid=grid, args=args, warps=warps, constexprs=constexprs):
                launcher(grid, args, warps, constexprs)

            call()
            differ = (y.view(torch.uint8) != ref_y.view(torch.uint8)).sum().item()
            same = differ == 0 and (not dynamic or torch.equal(s, ref_s))
            t = microseconds(call)
            print(f"  {arithmetic:4} warps {warps:2} rows {rows} vec {vec:2}: {t:7.1f} us "
                  f"{moved / (t * 1e-6) / ceiling:6.1%}  same bits {same} ({differ} codes differ)")  # fmt: skip


if __name__ == "__main__":
    main()
