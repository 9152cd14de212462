"""Dump the Triton kernels torch.compile generates for the reference RMSNorm at three large bf16
shapes (development: how Inductor walks a row). Usage: python tools/inductor_code.py OUT_DIR"""

import sys

import torch
from torch._inductor.utils import run_and_get_code

from rmsnorm_kernel.reference import rms_norm_reference

for m, n in [(16384, 8192), (32768, 4096), (65536, 1024)]:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda a, b: rms_norm_reference(a, b, 1e-6), dynamic=False)
    _, code = run_and_get_code(compiled, x, w)
    with open(f"{sys.argv[1]}/inductor_{m}x{n}.py", "w") as f:
        f.write("\n".join(code))
