"""Triton kernels, each beside a plain-torch reference with the same signature.

Installed as `surgeon.kernels` (never as a top-level `kernels`, which is a PyPI package that
transformers probes for). The engine uses the Triton versions on CUDA and the references elsewhere;
tests run every kernel against its reference under TRITON_INTERPRET=1 on the CPU.
"""
