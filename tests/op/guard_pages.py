"""Inputs that end against a page no process may touch: a kernel that loads or stores past the
end of x, the residual, the weight, dy or dh, of the backward's scratch buffers (dw's partial
sums) or of an output the op allocates, stops the process (SIGSEGV) instead of reading
whatever lies there. Such a read changes no value a test can see where the kernel masks it away
later (dx's and dw's stores are masked), but on a GPU it is a read past an allocation, which
faults where the allocation ends a mapped range.

Run as ``TRITON_INTERPRET=1 python -m tests.op.guard_pages N [N ...]`` from the repository root
(tests/op/test_kill_paths.py does, one process for every path): the interpreter loads and stores
through the tensors' own addresses, so the guard page sees every access. Each case is printed
before it runs, so a crash names the case. Linux and macOS (mmap, mprotect)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

PROT_NONE = 0
_KEEP: list = []  # the mappings stay alive as long as the process


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def against_guard_page(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose last byte is the last before an inaccessible page."""
    nbytes = t.numel() * t.element_size()
    page = mmap.PAGESIZE
    pages = -(-nbytes // page) + 1
    region = mmap.mmap(-1, pages * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = _libc()
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(base + (pages - 1) * page, page, PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")
    start = (pages - 1) * page - nbytes
    out = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=start).view(t.shape)
    out.copy_(t)
    _KEEP.append(region)
    return out


def run_case(m: int, n: int, residual: bool) -> None:
    """Forward and backward of (m, n) fp32 with every input against a guard page (the residual
    and a gradient at h as well with ``residual``); the results against float64 torch, so a
    guarded run is also a correct one."""
    import rmsnorm_kernel

    g = torch.Generator().manual_seed(n)
    x = against_guard_page(0.1 * torch.randn(m, n, generator=g))
    w = against_guard_page(0.5 + torch.rand(n, generator=g))
    dy = against_guard_page(torch.randn(m, n, generator=g))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    if residual:
        res = against_guard_page(0.1 * torch.randn(m, n, generator=g))
        dh = against_guard_page(torch.randn(m, n, generator=g))
        rg = res.detach().requires_grad_()
        y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=1e-2, residual=rg)
        torch.autograd.backward([y, h], [dy, dh])
        xr = (x.double() + res.double()).requires_grad_()
    else:
        y = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=1e-2)
        y.backward(dy)
        xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    yr = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-2) * wr
    if residual:
        torch.autograd.backward([yr, xr], [dy.double(), dh.double()])
    else:
        yr.backward(dy.double())
    torch.testing.assert_close(y.double(), yr.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xg.grad.double(), xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wg.grad.double(), wr.grad, rtol=1e-4, atol=1e-4)


def _guarded(allocate, fill: float):
    """``allocate`` (torch.empty or torch.zeros) of a CPU tensor ending against a guard page,
    filled with ``fill``: the op's outputs (y, h, dx, dw, rstd) and the backward's scratch
    (launch._scratch), so a store past a row's end, or a read past a scratch's, stops the process
    at the last row. Anything else (other devices, other keywords, no elements) as before."""

    def guarded(*size, dtype=None, device=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if kwargs or (device is not None and torch.device(device).type != "cpu") or 0 in shape:
            return allocate(*size, dtype=dtype, device=device, **kwargs)
        return against_guard_page(torch.full(shape, fill, dtype=dtype or torch.get_default_dtype()))

    return guarded


def main(argv: list[str]) -> int:
    # this process only
    torch.empty, torch.zeros = _guarded(torch.empty, float("nan")), _guarded(torch.zeros, 0.0)
    for n in map(int, argv):
        for residual in (False, True):
            print(f"guarded: 2 x {n}, residual {residual}", flush=True)
            run_case(2, n, residual)
    print("guarded: every case ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
