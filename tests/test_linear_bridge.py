"""drop_layers with `bridge: linear`: the fitted map is what gets folded, and it beats the plain drop."""

from __future__ import annotations

import pytest
import torch
from test_layers import apply, load_patient

from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.schema import load_recipe
from surgeon.surgery.architecture import keep_layers
from surgeon.surgery.linear_bridge import contiguous_runs, fold_into_down_proj


def stream_entering(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The residual stream entering decoder layer `layer` (positions 1.., as the fit uses them)."""
    taken = []
    hook = model.model.layers[layer].register_forward_pre_hook(
        lambda _m, args, kwargs: taken.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return taken[0][:, 1:].double()


def test_bridged_stream_is_closer_to_the_parent_by_the_reported_factor(tiny_llama, text_dir):
    from surgeon.text import TextData, token_windows

    patient = load_patient(tiny_llama)
    calibration = {"text": str(text_dir / "calibration.txt"), "tokens": 1024, "window": 128}
    child = apply("drop_layers", {"layers": ["2-3"], "bridge": "linear", "calibration": calibration}, patient)
    (entry,) = child.provenance
    (bridge,) = entry.details["bridge"]
    assert bridge["dropped"] == "2-3" and bridge["into_layer"] == 1
    assert 0 < bridge["error_vs_plain_drop"] < 1

    # On the calibration windows, the child's stream entering its layer 2 (the parent's layer 4)
    # misses the parent's by exactly the reported factor less than the plain drop's does.
    windows = token_windows(patient.tokenizer, [text_dir / "calibration.txt"], TextData.model_validate(calibration))
    target = stream_entering(patient.parent, 4, windows)
    plain = stream_entering(keep_layers(patient.parent, [0, 1, 4, 5]), 2, windows)
    bridged = stream_entering(child.model, 2, windows)
    ratio = ((bridged - target).norm() / (plain - target).norm()).item()
    assert ratio == pytest.approx(bridge["error_vs_plain_drop"], rel=1e-3)
    # The parent was not touched: its layer 1 is still what the plain drop uses.
    assert not torch.equal(
        child.model.model.layers[1].mlp.down_proj.weight, patient.parent.model.layers[1].mlp.down_proj.weight
    )
    assert torch.equal(
        child.model.model.layers[0].mlp.down_proj.weight, patient.parent.model.layers[0].mlp.down_proj.weight
    )


def test_fold_applies_the_map_to_the_mlp_output(tiny_llama):
    model = load_patient(tiny_llama).parent
    layer = model.model.layers[1]
    x = torch.randn(3, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    t = torch.randn(
        model.config.hidden_size,
        model.config.hidden_size,
        generator=torch.Generator().manual_seed(1),
        dtype=torch.float64,
    )
    with torch.no_grad():
        expected = layer.mlp(x).double() @ t
        original = layer.mlp.down_proj.weight
        fold_into_down_proj(layer, t)
        assert torch.allclose(layer.mlp(x).double(), expected, atol=1e-4)
    assert layer.mlp.down_proj.weight is not original and not layer.mlp.down_proj.weight.requires_grad


def test_contiguous_runs():
    assert contiguous_runs([9, 3, 5, 4]) == [(3, 5), (9, 9)]
    assert contiguous_runs([]) == []


def test_bridge_errors_are_reported_at_plan_time(write_recipe, tiny_models, text_dir):
    calibration = f"calibration: {{text: {text_dir}/calibration.txt, tokens: 256, window: 128}}"
    gemma = write_recipe(f"""
        name: t
        base: {tiny_models["gemma3"]}
        steps:
          - drop_layers:
              layers: [2]
              bridge: linear
              {calibration}
        """)
    with pytest.raises(RecipeError) as info:
        plan_recipe(load_recipe(gemma))
    assert info.value.problems[0].startswith(f"{gemma}:6: steps[0].drop_layers.bridge: a linear bridge needs")
    first = write_recipe(
        f"""
        name: t
        base: {tiny_models["llama"]}
        steps:
          - drop_layers: {{layers: ["0-1"], bridge: linear, {calibration}}}
        """,
        name="first.yaml",
    )
    with pytest.raises(RecipeError, match="layer 0 has none"):
        plan_recipe(load_recipe(first))
    missing = write_recipe(
        f"""
        name: t
        base: {tiny_models["llama"]}
        steps:
          - drop_layers: {{layers: [2], bridge: linear}}
        """,
        name="missing.yaml",
    )
    with pytest.raises(RecipeError, match="need `calibration` text"):
        plan_recipe(load_recipe(missing))
