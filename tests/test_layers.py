"""drop_layers and stack on tiny models of every supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, save_tiny_model
from surgeon.checkpoints.sources import resolve_source
from surgeon.ops import OPERATIONS
from surgeon.recipe.patient import Patient
from surgeon.recipe.step import BASE, StepContext
from surgeon.text import TextData


def load_patient(folder: Path) -> Patient:
    return Patient.from_source(resolve_source(str(folder), Path.cwd()))


def apply(op: str, params: dict, patient: Patient, sources: dict | None = None) -> Patient:
    operation = OPERATIONS[op]
    ctx = StepContext(recipe_dir=Path.cwd(), sources={BASE: patient.base, **(sources or {})})
    return operation.apply(operation.Params.model_validate(params), patient, ctx)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def skip_layers(model, skipped: list[int]):
    """Hooks that make `skipped` layers of `model` return their input: an independent reference."""
    hooks = []
    for index in skipped:

        def identity(_module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

        hooks.append(model.model.layers[index].register_forward_hook(identity, with_kwargs=True))
    return hooks


def greedy(model, ids: torch.Tensor, use_cache: bool) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            max_new_tokens=8,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=2,
            attention_mask=torch.ones_like(ids),
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_drop_layers_equals_skipping_them_in_the_parent(family, tiny_models):
    patient = load_patient(tiny_models[family])
    child = apply("drop_layers", {"layers": [1, "3-4"]}, patient)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))

    hooks = skip_layers(patient.parent, [1, 3, 4])
    try:
        expected = logits(patient.parent, ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.allclose(logits(child.model, ids), expected, atol=1e-5)

    config = child.model.config
    assert config.num_hidden_layers == 3 and len(child.model.model.layers) == 3
    assert [layer.self_attn.layer_idx for layer in child.model.model.layers] == [0, 1, 2]
    parent_types = getattr(patient.parent.config, "layer_types", None)
    if parent_types is not None:
        assert config.layer_types == [parent_types[i] for i in (0, 2, 5)]
    # The KV cache is indexed by the new layer numbers: cached and uncached decoding agree.
    assert torch.equal(greedy(child.model, ids[:1, :12], True), greedy(child.model, ids[:1, :12], False))
    # The parent is untouched and the child shares its tensors (no copy was made).
    assert patient.parent.config.num_hidden_layers == 6
    assert (
        child.model.model.layers[1].mlp.up_proj.weight.data_ptr()
        == patient.parent.model.layers[2].mlp.up_proj.weight.data_ptr()
    )
    (entry,) = child.provenance
    assert entry.params["layers"] == [1, 3, 4] and entry.before["layers"] == 6 and entry.after["layers"] == 3


def test_gemma3_keeps_each_layers_attention_type(tiny_models):
    patient = load_patient(tiny_models["gemma3"])
    assert patient.parent.config.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    child = apply("drop_layers", {"layers": [0, 1]}, patient)
    assert child.model.config.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert [layer.self_attn.layer_type for layer in child.model.model.layers] == child.model.config.layer_types


def _with_identity_layers(folder: Path, tmp_path: Path, layers: list[int]) -> Path:
    """A copy of the checkpoint whose `layers` add nothing to the residual stream."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for index in layers:
            model.model.layers[index].self_attn.o_proj.weight.zero_()
            model.model.layers[index].mlp.down_proj.weight.zero_()
    out = tmp_path / "identity"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("metric", "identity", "expected"),
    [
        ("angular", [2, 3], [2, 3]),
        ("block_influence", [1, 4], [1, 4]),
        ("kl", [2, 3], [2, 3]),
    ],
)
def test_auto_drop_finds_the_layers_that_do_nothing(metric, identity, expected, tiny_llama, tmp_path, text_dir):
    patient = load_patient(_with_identity_layers(tiny_llama, tmp_path, identity))
    params = {
        "auto": {"metric": metric, "count": 2},
        "calibration": {"text": str(text_dir / "calibration.txt"), "tokens": 1024, "window": 128},
    }
    child = apply("drop_layers", params, patient)
    (entry,) = child.provenance
    assert entry.params["layers"] == expected
    distances = entry.details["angular_distance_by_block_start"]
    influence = entry.details["block_influence_by_layer"]
    assert len(distances) == 5 and len(influence) == 6  # every candidate is reported
    if metric == "angular":
        assert distances[2] == pytest.approx(0, abs=1e-3) and min(distances[:2] + distances[3:]) > 0.01
    elif metric == "kl":
        kls = entry.details["kl_by_block_start"]
        assert len(kls) == 5 and kls[2] < 1e-5 and min(kls[:2] + kls[3:]) > 1e-3
    else:
        assert influence[1] == pytest.approx(0, abs=1e-5) and influence[4] == pytest.approx(0, abs=1e-5)


