"""rmsnorm-kernel: a Triton RMSNorm for PyTorch with forward, backward, autograd and torch.compile support."""

from rmsnorm_kernel import sharding  # noqa: F401 - DTensor's rules for the operators
from rmsnorm_kernel.module import RMSNorm, swap_rms_norm
from rmsnorm_kernel.ops import CALLS, reset_counters, rms_norm
from rmsnorm_kernel.qknorm import QKNorm, qk_norm

__all__ = ["CALLS", "QKNorm", "RMSNorm", "qk_norm", "reset_counters", "rms_norm", "swap_rms_norm"]
__version__ = "0.1.0"
