"""Sparse attention (DSA): the selection rule, the gathered-key reference, the KV cache with the
indexer's keys, the two training stages, and an export plain transformers reloads with remote code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_config
from surgeon.errors import RecipeError
from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM
from surgeon.modeling.sparse_attention import (
    SparseSettings,
    attention_flops,
    select_keys,
    sparse_attention_reference,
    visible_keys,
)
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe


def _sparse_pair(top_k: int, seed: int = 0):
    """A tiny dense Llama and the same weights with sparse attention on every layer."""
    torch.manual_seed(seed)
    config = tiny_config("llama")
    dense = LlamaForCausalLM(config).eval()
    sparse_config = SurgeonSparseLlamaConfig(
        sparse_attention={"top_k": top_k, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8},
        **config.to_dict(),
    )
    sparse = SurgeonSparseLlamaForCausalLM(sparse_config).eval()
    missing, unexpected = sparse.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all(".indexer." in name for name in missing)
    return dense, sparse


def test_selection_keeps_budget_sinks_window_and_causality():
    torch.manual_seed(0)
    length, offset, settings = 12, 20, SparseSettings(top_k=8, sinks=2, window=3)
    keys = offset + length
    scores = torch.randn(2, length, keys)
    visible = visible_keys(None, 2, length, keys, offset, "cpu")
    chosen = select_keys(scores, visible, offset, settings)
    assert not (chosen & ~visible).any()  # causal
    assert (chosen.sum(-1) == 8).all()  # every query here sees more than k keys
    assert chosen[..., :2].all()  # sinks
    for t in range(length):
        assert chosen[:, t, offset + t - 2 : offset + t + 1].all()  # local window, the query itself included
    # The remaining picks are the highest-scoring other keys.
    free = visible & ~chosen
    picked = chosen.clone()
    picked[..., :2] = False
    for t in range(length):
        picked[:, t, offset + t - 2 : offset + t + 1] = False
    worst_picked = scores.masked_fill(~picked, float("inf")).amin(-1)
    best_left = scores.masked_fill(~free, float("-inf")).amax(-1)
    assert (worst_picked >= best_left).all()
    # Short contexts are exactly dense.
    short = visible_keys(None, 1, 6, 6, 0, "cpu")
    assert torch.equal(select_keys(torch.randn(1, 6, 6), short, 0, settings), short)


def test_gathered_reference_equals_masked_attention():
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 10, 8
    q = torch.randn(batch, heads, length, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    visible = visible_keys(None, batch, length, length, 0, "cpu")
    chosen = select_keys(torch.randn(batch, length, length), visible, 0, SparseSettings(top_k=4, sinks=1, window=1))
    indices = torch.full((batch, length, 4), -1)
    for b in range(batch):
        for t in range(length):
            picked = chosen[b, t].nonzero().flatten()
            indices[b, t, : picked.numel()] = picked
    masked = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=chosen[:, None], scale=dim**-0.5
    )
    assert torch.allclose(sparse_attention_reference(q, k, v, indices, dim**-0.5), masked, atol=1e-5)


def test_below_k_the_model_is_exactly_dense():
    dense, sparse = _sparse_pair(top_k=64)
    ids = torch.randint(3, 300, (2, 40))
    with torch.no_grad():
        assert torch.equal(dense(ids).logits, sparse(ids).logits)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decoding_with_the_cache_matches_the_full_forward(attn):
    dense, sparse = _sparse_pair(top_k=8)
    sparse.config._attn_implementation = attn
    ids = torch.randint(3, 300, (2, 40))
    with torch.no_grad():
        full = sparse(ids).logits
        assert (full - dense(ids).logits).abs().max() > 1e-3  # selection really changes the output
        out = sparse(ids[:, :20], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(20, 39):
            out = sparse(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1])
    assert torch.allclose(torch.stack(steps, 1), full[:, 19:39], atol=1e-5)
    assert cache.layers[0].indexer_keys.shape[:2] == (2, 39)


def test_attention_flops_count_every_query_key_pair():
    settings = SparseSettings(top_k=4, sinks=1, window=2)
    dense = attention_flops(10, 1, 2, 8)
    assert dense == 2 * 2 * 2 * 8 * 55  # 55 causal pairs
    read = sum(min(t + 1, 4) for t in range(10))
    assert attention_flops(10, 1, 2, 8, settings, 1, 4) == 2 * 2 * 2 * 8 * read + 2 * 4 * 55
    assert attention_flops(3, 1, 2, 8, settings) == dense * 6 // 55  # shorter than k: dense


def test_the_warm_up_cache_gives_the_live_models_indexer_loss():
    """The warm-up trains on cached dense states instead of running the LM each step: on the same
    windows its loss (and gradient) must be the one the dense model computes live."""
    from surgeon.modeling.sparse_attention import mean_indexer_loss
    from surgeon.training.indexer import _CachedIndexerBody, capture_dense_states, indexer_mode

    _, sparse = _sparse_pair(top_k=4)
    torch.manual_seed(1)
    for name, param in sparse.named_parameters():  # random indexers: the loss far from zero
        if ".indexer.w" in name:
            param.data.normal_(0, 0.5)
    windows = torch.randint(0, sparse.config.vocab_size, (3, 24))
    rows = torch.tensor([2, 0])

    with indexer_mode(sparse, dense=True, loss=True) as modules:
        sparse.model(input_ids=windows[rows], use_cache=False)
        live = mean_indexer_loss(modules)
        live_grad = torch.autograd.grad(live, sparse.model.layers[1].self_attn.indexer.wq.weight)[0]
    assert live.item() > 0.1
    weight = sparse.model.layers[1].self_attn.indexer.wq.weight

    def cached_loss(dtype):  # what a warm-up step backpropagates, layer by layer
        body = _CachedIndexerBody(sparse, capture_dense_states(sparse, windows, dtype))
        return torch.stack([body(rows, layer) for layer in range(len(modules))]).mean()

    exact = cached_loss(torch.float32)
    torch.testing.assert_close(exact, live)
    torch.testing.assert_close(torch.autograd.grad(exact, weight)[0], live_grad)
    # The recipe's bf16 cache: the same loss to about three significant digits.
    torch.testing.assert_close(cached_loss(torch.bfloat16), live, rtol=1e-2, atol=1e-3)


def test_a_warm_up_cache_over_budget_is_refused_at_plan(write_recipe, tiny_llama, text_dir):
    recipe = write_recipe(f"""
        name: big-cache
        base: {tiny_llama}
        steps:
          - sparse_attention:
              top_k: 8
              sinks: 1
              window: 1
              warmup:
                data: {{text: {text_dir / "calibration.txt"}, tokens: 1024, window: 64}}
                steps: 1
                cache_gb: 1.0e-6
        """)
    with pytest.raises(RecipeError, match=r"16 windows of 64 tokens on 6 layers: .* over cache_gb 1e-06") as caught:
        plan_recipe(load_recipe(recipe))
    assert f"{recipe}:11" in str(caught.value)  # the cache_gb line


def _dsa_recipe(write_recipe, base, text_dir, heal_steps: int = 12) -> str:
    data = f"{{text: {text_dir / 'calibration.txt'}, tokens: 1024, window: 64}}"
    heldout = f"{{text: {text_dir / 'heldout.txt'}, tokens: 256, window: 64}}"
    return write_recipe(f"""
        name: tiny-dsa
        base: {base}
        steps:
          - sparse_attention:
              top_k: 16
              sinks: 2
              window: 4
              index_heads: 2
              index_dim: 16
              rope_dim: 8
              recall: {heldout}
              warmup:
                data: {data}
                heldout_windows: 2
                steps: 30
                batch_size: 4
                optimizer: {{lr: 1.0e-2, warmup_steps: 2}}
                eval: {{every: 15}}
          - evaluate: {{data: {heldout}, name: warmed up}}
          - heal:
              data:
                sources: [{{text: {text_dir / "calibration.txt"}}}]
                window: 64
                heldout_windows: 2
              train: {{params: ["model.layers"]}}
              steps: {heal_steps}
              batch_size: 4
              optimizer: {{lr: 3.0e-4, warmup_steps: 2}}
              eval: {{every: 6}}
              precision: fp32
          - evaluate: {{data: {heldout}, name: healed}}
        """)


def test_dsa_recipe_trains_both_stages_and_exports_remote_code(write_recipe, tiny_llama, text_dir, tmp_path):
    recipe = _dsa_recipe(write_recipe, tiny_llama, text_dir)
    plan = plan_recipe(load_recipe(recipe))
    assert "top-16 keys on 6 layers" in plan.rows[1].note and "attention FLOPs saved" in plan.rows[1].note
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    entry = result.report["provenance"][0]
    details = entry["details"]
    init, warmed = details["recall_at_init"], details["recall"]
    assert len(warmed) == 6
    # The warm-up teaches the indexers where the layers attend: more of the attention mass selected.
    assert sum(warmed.values()) > sum(init.values())
    heldout = details["warmup"]["heldout"]
    assert heldout[-1]["indexer_kl"] < heldout[0]["indexer_kl"]
    assert set(details["flops"]) == {"512", "2048", "8192"}
    # Stage 2: the LM healed against the dense parent, the indexers' KL logged beside it.
    heal = next(p for p in result.report["provenance"] if p["op"] == "heal")
    assert all("indexer" in point for point in heal["details"]["curve"])
    # Selection is on while healing: before its first step the LM (the parent's own weights) already
    # differs from its dense parent. (Whether healing closes the gap is measured on SmolLM2: README.)
    assert heal["details"]["heldout"][0]["kl_mean"] > 0.01

    assert "trust_remote_code=True" in (result.target / "README.md").read_text()
    config = json.loads((result.target / "config.json").read_text())
    assert config["model_type"] == "surgeon_sparse_llama" and "AutoModelForCausalLM" in config["auto_map"]
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50] * 3])
    with torch.no_grad():
        expected = result.patient.model(input_ids=ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(result.target)!r}, trust_remote_code=True).eval()
assert "surgeon" not in sys.modules
saved = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
with torch.no_grad():
    assert torch.equal(model(input_ids=saved["ids"]).logits, saved["logits"]), "logits differ"
    out = model.generate(saved["ids"], max_new_tokens=6, do_sample=False)
assert out.shape == (1, saved["ids"].shape[1] + 6), out.shape
print("ok", type(model).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok SurgeonSparseLlamaForCausalLM" in done.stdout

    # Loaded back through Source, the attention modules share model.config, so indexer_mode's switch
    # to eager attention reaches them and recall is measured, not reported as 1.0 for want of probabilities.
    from surgeon.checkpoints.sources import resolve_source
    from surgeon.modeling.sparse_attention import sparse_modules
    from surgeon.training.indexer import measure_recall

    reloaded = resolve_source(str(result.target), tmp_path).load_model()
    assert all(m.config is reloaded.config for m in sparse_modules(reloaded))
    windows = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    want = measure_recall(result.patient.model, windows)
    got = measure_recall(reloaded, windows)
    assert got == pytest.approx(want, abs=1e-5) and min(got.values()) < 0.999


@pytest.mark.parametrize(
    "body, match",
    [
        ("sparse_attention: {top_k: 8, sinks: 4, window: 8}", "exceed top_k"),
        ("sparse_attention: {top_k: 8, rope_dim: 5}", "must be even"),
        ("sparse_attention: {layers: [9]}", "out of range"),
    ],
)
def test_bad_sparse_parameters(write_recipe, tiny_llama, body, match):
    recipe = write_recipe(f"""
        name: bad
        base: {tiny_llama}
        steps:
          - {body}
        """)
    with pytest.raises(RecipeError, match=match) as caught:
        plan_recipe(load_recipe(recipe))
    assert f"{recipe}:4" in str(caught.value)


def test_sparse_attention_refuses_other_families(write_recipe, tiny_models):
    recipe = write_recipe(f"""
        name: bad
        base: {tiny_models["qwen3"]}
        steps:
          - sparse_attention: {{top_k: 8, sinks: 1, window: 1}}
        """)
    with pytest.raises(RecipeError, match="Llama-architecture"):
        plan_recipe(load_recipe(recipe))