def test_stack_identity_reproduces_the_model(tiny_llama):
    patient = load_patient(tiny_llama)
    child = apply("stack", {"slices": [{"layers": ["0-2"]}, {"layers": ["3-5"]}]}, patient)
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(logits(child.model, ids), logits(patient.parent, ids), atol=1e-6)


def test_stack_duplicates_layers_without_shared_storage(tiny_llama):
    patient = load_patient(tiny_llama)
    child = apply("stack", {"slices": [{"layers": ["0-3"]}, {"layers": ["2-5"]}]}, patient)
    layers = child.model.model.layers
    assert child.model.config.num_hidden_layers == 8 and len(layers) == 8
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(8))
    for new, old in [(2, 2), (4, 2), (7, 5)]:
        assert torch.equal(layers[new].mlp.up_proj.weight, patient.parent.model.layers[old].mlp.up_proj.weight)
    pointers = [p.data_ptr() for layer in layers for p in layer.parameters()]
    assert len(pointers) == len(set(pointers)), "a duplicated layer shares storage"
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy(child.model, ids, True), greedy(child.model, ids, False))


def test_stack_takes_layers_from_another_checkpoint(tiny_llama, tmp_path, tokenizer_dir):
    donor_folder = save_tiny_model(tmp_path / "donor", "llama", tokenizer_dir, seed=7)
    donor = resolve_source(str(donor_folder), Path.cwd())
    patient = load_patient(tiny_llama)
    child = apply(
        "stack",
        {"slices": [{"layers": ["0-2"]}, {"source": "donor", "layers": [4, 5]}]},
        patient,
        sources={"donor": donor},
    )
    donor_model = donor.load_model()
    layers = child.model.model.layers
    assert len(layers) == 5
    assert torch.equal(layers[3].self_attn.q_proj.weight, donor_model.model.layers[4].self_attn.q_proj.weight)
    assert torch.equal(layers[0].self_attn.q_proj.weight, patient.parent.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(child.model.model.embed_tokens.weight, patient.parent.model.embed_tokens.weight)


def test_stack_from_a_module_subset(tiny_llama, tmp_path, tokenizer_dir, write_recipe):
    from surgeon.errors import RecipeError
    from surgeon.recipe.plan import plan_recipe
    from surgeon.recipe.schema import load_recipe

    donor = save_tiny_model(tmp_path / "donor", "llama", tokenizer_dir, seed=3)
    recipe = f"""
        name: t
        base: {tiny_llama}
        sources:
          upper: {{model: {donor}, modules: ["model.layers.4", "model.layers.5"]}}
        steps:
          - stack:
              slices:
                - {{layers: ["0-3"]}}
                - {{source: upper, layers: [LAYERS]}}
        """
    plan = plan_recipe(load_recipe(write_recipe(recipe.replace("LAYERS", "4, 5"))))
    assert plan.rows[-1].shape.layers == 6
    with pytest.raises(RecipeError) as info:
        plan_recipe(load_recipe(write_recipe(recipe.replace("LAYERS", "3, 4"))))
    assert "excludes layers 3" in info.value.problems[0]


def test_calibration_text_too_short_is_a_clear_error(tiny_llama, text_dir):
    from surgeon.errors import DataError

    patient = load_patient(tiny_llama)
    params = {"auto": {"count": 1}, "calibration": {"text": str(text_dir / "tiny.txt"), "window": 64}}
    with pytest.raises(DataError, match="fewer tokens than one window of 64"):
        apply("drop_layers", params, patient)


def test_text_windows_start_with_bos(tiny_llama, text_dir):
    from surgeon.text import token_windows

    tokenizer = load_patient(tiny_llama).tokenizer
    windows = token_windows(tokenizer, [text_dir / "heldout.txt"], TextData(text="x", tokens=512, window=128))
    assert windows.shape == (4, 128)
    assert (windows[:, 0] == tokenizer.bos_token_id).all()
    assert not (windows[:, 1:] == tokenizer.bos_token_id).any()
    plain = token_windows(tokenizer, [text_dir / "heldout.txt"], TextData(text="x", tokens=512, window=128, bos=False))
    assert torch.equal(plain.flatten()[:127], windows[0, 1:])
