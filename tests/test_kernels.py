"""Triton kernels against their plain-torch references, under the Triton interpreter on the CPU; and
the references against naive loops, so a wrong reference cannot pass by agreeing with a wrong kernel.

Small shapes, also with small block sizes (the modules' constants, swapped for one check), so several
tiles, partitions and query blocks are crossed: that is where an online softmax or a mask goes wrong.

Why the kernel checks run in a child process: Triton reads TRITON_INTERPRET when a function is
decorated with @triton.jit, and that includes its own standard library (tl.max, tl.sum, ...) when
`import triton` first runs. In a full pytest run, other test modules are imported first and
transformers imports triton (LlamaForCausalLM does), so setting the variable at the top of this file
comes too late, and setting it in conftest would turn every later Triton kernel in the session into
an interpreted one. So `interpreted_results` runs this file as a script with TRITON_INTERPRET=1 set
before anything is imported; the script runs every check and prints one JSON line of results, and one
test per check reads its entry. To debug one: `TRITON_INTERPRET=1 python tests/test_kernels.py`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import traceback

import pytest
import torch

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed, so the Triton kernels are not checked"
)

SCALE = 0.3
ATOL = {torch.float32: 1e-4, torch.float16: 3e-3}


@contextlib.contextmanager
def block_sizes(module, **sizes: int):
    """Swap a kernel module's block-size constants for one check."""
    previous = {name: getattr(module, name) for name in sizes}
    for name, value in sizes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


def paged_cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, dim)
    return (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))


