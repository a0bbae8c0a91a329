"""The Triton kernels against their plain-torch references on a CUDA GPU, at realistic shapes.

SmolLM2-135M attention (9 query heads, 3 KV heads, head_dim 64) over a paged cache, and a DSA
indexer of 4 heads x 32 with top-k 64. Each kernel is checked against its reference, then both are
timed with CUDA events; prints milliseconds and the speed-up. Exits 1 on a mismatch; without CUDA it
says so and exits 0.

    python benchmarks/kernels_gpu.py [--dtype bf16] [--block-size 256] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys

import torch

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
INDEX_HEADS, INDEX_DIM, TOP_K = 4, 32, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def milliseconds(fn, iters: int) -> float:
    """Median of `iters` timed calls after two warm-up calls (the first compiles the kernel)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class Paged:
    """A paged cache holding `lengths` tokens per sequence, in shuffled blocks."""

    def __init__(self, lengths: list[int], block_size: int, dtype: torch.dtype, gen: torch.Generator):
        self.block_size = block_size
        width = max(-(-n // block_size) for n in lengths)
        num_blocks = sum(-(-n // block_size) for n in lengths)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
        for row, n in enumerate(lengths):
            for slot in range(-(-n // block_size)):
                self.tables[row, slot] = free.pop()
        self.tables = self.tables.cuda()
        shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen).to("cuda", dtype)
        self.v = torch.randn(shape, generator=gen).to("cuda", dtype)
        self.index_k = torch.randn(num_blocks, block_size, INDEX_DIM, generator=gen).to("cuda", dtype)


def check(name: str, triton_fn, reference_fn, atol: float, iters: int) -> bool:
    out, expected = triton_fn(), reference_fn()
    finite = expected.isfinite()
    same_inf = torch.equal(finite, out.isfinite())
    error = (out[finite].float() - expected[finite].float()).abs().max().item() if finite.any() else 0.0
    ok = same_inf and error <= atol
    fast, slow = milliseconds(triton_fn, iters), milliseconds(reference_fn, iters)
    verdict = "ok" if ok else f"MISMATCH (atol {atol:g}{'' if same_inf else ', -inf pattern differs'})"
    print(
        f"{name:<40} triton {fast:8.3f} ms  reference {slow:8.3f} ms  x{slow / fast:6.1f}  "
        f"max err {error:.2e}  {verdict}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--block-size", type=int, default=256, help="tokens per KV-cache block")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the Triton kernels run on CUDA only, nothing to benchmark")
        return 0
    from surgeon.kernels import paged_attention, prefill_attention, sparse_attention

    if not hasattr(paged_attention, "paged_decode_attention"):
        print("triton is not installed: nothing to benchmark")
        return 0
    dtype = DTYPES[args.dtype]
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    gen = torch.Generator().manual_seed(0)
    scale, index_scale = HEAD_DIM**-0.5, INDEX_DIM**-0.5
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, "
        f"cache blocks of {args.block_size}"
    )
    ok = True

    # Decode: 64 sequences of 100 to 4,000 tokens, one query each.
    lengths = torch.randint(100, 4000, (64,), generator=gen).tolist()
    cache = Paged(lengths, args.block_size, dtype, gen)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
    context = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    decode_args = (q, cache.k, cache.v, cache.tables, context, scale)
    ok &= check(
        "paged decode (64 seqs, <=4k ctx)",
        lambda: paged_attention.paged_decode_attention(*decode_args),
        lambda: paged_attention.paged_decode_attention_reference(*decode_args),
        atol,
        args.iters,
    )

    # Prefill: 8 chunks of 512 tokens after cached prefixes of 0 to 1,536, each with a 256-token image.
    prefixes = [0, 512, 1024, 1536, 0, 256, 768, 1280]
    chunk, image = 512, 256
    cu_q = torch.tensor([i * chunk for i in range(len(prefixes) + 1)], dtype=torch.int32)
    cu_k = torch.tensor(
        [0] + [sum(p + chunk for p in prefixes[: i + 1]) for i in range(len(prefixes))], dtype=torch.int32
    )
    spans = torch.full((int(cu_k[-1]),), -1, dtype=torch.int32)
    for i, prefix in enumerate(prefixes):
        start = int(cu_k[i]) + prefix + 100  # the image starts inside this chunk
        spans[start : start + image] = i
    qp = torch.randn(int(cu_q[-1]), HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
    kp = torch.randn(int(cu_k[-1]), KV_HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
    vp = torch.randn(int(cu_k[-1]), KV_HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
    for label, image_spans in (("causal", None), ("image spans", spans.cuda())):
        prefill_args = (qp, kp, vp, cu_q.cuda(), cu_k.cuda(), scale, image_spans)
        ok &= check(
            f"prefill (8 x 512, {label})",
            lambda args=prefill_args: prefill_attention.prefill_attention(*args),
            lambda args=prefill_args: prefill_attention.prefill_attention_reference(*args),
            atol,
            args.iters,
        )

    # DSA: indexer scores and top-64 attention, for the decode rows above and for a 2,048-token prefill
    # of the longest cached sequence (row t sees t + 1 keys).
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    prefill_rows = min(2048, lengths[longest])
    cases = {
        "decode rows": (context, cache.tables),
        "prefill rows": (
            torch.arange(1, prefill_rows + 1, dtype=torch.int32, device="cuda"),
            cache.tables[longest : longest + 1].expand(prefill_rows, -1).contiguous(),
        ),
    }
    for label, (visible, tables) in cases.items():
        rows = len(visible)
        index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", dtype)
        weights = torch.randn(rows, INDEX_HEADS, generator=gen).to("cuda", dtype)
        index_args = (index_q, weights, cache.index_k, tables, visible, index_scale)
        scores = sparse_attention.indexer_scores_reference(*index_args)
        tolerance = 1e-3 * max(1.0, scores[scores.isfinite()].abs().max().item())
        ok &= check(
            f"indexer scores ({label})",
            lambda args=index_args: sparse_attention.indexer_scores(*args),
            lambda args=index_args: sparse_attention.indexer_scores_reference(*args),
            tolerance,
            args.iters,
        )
        indices = sparse_attention.select_top_k(scores, visible, TOP_K, sinks=4, window=16)
        qs = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to("cuda", dtype)
        sparse_args = (qs, cache.k, cache.v, tables, indices, scale)
        ok &= check(
            f"sparse attention top-{TOP_K} ({label})",
            lambda args=sparse_args: sparse_attention.sparse_paged_attention(*args),
            lambda args=sparse_args: sparse_attention.sparse_paged_attention_reference(*args),
            atol,
            args.iters,
        )

    print("all kernels match their references" if ok else "MISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
