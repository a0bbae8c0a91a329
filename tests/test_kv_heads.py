"""reduce_kv_heads: merges that keep the standard architecture, and an svd init that is exact when
the group's heads really share one key/value space."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import FAMILIES
from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe
from surgeon.surgery.kv_heads import merge_keys, merge_values, relative_error


def _recipe(write_recipe, base, text_dir, kv_heads: int, init: str) -> str:
    calibration = f"calibration: {{text: {text_dir / 'calibration.txt'}, tokens: 512, window: 128}}"
    return write_recipe(f"""
        name: fewer-kv
        base: {base}
        steps:
          - reduce_kv_heads: {{kv_heads: {kv_heads}, init: {init}, {calibration}}}
          - evaluate:
              data: {{text: {text_dir / "heldout.txt"}, tokens: 512, window: 128}}
        """)


@pytest.mark.parametrize("family", FAMILIES)
def test_mqa_export_is_the_standard_architecture(write_recipe, tiny_models, text_dir, tmp_path, family):
    recipe = _recipe(write_recipe, tiny_models[family], text_dir, 1, "svd")
    plan = plan_recipe(load_recipe(recipe))
    assert plan.rows[1].shape.kv_heads == 1 and "2 -> 1 KV heads" in plan.rows[1].note
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    config = json.loads((result.target / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and config["model_type"] == result.patient.parent.config.model_type
    loaded = AutoModelForCausalLM.from_pretrained(result.target).eval()  # no remote code
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, result.patient.model(input_ids=ids).logits, atol=1e-5)
    entry = result.report["provenance"][0]
    assert (
        entry["details"]["kv_cache_bytes_per_token"]["after"] * 2
        == entry["details"]["kv_cache_bytes_per_token"]["before"]
    )
    errors = entry["details"]["relative_error"]
    assert set(errors) == {"mean", "first", "svd"}
    # The fitted heads reproduce the parent's values at least as well as averaging (it is optimal
    # for that quadratic objective); keys too, where no per-head norm is in the way.
    assert errors["svd"]["v"] <= errors["mean"]["v"] + 1e-9
    if family in ("llama", "qwen2"):
        assert errors["svd"]["k"] <= errors["mean"]["k"] + 1e-9
    # The card shows the KV plot surgeon analyze draws: per layer, how alike the heads were and the
    # energy the svd merge to 1 head lost, on the calibration text.
    similarity, lost = entry["details"]["kv_head_similarity"], entry["details"]["kv_merge_energy_lost"]
    layers = result.patient.parent.config.num_hidden_layers
    assert len(similarity["k"]) == len(similarity["v"]) == layers and all(-1 <= c <= 1 for c in similarity["k"])
    assert set(lost) == {"1"} and all(0 <= x <= 1 for x in lost["1"]["v"])
    assert (result.target / "kv-head-similarity-1.png").is_file()
    assert "kv-head-similarity-1.png" in (result.target / "README.md").read_text()


def test_svd_is_exact_when_heads_share_a_subspace(tiny_models, tokenizer_dir):
    """Two KV heads whose keys differ by a complex scale per rotary pair and whose values differ
    by an orthogonal map merge into one with no change to the model's output; mean does not."""
    from surgeon.surgery import architecture
    from surgeon.surgery.kv_merge import attention_input_covariance, merge_kv_heads

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    hd = architecture.head_dim(model.config)
    half = hd // 2
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            k, v = layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight
            angle, scale = torch.rand(half) * 6.28, 0.5 + torch.rand(half)
            a, b = scale * torch.cos(angle), scale * torch.sin(angle)
            k0 = k[:hd].clone()
            k[hd : hd + half] = a[:, None] * k0[:half] - b[:, None] * k0[half:]
            k[hd + half :] = b[:, None] * k0[:half] + a[:, None] * k0[half:]
            rotation, _ = torch.linalg.qr(torch.randn(hd, hd))
            v[hd:] = rotation @ v[:hd]
    ids = torch.randint(3, 300, (4, 24))
    sigmas = attention_input_covariance(model, ids)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        results = {}
        for init in ("svd", "mean"):
            state, errors = merge_kv_heads(model, 1, init, sigmas)
            config = model.config.__class__.from_dict({**model.config.to_dict(), "num_key_value_heads": 1})
            merged = architecture.assemble(config, state)
            results[init] = (merged(input_ids=ids).logits - expected).abs().max().item()
    assert errors["svd"]["k"] < 1e-9 and errors["svd"]["v"] < 1e-9 and errors["mean"]["v"] > 1e-3
    assert results["svd"] < 1e-4 < results["mean"]


