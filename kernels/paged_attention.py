"""Decode attention over a paged KV cache (one new query token per sequence, GQA).

Cache layout, shared by every kernel here: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
a sequence's position p lives in block block_tables[seq, p // block_size] at row p % block_size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import dot_precision, tl, triton


def key_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] cache slots (block * block_size + row) of positions 0..S-1 of each sequence, S the
    longest context rounded up to `multiple`, and the [B, 1, 1, S] mask of those that exist."""
    longest = int(context_lens.max())
    span = -(-longest // multiple) * multiple
    blocks = -(-span // block_size)
    rows = torch.arange(block_size, device=block_tables.device)
    table = block_tables[:, :blocks].long().clamp_min(0)
    table = F.pad(table, (0, blocks - table.shape[1]))  # padding past the table reads block 0, masked
    # contiguous: a slice's strides depend on whether `span` fills its last block, and
    # torch.compile guards on them, so each case compiled a graph of its own
    slots = (table[:, :, None] * block_size + rows).flatten(1)[:, :span].contiguous()
    seen = torch.arange(span, device=block_tables.device)[None, :] < context_lens[:, None].to(block_tables.device)
    return slots, seen[:, None, None]


def decode_attention_by_slots(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    query_rows: torch.Tensor | None = None,
    row_invariant: bool = False,
) -> torch.Tensor:
    """The reference's arithmetic from precomputed `key_slots` (the CPU engine builds them once per
    step, not once per layer): one fused call, [B, H, C, D] queries over [B, kv_heads, S, D] keys.
    C is 1 for decoding; for a speculative verification `query_rows` places each of the T tokens in
    a [B * C] grid (its sequence, its row) and `mask` [B, 1, C, S] says which keys each row sees.
    `row_invariant`: each row's result bit for bit the same whatever B and C are (see
    `attention_by_reduction`)."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    flat = slots.flatten()
    # index_select over a flat index, not advanced indexing with the [B, S] one: the same rows, copied
    # 1.5x (fp32) to 3.7x (bf16) faster on a CPU, where this gather is most of a batched decode step.
    # Row-invariant, into buffers of their own: fused into the reductions, the gather made them 2-4x
    # slower (measured at 448 keys).
    gather = gather_rows if row_invariant else _index_select
    k = gather(k_cache.view(-1, kv_heads, dim), flat).view(*slots.shape, kv_heads, dim).transpose(1, 2)
    v = gather(v_cache.view(-1, kv_heads, dim), flat).view(*slots.shape, kv_heads, dim).transpose(1, 2)
    attend = attention_by_reduction if row_invariant else _sdpa
    if query_rows is None:
        return attend(q[:, :, None], k, v, mask, scale)[:, :, 0]
    batch, rows = slots.shape[0], mask.shape[2]
    grid = q.new_zeros(batch * rows, *q.shape[1:]).index_copy_(0, query_rows, q)
    grid = grid.view(batch, rows, *q.shape[1:]).transpose(1, 2)
    out = attend(grid, k, v, mask, scale)
    return out.transpose(1, 2).reshape(batch * rows, *q.shape[1:]).index_select(0, query_rows)


def _index_select(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return source.index_select(0, index)


@torch.library.custom_op("surgeon::gather_rows", mutates_args=())
def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source.index_select(0, index), as an op torch.compile runs as it is: its result is a buffer
    of its own, never recomputed inside the kernels that read it."""
    return source.index_select(0, index)


@gather_rows.register_fake
def _(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return source.new_empty(index.shape[0], *source.shape[1:])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention_by_reduction(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, C, D] over k, v [B, kv_heads, S, D] under mask [B, 1, C, S], as elementwise products
    and sums rather than matmuls. A matmul's kernel, and so the order it sums in, depends on how
    many rows it has: one query row (a decode step) and five (a verification of four draft tokens)
    round differently, which is enough to flip a greedy near-tie. Compiled, these sums run one row
    at a time in an order set by the row's own length, so a row's result does not depend on the rows
    beside it (keys padded to a whole vector width, masked, add exact zeros). For torch.compile:
    eagerly each product is materialised. The price, compiled, 9 heads over 448 keys, per layer: one
    query row as fast as SDPA (0.40 ms), a verification's five rows 0.67 ms against 0.30."""
    batch, heads, rows, dim = q.shape
    kv_heads = k.shape[1]
    q = q.view(batch, kv_heads, heads // kv_heads, rows, 1, dim)
    scores = (q * k[:, :, None, None]).sum(-1) * scale  # [B, kv_heads, group, C, S]
    weights = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    out = (weights[..., None] * v[:, :, None, None]).sum(-2)  # [B, kv_heads, group, C, D]
    return out.reshape(batch, heads, rows, dim)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; block_tables [B, max_blocks] int32 (unused slots any value); context_lens [B] int32,
    the keys each query sees (its own included). Returns [B, H, D]; query head h reads KV head
    h // (H / kv_heads)."""
    slots, mask = key_slots(block_tables, context_lens, k_cache.shape[1])
    return decode_attention_by_slots(q, k_cache, v_cache, slots, mask, scale)


# Keys per partition (flash-decoding split) and per tile. Partitions let a few long sequences fill
# the GPU; their count comes from the block table's width, so a launch never waits on the host.
PARTITION = 512
BLOCK_N = 64


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_tb,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PARTITION: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (sequence, KV head, partition): all GROUP query heads of that KV head at once, so each
        key and value is loaded once. Writes the partition's unnormalised output, sum and max (base 2)."""
        seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_parts = tl.num_programs(2)
        length = tl.load(lens_ptr + seq)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=(g < GROUP)[:, None] & (d < DIM)[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        end = tl.minimum((part + 1) * PARTITION, length)
        # Every tile starts below `length`, so it holds a visible key and m_i stays finite.
        for start in range(part * PARTITION, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            seen = pos < end
            page = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=seen, other=0)
            page = tl.maximum(page, 0).to(tl.int64)
            row = pos % BLOCK_SIZE
            tile_mask = seen[:, None] & (d < DIM)[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=tile_mask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=tile_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        stat = (seq * tl.num_programs(1) * GROUP + heads) * num_parts + part  # [B, H, parts]
        tl.store(m_ptr + stat, m_i, mask=g < GROUP)
        tl.store(l_ptr + stat, l_i, mask=g < GROUP)
        tl.store(acc_ptr + stat[:, None] * DIM + d[None, :], acc, mask=(g < GROUP)[:, None] & (d < DIM)[None, :])

    def paged_decode_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Triton version of paged_decode_attention_reference (context_lens >= 1)."""
        batch, heads, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need contiguous head_dim"
        q, block_tables = q.contiguous(), block_tables.contiguous()
        parts = triton.cdiv(block_tables.shape[1] * block_size, PARTITION)
        m = q.new_empty(batch, heads, parts, dtype=torch.float32)
        sums = torch.empty_like(m)
        acc = q.new_empty(batch, heads, parts, dim, dtype=torch.float32)
        group = heads // kv_heads
        _paged_decode_kernel[(batch, kv_heads, parts)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            m,
            sums,
            acc,
            scale * math.log2(math.e),
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            GROUP=group,
            DIM=dim,
            BLOCK_SIZE=block_size,
            PARTITION=PARTITION,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_N=BLOCK_N,
            PRECISION=dot_precision(q.dtype),
        )
        # Merge partitions: rescale each to the common max; empty ones (m = -inf) weigh nothing.
        weight = torch.exp2(m - m.amax(-1, keepdim=True))
        out = (acc * weight[..., None]).sum(2) / (sums * weight).sum(2)[..., None]
        return out.to(q.dtype)
