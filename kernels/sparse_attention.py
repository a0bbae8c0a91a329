"""DeepSeek-style sparse attention over a paged cache: lightning-indexer scores, top-k selection,
and attention over only the selected positions (decode and prefill alike: one row per query).

Rows are queries; each row carries its sequence's block table and `visible`, the keys it may see
(position + 1, causal). The indexer keeps one key of `index_dim` per token in its own paged cache
[num_blocks, block_size, index_dim], laid out like the KV cache (see paged_attention.py).
Semantics follow surgeon/modeling/sparse_attention.py, the model the engine must reproduce.
"""

from __future__ import annotations

import math

import torch

from .common import dot_precision, tl, triton


def _gather_rows(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[T, length, ...]: the first `length` positions of each row's sequence."""
    block_size = cache.shape[1]
    blocks = -(-length // block_size)
    table = block_tables[:, :blocks].long().clamp_min(0)
    rows = cache[table]
    return rows.reshape(rows.shape[0], blocks * block_size, *cache.shape[2:])[:, :length]


def indexer_scores_reference(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """score(t, s) = sum_h w_th * ReLU(scale * q_th . k_s), fp32.

    index_q [T, heads, dim] (rotary applied); index_weights [T, heads] (any head scaling applied);
    block_tables [T, max_blocks]; visible [T] int32. Returns [T, max(visible)], -inf past each row's
    visible keys."""
    longest = int(visible.max())
    keys = _gather_rows(index_k_cache, block_tables, longest).float()  # [T, S, dim]
    logits = torch.einsum("thd,tsd->ths", index_q.float(), keys) * scale
    scores = (logits.relu() * index_weights.float()[..., None]).sum(dim=1)
    seen = torch.arange(longest, device=scores.device)[None, :] < visible[:, None].to(scores.device)
    return scores.masked_fill(~seen, -math.inf)


def select_top_k(scores: torch.Tensor, visible: torch.Tensor, top_k: int, sinks: int, window: int) -> torch.Tensor:
    """[T, top_k] int32 key positions, -1 where a row sees fewer than top_k keys.

    The first `sinks` keys and the `window` newest are forced in (inside the k budget); ties go to
    the newest key (a stable sort newest-first), so a query picks the same keys however its
    sequence was batched or chunked."""
    rows, keys = scores.shape
    visible = visible.to(scores.device).long()
    key_pos = torch.arange(keys, device=scores.device)[None, :]
    query_pos = visible[:, None] - 1
    forced = (key_pos < sinks) | (query_pos - key_pos < window)
    ranked = scores.masked_fill(forced, math.inf).masked_fill(key_pos >= visible[:, None], -math.inf)
    width = min(top_k, keys)
    order = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[:, :width]
    chosen = keys - 1 - order
    chosen = chosen.masked_fill(torch.gather(ranked, 1, chosen) == -math.inf, -1)
    if width < top_k:
        chosen = torch.cat([chosen, chosen.new_full((rows, top_k - width), -1)], dim=1)
    return chosen.to(torch.int32)


def sparse_paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; block_tables [T, max_blocks]; indices [T, K] key positions, -1 for none.
    Returns [T, H, D]; GQA as in paged_attention.py."""
    rows, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    valid = indices >= 0
    safe = indices.long().clamp_min(0)
    blocks = torch.gather(block_tables.long(), 1, safe // block_size).clamp_min(0)
    slots = blocks * block_size + safe % block_size  # [T, K]
    k = k_cache.reshape(-1, kv_heads, dim)[slots].float()  # [T, K, kv_heads, D]
    v = v_cache.reshape(-1, kv_heads, dim)[slots].float()
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim).float()
    logits = torch.einsum("tkgd,tskd->tkgs", grouped, k) * scale
    probs = logits.masked_fill(~valid[:, None, None], -math.inf).softmax(-1)
    return torch.einsum("tkgs,tskd->tkgd", probs, v).reshape(rows, heads, dim).to(q.dtype)


# Keys per tile, for the indexer's scores and for the attention over selected keys.
INDEXER_BLOCK_N = 64
SPARSE_BLOCK_N = 64


if triton is not None:

    @triton.jit
    def _indexer_kernel(
        q_ptr,
        w_ptr,
        k_ptr,
        tables_ptr,
        visible_ptr,
        out_ptr,
        scale,
        width,
        stride_qt,
        stride_qh,
        stride_wt,
        stride_kb,
        stride_ks,
        stride_tt,
        stride_ot,
        HEADS: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (row, key tile): every indexer head against the tile's keys, ReLU, weighted head sum."""
        row, tile = tl.program_id(0), tl.program_id(1)
        visible = tl.load(visible_ptr + row)
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        seen = pos < visible
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(
            q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :],
            mask=(h < HEADS)[:, None] & (d < DIM)[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + row * stride_wt + h, mask=h < HEADS, other=0.0).to(tl.float32)
        page = tl.load(tables_ptr + row * stride_tt + pos // BLOCK_SIZE, mask=seen, other=0)
        page = tl.maximum(page, 0).to(tl.int64)
        keys = tl.load(
            k_ptr + page[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_ks + d[None, :],
            mask=seen[:, None] & (d < DIM)[None, :],
            other=0.0,
        )
        logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [heads, keys] fp32
        scores = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
        tl.store(out_ptr + row * stride_ot + pos, tl.where(seen, scores, float("-inf")), mask=pos < width)

    def indexer_scores(
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        index_k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Triton version of indexer_scores_reference."""
        rows, heads, dim = index_q.shape
        assert index_k_cache.stride(-1) == 1, "the index-key cache needs contiguous index_dim"
        index_q, index_weights = index_q.contiguous(), index_weights.contiguous()
        block_tables = block_tables.contiguous()
        width = int(visible.max())  # the output's width: one host sync
        out = torch.empty(rows, width, dtype=torch.float32, device=index_q.device)
        grid = (rows, triton.cdiv(width, INDEXER_BLOCK_N))
        _indexer_kernel[grid](
            index_q,
            index_weights,
            index_k_cache,
            block_tables,
            visible,
            out,
            scale,
            width,
            index_q.stride(0),
            index_q.stride(1),
            index_weights.stride(0),
            index_k_cache.stride(0),
            index_k_cache.stride(1),
            block_tables.stride(0),
            out.stride(0),
            HEADS=heads,
            DIM=dim,
            BLOCK_SIZE=index_k_cache.shape[1],
            BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_N=INDEXER_BLOCK_N,
            PRECISION=dot_precision(index_q.dtype),
        )
        return out

    @triton.jit
    def _sparse_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        idx_ptr,
        o_ptr,
        qk_scale,
        top_k,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_tt,
        stride_it,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (row, KV head): the GROUP query heads over the row's selected keys, online softmax."""
        row, kv_head = tl.program_id(0), tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        head_mask = (g < GROUP)[:, None] & (d < DIM)[None, :]
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, top_k, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            index = tl.load(idx_ptr + row * stride_it + j, mask=j < top_k, other=-1)
            chosen = index >= 0
            page = tl.load(tables_ptr + row * stride_tt + index // BLOCK_SIZE, mask=chosen, other=0)
            page = tl.maximum(page, 0).to(tl.int64)
            slot = index % BLOCK_SIZE
            tile_mask = chosen[:, None] & (d < DIM)[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=tile_mask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=tile_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(chosen[None, :], s, float("-inf"))
            # -1 entries may fill a whole tile: subtract 0 instead of -inf so nothing turns NaN.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that selected nothing reads zeros
        tl.store(
            o_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=head_mask,
        )

    def sparse_paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Triton version of sparse_paged_attention_reference (a row of only -1 gives zeros, not NaN)."""
        rows, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need contiguous head_dim"
        q, block_tables, indices = q.contiguous(), block_tables.contiguous(), indices.contiguous()
        out = torch.empty_like(q)
        group = heads // kv_heads
        _sparse_kernel[(rows, kv_heads)](
            q,
            k_cache,
            v_cache,
            block_tables,
            indices,
            out,
            scale * math.log2(math.e),
            indices.shape[1],
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            indices.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=group,
            DIM=dim,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_N=SPARSE_BLOCK_N,
            PRECISION=dot_precision(q.dtype),
        )
        return out
