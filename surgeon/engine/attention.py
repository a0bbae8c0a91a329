"""Which attention implementation a step uses: the Triton kernels on CUDA, their torch references
(vectorised, fine for a CPU) elsewhere. One place, so the model file reads as plain math."""

from __future__ import annotations

import torch

from ..kernels import paged_attention, prefill_attention, sparse_attention
from .batch import StepBatch


def _pick(module, name: str, tensor: torch.Tensor):
    fast = getattr(module, name, None)
    if tensor.is_cuda and fast is not None:
        return fast
    return getattr(module, f"{name}_reference")


def dense_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; this step's keys/values are already in the cache."""
    if not batch.prefill and batch.key_slots is not None:
        # Off CUDA: the reference's arithmetic, its gather indices built once per step.
        return paged_attention.decode_attention_by_slots(
            q, k_cache, v_cache, batch.key_slots, batch.key_mask, scale, batch.query_rows, batch.row_invariant
        )
    if not batch.prefill:
        run = _pick(paged_attention, "paged_decode_attention", q)
        return run(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, heads, dim).index_select(0, batch.context_slots)
    v = v_cache.view(-1, heads, dim).index_select(0, batch.context_slots)
    run = _pick(prefill_attention, "prefill_attention", q)
    return run(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, scale, batch.spans)


def sparse_topk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    index_cache: torch.Tensor,
    batch: StepBatch,
    scale: float,
    index_scale: float,
    top_k: int,
    sinks: int,
    window: int,
) -> torch.Tensor:
    """DSA: indexer scores over every visible key, top-k per query, attention over those keys only."""
    tables = batch.block_tables[batch.token_rows]
    visible = (batch.positions + 1).to(torch.int32)
    score = _pick(sparse_attention, "indexer_scores", q)
    scores = score(index_q, index_weights, index_cache, tables, visible, index_scale)
    chosen = sparse_attention.select_top_k(scores, visible, top_k, sinks, window)
    attend = _pick(sparse_attention, "sparse_paged_attention", q)
    return attend(q, k_cache, v_cache, tables, chosen, scale)
