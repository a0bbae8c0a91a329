"""The embedded inference engine (cf. nano-vllm): paged KV cache with prefix caching, continuous
batching with chunked prefill and preemption, sampling, and the Triton kernels on CUDA."""

from .llm import LLM, Completion, StepOutput
from .sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "StepOutput"]
