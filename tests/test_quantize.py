"""The quantize step: the integer formats against hand computations, GPTQ against round-to-nearest,
the compressed-tensors export loaded by plain transformers, and the engine serving it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe
from surgeon.surgery.quantize import QuantFormat, output_error, quantize_gptq, quantize_rtn


def test_rtn_symmetric_matches_a_hand_computation():
    weight = torch.tensor([[0.3, 0.6, 0.15, 0.0], [1.0, 2.0, 4.0, -0.5]])
    fmt = QuantFormat(bits=4, group_size=2, symmetric=True)
    quantized = quantize_rtn(weight, fmt, search=False)
    # Each group's scale is its largest magnitude over 7.5; values round to the nearest step and
    # the largest (7.5 steps) clamps to 7.
    assert torch.allclose(quantized.scale, torch.tensor([[0.6 / 7.5, 0.15 / 7.5], [2.0 / 7.5, 4.0 / 7.5]]))
    assert quantized.q.tolist() == [[4, 7, 7, 0], [4, 7, 7, -1]]  # 0.3 / 0.08 = 3.75; -0.5 / 0.533 = -0.94
    assert torch.equal(quantized.zero, torch.zeros(2, 2, dtype=torch.int8))
    step = quantized.scale.repeat_interleave(2, dim=1)
    assert ((quantized.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


def test_rtn_asymmetric_uses_the_group_minimum():
    weight = torch.tensor([[0.0, 1.4, 3.0, 1.0]])
    quantized = quantize_rtn(weight, QuantFormat(bits=4, group_size=None, symmetric=False), search=False)
    assert quantized.scale.item() == pytest.approx(3.0 / 15)
    assert quantized.zero.item() == -8  # the minimum 0.0 sits on the lowest code
    assert quantized.q.tolist() == [[-8, -1, 7, -3]]  # 1.4 / 0.2 = 7 steps up from -8
    assert torch.allclose(quantized.dequantize(), weight, atol=1e-6)


def test_the_range_search_never_rounds_worse_than_min_max():
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * torch.rand(64, 1)
    for fmt in (QuantFormat(4, 32), QuantFormat(4, 32, symmetric=False), QuantFormat(4, None), QuantFormat(8)):
        plain = (quantize_rtn(weight, fmt, search=False).dequantize() - weight).square().sum(dim=1)
        searched = (quantize_rtn(weight, fmt).dequantize() - weight).square().sum(dim=1)
        assert (searched <= plain + 1e-9).all() and searched.sum() < plain.sum(), fmt


def test_int8_per_channel_error_is_below_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    quantized = quantize_rtn(weight, QuantFormat(bits=8), search=False)
    assert quantized.scale.shape == (16, 1)
    assert ((quantized.dequantize() - weight).abs() <= quantized.scale / 2 + 1e-6).all()


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    """With a diagonal Hessian no column's error can be compensated by another: GPTQ rounds each
    weight to its nearest step, as RTN does."""
    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    fmt = QuantFormat(bits=4, group_size=32, symmetric=False)
    gptq = quantize_gptq(weight, torch.diag(torch.rand(64) + 0.5), fmt)
    rtn = quantize_rtn(weight, fmt)
    assert torch.equal(gptq.q, rtn.q)
    assert torch.allclose(gptq.scale, rtn.scale)


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    torch.manual_seed(0)
    mixing = torch.randn(64, 64)
    inputs = torch.randn(2048, 64) @ mixing  # strongly correlated features
    hessian = inputs.T @ inputs
    weight = torch.randn(32, 64)
    for fmt in (QuantFormat(4, 32, True), QuantFormat(4, None, False), QuantFormat(8)):
        rtn = output_error(weight, quantize_rtn(weight, fmt).dequantize(), hessian)
        gptq = output_error(weight, quantize_gptq(weight, hessian, fmt).dequantize(), hessian)
        assert gptq < 0.7 * rtn, (fmt, gptq, rtn)


QUANTIZE_RECIPE = """
    name: tiny-int4
    base: {model}
    steps:
      - quantize:
          bits: 4
          group_size: 32
          symmetric: {symmetric}
          method: gptq
          lm_head: {lm_head}
          calibration: {{text: {text}/calibration.txt, tokens: 1024, window: 128}}
          compare:
            data: {{text: {text}/heldout.txt, tokens: 512, window: 128}}
            formats:
              - {{bits: 4, group_size: 32, method: rtn}}
              - {{bits: 4, group_size: 32, symmetric: false, method: rtn}}
              - {{bits: 4, group_size: 32, method: gptq}}
              - {{bits: 8, group_size: null, method: rtn}}
      - evaluate:
          data: {{text: {text}/heldout.txt, tokens: 512, window: 128}}
