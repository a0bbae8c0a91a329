"""What every Triton kernel file here shares: the guarded import and the dot-product precision.

kernels/ holds Triton kernels, each beside a plain-torch reference with the same signature; the
engine uses the Triton versions on CUDA and the references elsewhere, and tests run every kernel
against its reference under TRITON_INTERPRET=1 on the CPU. It installs as `surgeon.kernels` and has
no __init__.py on purpose: Python started in the checkout's root sees it as a namespace package,
which loses to an installed regular package, so PyPI's `kernels` (which transformers imports) wins.
"""

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