def test_merge_maps_reconstruct_each_head():
    torch.manual_seed(0)
    weights = [torch.randn(8, 5, dtype=torch.float64) for _ in range(3)]
    x = torch.randn(200, 5, dtype=torch.float64)
    sigma = x.T @ x / 200
    for merger in (merge_values, merge_keys):
        svd, mean = merger(weights, sigma, "svd"), merger(weights, sigma, "mean")
        assert relative_error(weights, svd, sigma)[0] <= relative_error(weights, mean, sigma)[0]
        assert len(svd.maps) == 3 and svd.shared.shape == (8, 5)


@pytest.mark.parametrize("kv_heads,match", [(3, "must divide the current 2"), (4, "must divide")])
def test_kv_heads_must_divide(write_recipe, tiny_llama, text_dir, kv_heads, match):
    recipe = _recipe(write_recipe, tiny_llama, text_dir, kv_heads, "mean")
    with pytest.raises(RecipeError, match=match) as info:
        plan_recipe(load_recipe(recipe))
    assert "recipe.yaml:" in str(info.value)


def test_svd_needs_calibration(write_recipe, tiny_llama):
    recipe = write_recipe(f"name: x\nbase: {tiny_llama}\nsteps:\n  - reduce_kv_heads: {{kv_heads: 1, init: svd}}\n")
    with pytest.raises(RecipeError, match="give `calibration` text"):
        load_recipe(recipe)


def test_best_init_is_measured_against_the_parent_and_kept(write_recipe, tiny_llama, text_dir, tmp_path):
    """`init: best` measures every init on the compare text (a stage each in the card) and keeps the
    closest; the export loads in a process that never imports surgeon."""
    data = f"{{text: {text_dir / 'heldout.txt'}, tokens: 512, window: 128}}"
    recipe = write_recipe(f"""
        name: best-kv
        base: {tiny_llama}
        steps:
          - reduce_kv_heads:
              kv_heads: 1
              init: best
              calibration: {{text: {text_dir / "calibration.txt"}, tokens: 512, window: 128}}
              compare: {data}
        """)
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    entry = result.report["provenance"][0]
    measured = entry["details"]["compare"]
    assert set(measured) == {"mean", "first", "svd"}
    kept = min(measured, key=lambda name: measured[name]["kl_mean"])
    assert entry["details"]["init"] == kept and f"(init {kept})" in entry["what"]
    stages = {s["name"]: s["metrics"]["kl_mean"] for s in result.report["stages"]}
    assert stages == {f"reduce_kv_heads init {name}": m["kl_mean"] for name, m in measured.items()}
    assert "reduce_kv_heads init svd" in (result.target / "README.md").read_text()

    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(result.target)!r})
assert "surgeon" not in sys.modules and type(model).__name__ == "LlamaForCausalLM"
assert model.config.num_key_value_heads == 1 and model.model.layers[0].self_attn.k_proj.out_features == 16
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_best_needs_compare_text(write_recipe, tiny_llama, text_dir):
    recipe = write_recipe(
        f"name: x\nbase: {tiny_llama}\nsteps:\n  - reduce_kv_heads:\n      kv_heads: 1\n      init: best\n"
        f"      calibration: {{text: {text_dir / 'calibration.txt'}}}\n"
    )
    with pytest.raises(RecipeError, match="give `compare` text"):
        load_recipe(recipe)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fit_brings_each_attention_closer_to_the_parents(write_recipe, tiny_models, text_dir, tmp_path, family):
    """The layer-local fit calls each family's attention as its decoder does (rotary, masks, sliding
    windows) and lowers every layer's output error, and the model's KL to the parent with it."""
    calibration = f"{{text: {text_dir / 'calibration.txt'}, tokens: 1024, window: 64}}"
    heldout = f"{{text: {text_dir / 'heldout.txt'}, tokens: 512, window: 64}}"
    runs = {}
    for fit in ("", "\n                  fit: {steps: 40, lr: 3.0e-3, batch: 4}"):
        recipe = write_recipe(f"""
            name: fit-kv
            base: {tiny_models[family]}
            steps:
              - reduce_kv_heads:
                  kv_heads: 1
                  init: mean
                  calibration: {calibration}{fit}
              - evaluate: {{data: {heldout}}}
            """)
        runs[bool(fit)] = run_recipe(load_recipe(recipe), out=tmp_path / f"out{bool(fit)}", overwrite=True)
    fitted = runs[True].report["provenance"][0]["details"]["fit"]
    assert len(fitted) == 6 and all(layer["after"] < layer["before"] for layer in fitted)
    kl = {fit: run.report["stages"][0]["metrics"]["kl_mean"] for fit, run in runs.items()}
    assert kl[True] < kl[False]
