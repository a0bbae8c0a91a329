"""Packed variable-length prefill attention: causal for text, bidirectional inside an image's span.

Sequences are packed along the token axis. Sequence i has keys k[cu_seqlens_k[i]:cu_seqlens_k[i+1]]
(its cached prefix and this chunk) and queries q[cu_seqlens_q[i]:cu_seqlens_q[i+1]], which are its
LAST positions: query j of a sequence with Lq queries and Lk keys sits at key position Lk - Lq + j.
`spans` (optional, per key, int32): -1 for text, else an id shared by the tokens of one image; a
query also sees later keys of its own image (as Gemma-3 and LLaVA-style bidirectional image
prefill do). Without spans the mask is plain causal.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import dot_precision, tl, triton


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Tq, H, D]; k, v [Tk, kv_heads, D]; cu_seqlens_* [B + 1] int32. Returns [Tq, H, D]."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0:
            continue
        lq, lk = q1 - q0, k1 - k0
        key_pos = torch.arange(lk, device=q.device)
        query_pos = key_pos[lk - lq :]
        allowed = key_pos[None, :] <= query_pos[:, None]
        if spans is not None:
            own = spans[k0:k1]
            allowed |= (own[lk - lq :, None] == own[None, :]) & (own[None, :] >= 0)
        out[q0:q1] = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out


# Rows per program (queries x the query heads of one KV head) and keys per tile.
BLOCK_ROWS = 128
BLOCK_N = 64


if triton is not None:

    @triton.jit
    def _attend_tile(
        q,
        q_pos,
        q_span,
        m_i,
        l_i,
        acc,
        k_ptr,
        v_ptr,
        spans_ptr,
        k0,
        lk,
        kv_head,
        start,
        qk_scale,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        DIM: tl.constexpr,
        HAS_SPANS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One online-softmax step over keys [start, start + BLOCK_N) of the sequence."""
        pos = start + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        in_seq = pos < lk
        tile_mask = in_seq[:, None] & (d < DIM)[None, :]
        token = (k0 + pos).to(tl.int64)
        k = tl.load(k_ptr + token[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_ptr + token[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=tile_mask, other=0.0)
        allowed = pos[None, :] <= q_pos[:, None]
        if HAS_SPANS:
            k_span = tl.load(spans_ptr + k0 + pos, mask=in_seq, other=-1)
            allowed = allowed | ((q_span[:, None] == k_span[None, :]) & (k_span[None, :] >= 0))
        allowed = allowed & in_seq[None, :]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(allowed, s, float("-inf"))
        # A row may see nothing in a tile past its causal end; m_i is already finite by then.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        cu_q_ptr,
        cu_k_ptr,
        spans_ptr,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        HAS_SPANS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (query block, sequence, KV head). Row r is query r // BLOCK_G of the block and query head
        r % BLOCK_G of the KV head's group, so every key tile is loaded once for the whole group."""
        block, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q0 = tl.load(cu_q_ptr + seq)
        lq = tl.load(cu_q_ptr + seq + 1) - q0
        k0 = tl.load(cu_k_ptr + seq)
        lk = tl.load(cu_k_ptr + seq + 1) - k0
        if block * BLOCK_M >= lq:
            return
        rows = tl.arange(0, BLOCK_M * BLOCK_G)
        i = block * BLOCK_M + rows // BLOCK_G
        g = rows % BLOCK_G
        real = (i < lq) & (g < GROUP)
        d = tl.arange(0, BLOCK_D)
        row_mask = real[:, None] & (d < DIM)[None, :]
        token = (q0 + i).to(tl.int64)
        head = kv_head * GROUP + g
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0
        )
        q_pos = lk - lq + i  # queries are the sequence's last positions
        q_span = tl.full([BLOCK_M * BLOCK_G], -1, tl.int32)
        if HAS_SPANS:
            q_span = tl.load(spans_ptr + k0 + q_pos, mask=real, other=-1)
        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        # Causal part: every key up to the block's last query (key 0 keeps each row's max finite).
        causal_end = tl.minimum(lk - lq + (block + 1) * BLOCK_M, lk)
        for start in range(0, causal_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                q_pos,
                q_span,
                m_i,
                l_i,
                acc,
                k_ptr,
                v_ptr,
                spans_ptr,
                k0,
                lk,
                kv_head,
                start,
                qk_scale,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                DIM,
                HAS_SPANS,
                BLOCK_D,
                BLOCK_N,
                PRECISION,
            )
        if HAS_SPANS:
            # Later keys of a query's own image are visible too: visit the tiles past the causal end
            # that hold one (a tile's spans are cheap to read next to its keys and values).
            for start in range(tl.cdiv(causal_end, BLOCK_N) * BLOCK_N, lk, BLOCK_N):
                k_span = tl.load(
                    spans_ptr + k0 + start + tl.arange(0, BLOCK_N), mask=start + tl.arange(0, BLOCK_N) < lk, other=-1
                )
                shared = (q_span[:, None] == k_span[None, :]) & (k_span[None, :] >= 0) & real[:, None]
                if tl.max(shared.to(tl.int32)) > 0:
                    m_i, l_i, acc = _attend_tile(
                        q,
                        q_pos,
                        q_span,
                        m_i,
                        l_i,
                        acc,
                        k_ptr,
                        v_ptr,
                        spans_ptr,
                        k0,
                        lk,
                        kv_head,
                        start,
                        qk_scale,
                        stride_kt,
                        stride_kh,
                        stride_vt,
                        stride_vh,
                        DIM,
                        HAS_SPANS,
                        BLOCK_D,
                        BLOCK_N,
                        PRECISION,
                    )
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_mask,
        )

    def prefill_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        scale: float,
        spans: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Triton version of prefill_attention_reference."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        group = heads // kv_heads
        block_g = triton.next_power_of_2(group)
        block_m = max(1, BLOCK_ROWS // block_g)
        longest = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host sync, for the grid
        grid = (triton.cdiv(longest, block_m), len(cu_seqlens_q) - 1, kv_heads)
        spans_arg = spans.to(torch.int32).contiguous() if spans is not None else cu_seqlens_k
        _prefill_kernel[grid](
            q,
            k,
            v,
            out,
            cu_seqlens_q,
            cu_seqlens_k,
            spans_arg,
            scale * math.log2(math.e),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            GROUP=group,
            DIM=dim,
            HAS_SPANS=spans is not None,
            BLOCK_M=block_m,
            BLOCK_G=block_g,
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_N=BLOCK_N,
            PRECISION=dot_precision(q.dtype),
        )
        return out