def shuffled_tables(lengths: list[int], block_size: int, width: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Each sequence gets its blocks from a random permutation (never contiguous); unused slots -1."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for row, length in enumerate(lengths):
        for slot in range(-(-length // block_size)):
            tables[row, slot] = free.pop()
    return tables


def positions(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, ...]: a sequence's first `length` cache rows, read one position at a time."""
    block_size = cache.shape[1]
    return torch.stack([cache[table[p // block_size], p % block_size] for p in range(length)])


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, kv_heads, D], allowed [Lq, Lk]: an explicit softmax per query and head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            logits = [
                SCALE * float(q[i, h].double() @ k[j, kv].double()) if allowed[i, j] else -math.inf
                for j in range(k.shape[0])
            ]
            top = max(logits)
            weights = torch.tensor([math.exp(x - top) for x in logits], dtype=torch.float64)
            out[i, h] = (weights[:, None] * v[:, kv].double()).sum(0) / weights.sum()
    return out


# ---- paged decode -------------------------------------------------------------------------------

DECODE_LENGTHS = [1, 7, 16, 29]  # a single key, a partial block, exactly 4 blocks, 8 blocks with a tail


def decode_case(dtype: torch.dtype, dim: int = 16):
    block_size, num_blocks, heads, kv_heads = 4, 40, 6, 2
    k_cache, v_cache = paged_cache(num_blocks, block_size, kv_heads, dim, dtype, seed=1)
    tables = shuffled_tables(DECODE_LENGTHS, block_size, width=9, num_blocks=num_blocks, seed=2)
    q = torch.randn(len(DECODE_LENGTHS), heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(DECODE_LENGTHS, dtype=torch.int32)


def test_paged_decode_reference_matches_a_naive_loop():
    from surgeon.kernels.paged_attention import paged_decode_attention_reference

    q, k_cache, v_cache, tables, lengths = decode_case(torch.float32)
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, lengths, SCALE)
    for row, length in enumerate(DECODE_LENGTHS):
        k, v = positions(k_cache, tables[row], length), positions(v_cache, tables[row], length)
        expected = naive_attention(q[row : row + 1], k, v, torch.ones(1, length, dtype=torch.bool))
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=1e-5, rtol=0)


def check_paged_decode(dtype: torch.dtype, small_tiles: bool):
    from surgeon.kernels import paged_attention as paged

    # 8-key partitions of 4-key tiles: the longest sequence crosses 4 partitions.
    with block_sizes(paged, **(dict(PARTITION=8, BLOCK_N=4) if small_tiles else {})):
        case = decode_case(dtype, dim=24)  # head_dim not a power of two: padded lanes must stay out
        out = paged.paged_decode_attention(*case, SCALE)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged.paged_decode_attention_reference(*case, SCALE), atol=ATOL[dtype], rtol=0)


# ---- prefill ------------------------------------------------------------------------------------

# (queries, keys) per sequence: a whole prompt, one query after a cached prefix, a chunk after a
# prefix, a prompt that starts with an image, and a sequence with nothing to prefill in this step.
PREFILL_SHAPES = [(5, 5), (1, 9), (20, 37), (13, 13), (0, 6)]


def prefill_case(dtype: torch.dtype, with_spans: bool):
    heads, kv_heads, dim = 6, 2, 16
    generator = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, *itertools.accumulate(lq for lq, _ in PREFILL_SHAPES)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk for _, lk in PREFILL_SHAPES)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=generator).to(dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=generator).to(dtype)
    spans = None
    if with_spans:
        spans = torch.full((int(cu_k[-1]),), -1, dtype=torch.int32)
        start = int(cu_k[2])
        spans[start + 10 : start + 25] = 0  # an image that straddles the cached prefix and the chunk
        spans[start + 28 : start + 35] = 1  # an image inside the chunk, longer than a query block
        spans[int(cu_k[3]) : int(cu_k[3]) + 6] = 0  # ids repeat across sequences: they are per sequence
    return q, k, v, cu_q, cu_k, SCALE, spans


def test_prefill_reference_matches_a_naive_loop():
    from surgeon.kernels.prefill_attention import prefill_attention_reference

    q, k, v, cu_q, cu_k, scale, spans = prefill_case(torch.float32, with_spans=True)
    out = prefill_attention_reference(q, k, v, cu_q, cu_k, scale, spans)
    assert not torch.allclose(out, prefill_attention_reference(q, k, v, cu_q, cu_k, scale), atol=1e-3), (
        "the spans must change the result, or this case checks nothing about them"
    )
    for i, (lq, lk) in enumerate(PREFILL_SHAPES):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        own = spans[k0 : k0 + lk].tolist()
        allowed = torch.tensor(
            [
                [key <= lk - lq + j or (own[key] >= 0 and own[key] == own[lk - lq + j]) for key in range(lk)]
                for j in range(lq)
            ]
        )
        expected = naive_attention(q[q0 : q0 + lq], k[k0 : k0 + lk], v[k0 : k0 + lk], allowed)
        torch.testing.assert_close(out[q0 : q0 + lq].double(), expected, atol=1e-5, rtol=0)


def check_prefill(dtype: torch.dtype, small_tiles: bool, with_spans: bool):
    from surgeon.kernels import prefill_attention as prefill

    # 4 queries x 4 head slots per program, 8-key tiles: images reach past a block's causal tiles.
    with block_sizes(prefill, **(dict(BLOCK_ROWS=16, BLOCK_N=8) if small_tiles else {})):
        case = prefill_case(dtype, with_spans)
        out = prefill.prefill_attention(*case)
    assert out.dtype == dtype
    torch.testing.assert_close(out, prefill.prefill_attention_reference(*case), atol=ATOL[dtype], rtol=0)


# ---- sparse attention: indexer scores and attention over selected keys -------------------------

SPARSE_VISIBLE = [1, 5, 13, 22, 9]  # rows of different sequences; the tables are 7 blocks (28) wide


def indexer_case(dtype: torch.dtype):
    block_size, num_blocks, heads, dim = 4, 48, 3, 16
    generator = torch.Generator().manual_seed(5)
    index_q = torch.randn(len(SPARSE_VISIBLE), heads, dim, generator=generator).to(dtype)
    weights = torch.randn(len(SPARSE_VISIBLE), heads, generator=generator).to(dtype)
    index_k_cache = torch.randn(num_blocks, block_size, dim, generator=generator).to(dtype)
    tables = shuffled_tables(SPARSE_VISIBLE, block_size, width=7, num_blocks=num_blocks, seed=6)
    return index_q, weights, index_k_cache, tables, torch.tensor(SPARSE_VISIBLE, dtype=torch.int32), SCALE


def test_indexer_reference_matches_a_naive_loop():
    from surgeon.kernels.sparse_attention import indexer_scores_reference

    index_q, weights, index_k_cache, tables, visible, scale = indexer_case(torch.float32)
    scores = indexer_scores_reference(index_q, weights, index_k_cache, tables, visible, scale)
    assert scores.shape == (len(SPARSE_VISIBLE), max(SPARSE_VISIBLE)) and scores.dtype == torch.float32
    for row, length in enumerate(SPARSE_VISIBLE):
        keys = positions(index_k_cache, tables[row], length)
        for s in range(max(SPARSE_VISIBLE)):
            expected = (
                -math.inf
                if s >= length
                else sum(
                    float(weights[row, h]) * max(0.0, scale * float(index_q[row, h] @ keys[s]))
                    for h in range(index_q.shape[1])
                )
            )
            assert scores[row, s].item() == pytest.approx(expected, abs=1e-5)


def check_indexer(dtype: torch.dtype, small_tiles: bool):
    from surgeon.kernels import sparse_attention as sparse

    with block_sizes(sparse, **(dict(INDEXER_BLOCK_N=8) if small_tiles else {})):
        case = indexer_case(dtype)
        scores, expected = sparse.indexer_scores(*case), sparse.indexer_scores_reference(*case)
    assert scores.dtype == torch.float32 and scores.shape == expected.shape
    assert torch.equal(scores == -math.inf, expected == -math.inf)
    finite = expected.isfinite()
    torch.testing.assert_close(scores[finite], expected[finite], atol=1e-4, rtol=1e-4)


def sparse_case(dtype: torch.dtype):
    """Indices as the engine makes them (select_top_k: -1 padding at the end) plus a row with holes."""
    from surgeon.kernels.sparse_attention import indexer_scores_reference, select_top_k

    block_size, num_blocks, heads, kv_heads, dim = 4, 48, 6, 2, 16
    scores = indexer_scores_reference(*indexer_case(torch.float32))
    indices = select_top_k(scores, torch.tensor(SPARSE_VISIBLE), top_k=6, sinks=1, window=2)
    indices[4] = torch.tensor([-1, -1, 8, 0, -1, 3], dtype=torch.int32)
    assert (indices == -1).any(dim=1).sum() >= 2
    k_cache, v_cache = paged_cache(num_blocks, block_size, kv_heads, dim, dtype, seed=7)
    tables = shuffled_tables(SPARSE_VISIBLE, block_size, width=7, num_blocks=num_blocks, seed=6)
    q = torch.randn(len(SPARSE_VISIBLE), heads, dim, generator=torch.Generator().manual_seed(8)).to(dtype)
    return q, k_cache, v_cache, tables, indices, SCALE


def test_sparse_reference_matches_dense_attention_over_the_chosen_keys():
    from surgeon.kernels.sparse_attention import sparse_paged_attention_reference

    q, k_cache, v_cache, tables, indices, scale = sparse_case(torch.float32)
    out = sparse_paged_attention_reference(q, k_cache, v_cache, tables, indices, scale)
    for row, length in enumerate(SPARSE_VISIBLE):
        allowed = torch.zeros(1, length, dtype=torch.bool)
        allowed[0, [i for i in indices[row].tolist() if i >= 0]] = True
        k, v = positions(k_cache, tables[row], length), positions(v_cache, tables[row], length)
        expected = naive_attention(q[row : row + 1], k, v, allowed)
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=1e-5, rtol=0)


def check_sparse(dtype: torch.dtype, small_tiles: bool):
    from surgeon.kernels import sparse_attention as sparse

    # 2-index tiles: row 4 starts with a tile that selected nothing (max -inf so far).
    with block_sizes(sparse, **(dict(SPARSE_BLOCK_N=2) if small_tiles else {})):
        case = sparse_case(dtype)
        out = sparse.sparse_paged_attention(*case)
    assert out.dtype == dtype
    torch.testing.assert_close(out, sparse.sparse_paged_attention_reference(*case), atol=ATOL[dtype], rtol=0)


def check_sparse_row_that_selected_nothing_reads_zeros():
    from surgeon.kernels import sparse_attention as sparse

    q, k_cache, v_cache, tables, indices, scale = sparse_case(torch.float32)
    indices[2] = -1
    out = sparse.sparse_paged_attention(q, k_cache, v_cache, tables, indices, scale)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and out.isfinite().all()


# ---- the interpreter run ------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # the interpreter's matmul cannot do bf16
TILES = {"small-tiles": True, "default-tiles": False}
CHECKS = {
    **{f"paged_decode[{d}-{t}]": (check_paged_decode, DTYPES[d], TILES[t]) for d in DTYPES for t in TILES},
    **{
        f"prefill[{d}-{t}-{m}]": (check_prefill, DTYPES[d], TILES[t], m == "image-spans")
        for d in DTYPES
        for t in TILES
        for m in ("causal", "image-spans")
    },
    **{f"indexer_scores[{d}-{t}]": (check_indexer, DTYPES[d], TILES[t]) for d in DTYPES for t in TILES},
    **{f"sparse_paged[{d}-{t}]": (check_sparse, DTYPES[d], TILES[t]) for d in DTYPES for t in TILES},
    "sparse_paged[row-selected-nothing]": (check_sparse_row_that_selected_nothing_reads_zeros,),
}


def run_checks() -> dict[str, str]:
    """Every check, in this process: "ok" or the traceback."""
    from triton.runtime.interpreter import InterpretedFunction

    from surgeon.kernels import paged_attention

    if not isinstance(paged_attention._paged_decode_kernel, InterpretedFunction):
        return dict.fromkeys(CHECKS, "TRITON_INTERPRET=1 did not take effect: the kernels are compiled")
    results = {}
    for name, (check, *args) in CHECKS.items():
        try:
            check(*args)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernel_matches_reference_under_interpreter(interpreted_results, name):
    assert interpreted_results[name] == "ok", interpreted_results[name]


# ---- packaging ----------------------------------------------------------------------------------


def test_kernel_modules_import_without_triton():
    """A machine without triton keeps the references and simply lacks the Triton versions."""
    probe = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import surgeon.kernels.paged_attention as a, surgeon.kernels.prefill_attention as b, "
        "surgeon.kernels.sparse_attention as c\n"
        "assert a.paged_decode_attention_reference and not hasattr(a, 'paged_decode_attention')\n"
        "assert not hasattr(b, 'prefill_attention') and not hasattr(c, 'indexer_scores')\n"
        "assert not hasattr(c, 'sparse_paged_attention') and c.select_top_k"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


if __name__ == "__main__":
    print(json.dumps(run_checks()))