"""


@pytest.mark.parametrize("symmetric,lm_head", [(True, False), (True, True)])
def test_quantize_recipe_exports_compressed_tensors_that_plain_transformers_loads(
    tmp_path, tiny_llama, text_dir, write_recipe, symmetric, lm_head
):
    recipe = load_recipe(
        write_recipe(
            QUANTIZE_RECIPE.format(
                model=tiny_llama, text=text_dir, symmetric=str(symmetric).lower(), lm_head=str(lm_head).lower()
            )
        )
    )
    result = run_recipe(recipe, out=tmp_path / "out")
    stages = {stage.name: stage.metrics for stage in result.patient.stages}
    # Calibrated 4-bit beats round-to-nearest at the same grid; 8 bits are far closer than either.
    assert stages["quantize int4 g32 sym gptq"]["kl_mean"] < stages["quantize int4 g32 sym rtn"]["kl_mean"]
    assert stages["quantize int8 channel sym rtn"]["kl_mean"] < stages["quantize int4 g32 sym rtn"]["kl_mean"] / 4
    assert stages["after quantize"]["kl_mean"] > 0
    assert "quantize int4 g32 asym rtn" in stages
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, symmetric)
    assert ("lm_head" in quant["ignore"]) != lm_head
    card = (tmp_path / "out" / "README.md").read_text()
    assert "kl_max" in card and "pip install compressed-tensors" in card

    # The patient's logits, then the export's through plain transformers in a process that never
    # imports surgeon: the same integers, scales and zeros give the same model.
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    with torch.no_grad():
        expected = result.patient.model(input_ids=ids).logits[0]
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, dtype=torch.float32)
assert "surgeon" not in sys.modules
with torch.no_grad():
    logits = model(input_ids=torch.tensor({ids.tolist()})).logits[0]
torch.save(logits, {str(tmp_path / "logits.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    loaded = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert (loaded - expected).abs().max() < 1e-3


def test_quantize_refuses_groups_that_do_not_divide(tiny_llama, text_dir, write_recipe):
    path = write_recipe(
        f"""
        name: bad-groups
        base: {tiny_llama}
        steps:
          - quantize: {{bits: 4, group_size: 128, method: rtn}}
        """
    )
    with pytest.raises(RecipeError) as caught:
        plan_recipe(load_recipe(path))
    assert "recipe.yaml:4" in str(caught.value) and "not a multiple of 128" in str(caught.value)


def test_the_exported_format_must_be_symmetric(tiny_llama, write_recipe):
    path = write_recipe(
        f"""
        name: asymmetric
        base: {tiny_llama}
        steps:
          - quantize: {{bits: 4, method: rtn, symmetric: false}}
        """
    )
    with pytest.raises(RecipeError, match=r"recipe.yaml:4.*symmetric: true"):
        load_recipe(path)


def test_gptq_needs_calibration_text(tiny_llama, write_recipe):
    path = write_recipe(
        f"""
        name: no-calibration
        base: {tiny_llama}
        steps:
          - quantize: {{bits: 4, method: gptq}}
        """
    )
    with pytest.raises(RecipeError, match=r"recipe.yaml:4.*give `calibration` text"):
        load_recipe(path)


def test_int4_engine_linear_holds_the_exported_integers():
    """Fed the identity, the kernel returns its weights: the export's integers times its scales
    (bf16 activations and scales, as the fast CPU kernel wants them)."""
    from surgeon.engine.quantize import Int4Linear

    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    for fmt in (QuantFormat(4, 32), QuantFormat(4, 64), QuantFormat(4, None)):
        quantized = quantize_rtn(weight, fmt)
        dense = quantized.dequantize()
        linear = Int4Linear(dense, None, group=32, scales=quantized.scale)
        recovered = linear(torch.eye(128)).T
        assert torch.allclose(recovered, dense, rtol=1e-2, atol=1e-3), fmt
        x = torch.randn(5, 128)
        exact = x @ dense.T
        assert (linear(x) - exact).norm() / exact.norm() < 0.01, fmt  # bf16 rounding of x only


def test_the_engine_serves_an_int4_export_on_its_own_integers(tmp_path, tiny_llama, text_dir, write_recipe):
    from surgeon.engine import LLM, SamplingParams

    recipe = load_recipe(
        write_recipe(
            f"""
            name: tiny-int4-serve
            base: {tiny_llama}
            steps:
              - quantize:
                  bits: 4
                  group_size: 32
                  lm_head: true   # every Linear exported, so the engine runs exactly the patient's values
                  calibration: {{text: {text_dir}/calibration.txt, tokens: 1024, window: 128}}
            """
        )
    )
    result = run_recipe(recipe, out=tmp_path / "out")
    engine = LLM(str(tmp_path / "out"), kv_cache_tokens=2048)
    assert engine.quantized == "int4"
    reference = LLM.from_model(result.patient.model, result.patient.tokenizer, kv_cache_tokens=2048)
    prompts = [[1, 40 + i, 41, 42, 43] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, loop_window=0)
    served = [c.token_ids for c in engine.generate(prompts, greedy)]
    expected = [c.token_ids for c in reference.generate(prompts, greedy)]
    # bf16 activations in the kernel: a random tiny model's near-ties may flip a late token.
    same = sum(a[:4] == b[:4] for a, b in zip(served, expected))
    assert same >= 5, (served, expected)
    assert type(engine.model.lm_head).__name__ == "Int4Linear"


def test_input_hessians_are_each_linears_own_inputs(tiny_llama):
    """Shared matrices only where Linears read the very same tensor (q/k/v, gate/up): every one
    equals X^T X of what that Linear was called with."""
    from transformers import AutoModelForCausalLM

    from surgeon.surgery.quantize import input_hessians, linear_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    names = [n for n in linear_inputs(model) if n != "lm_head"]
    windows = torch.randint(3, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    hessians = input_hessians(model, names, windows)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(
                name,
                seen.get(name, 0)
                + args[0].reshape(-1, args[0].shape[-1]).double().T @ args[0].reshape(-1, args[0].shape[-1]).double(),
            )
        )
        for name in names
    ]
    with torch.no_grad():
        for window in windows:
            model(input_ids=window[None])
    for hook in hooks:
        hook.remove()
    for name in names:
        assert torch.allclose(hessians[name], seen[name], rtol=1e-6, atol=1e-8), name
    assert not torch.allclose(hessians["model.layers.0.self_attn.o_proj"], hessians["model.layers.0.self_attn.q_proj"])
