"""What every Triton kernel file here shares: the guarded import and the dot-product precision."""

from __future__ import annotations

import torch

try:  # the package imports without triton; the engine then uses the references
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def dot_precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 inputs (Triton would use TF32); half types use tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"
