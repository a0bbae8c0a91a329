"""`surgeon import-mergekit`: real-style mergekit configs (as people post them) become recipes that
validate, run, and merge exactly as the method says, checked by hand on tiny checkpoints."""

from __future__ import annotations

import textwrap

import pytest
import torch
import yaml

from merge_reference import LAYERS, gradient, layer_t, slerp_by_hand, state_of, ties_by_hand
from surgeon import cli
from surgeon.errors import RecipeError
from surgeon.recipe.mergekit_import import import_mergekit
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe

CONFIGS = {
    "linear": """\
        models:
          - model: ./a
            parameters:
              weight: 1.0
          - model: ./b
            parameters:
              weight: 0.5
        merge_method: linear
        dtype: float16
        """,
    "slerp": f"""\
        slices:
          - sources:
              - model: ./a
                layer_range: [0, {LAYERS}]
              - model: ./b
                layer_range: [0, {LAYERS}]
        merge_method: slerp
        base_model: ./a
        parameters:
          t:
            - filter: self_attn
              value: [0, 0.5, 0.3, 0.7, 1]
            - filter: mlp
              value: [1, 0.5, 0.7, 0.3, 0]
            - value: 0.5
        dtype: bfloat16
        """,
    "ties": """\
        models:
          - model: ./base
            # no parameters necessary for base model
          - model: ./a
            parameters:
              density: 0.5
              weight: 0.5
          - model: ./b
            parameters:
              density: 0.5
              weight: 0.3
        merge_method: ties
        base_model: ./base
        parameters:
          normalize: true
        dtype: float32
        """,
    "dare_ties": """\
        models:
          - model: ./base
          - model: ./a
            parameters:
              density: 0.53
              weight: 0.4
          - model: ./b
            parameters:
              density: 0.53
              weight: 0.3
        merge_method: dare_ties
        base_model: ./base
        parameters:
          int8_mask: true
        dtype: float32
        """,
    "passthrough": """\
        slices:
          - sources:
            - model: ./a
              layer_range: [0, 3]
          - sources:
            - model: ./b
              layer_range: [1, 4]
        merge_method: passthrough
        dtype: float32
        """,
}


_LAST: dict = {}  # the last run's patient, for checks before the export's dtype


def test_slice_parameters_fall_back_to_the_global_ones(tmp_path, trio):
    for name, folder in trio.items():
        (tmp_path / name).symlink_to(folder, target_is_directory=True)
    config = tmp_path / "fallback.yml"
    config.write_text(
        textwrap.dedent(
            f"""\
            slices:
              - sources:
                  - {{model: ./a, layer_range: [0, {LAYERS}]}}
                  - {{model: ./b, layer_range: [0, {LAYERS}]}}
                parameters:
                  t: [{{filter: self_attn, value: 0.3}}]
            merge_method: slerp
            base_model: ./a
            parameters:
              t: 0.5
            """
        )
    )
    step = yaml.safe_load(import_mergekit(config))["steps"][0]["merge"]
    assert step["t"] == [{"filter": "self_attn", "value": 0.3}, {"value": 0.5}]


@pytest.fixture
def configs(tmp_path, trio):
    """The configs beside links to the tiny models, as a user's folder would hold them."""
    for name, folder in trio.items():
        (tmp_path / name).symlink_to(folder, target_is_directory=True)
    paths = {}
    for name, text in CONFIGS.items():
        paths[name] = tmp_path / f"{name}-merge.yml"
        paths[name].write_text(textwrap.dedent(text))
    return paths


def _run(config, tmp_path):
    recipe_path = tmp_path / "recipes" / f"{config.stem}.yaml"
    recipe_path.parent.mkdir(exist_ok=True)
    recipe_path.write_text(import_mergekit(config, recipe_path))
    recipe = load_recipe(recipe_path)
    plan_recipe(recipe)
    result = run_recipe(recipe, out=tmp_path / config.stem)
    _LAST["patient"] = result.patient
    return yaml.safe_load(recipe_path.read_text()), state_of(result.target)


def test_linear_config(configs, tmp_path, trio):
    recipe, merged = _run(configs["linear"], tmp_path)
    assert recipe["name"] == "linear-merge" and recipe["export"] == {"dtype": "float16"}
    a, b = state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        assert tensor.dtype == torch.float16
        torch.testing.assert_close(tensor.float(), (a[name] + 0.5 * b[name]) / 1.5, rtol=2e-3, atol=2e-3)


def test_slerp_config_with_filtered_gradients(configs, tmp_path, trio):
    recipe, exported = _run(configs["slerp"], tmp_path)
    assert all(tensor.dtype == torch.bfloat16 for tensor in exported.values())
    merged = _LAST["patient"].model.state_dict()  # the fp32 merge, before the export's bf16 rounding
    assert recipe["base"] == "../a" and recipe["steps"][0]["merge"]["base"] == "base"
    a, b = state_of(trio["a"]), state_of(trio["b"])
    turned = 0
    for name, tensor in merged.items():
        if "self_attn" in name:
            t = gradient([0, 0.5, 0.3, 0.7, 1], layer_t(name))
        elif "mlp" in name:
            t = gradient([1, 0.5, 0.7, 0.3, 0], layer_t(name))
        else:
            t = 0.5
        if name == "lm_head.weight":
            continue  # tied: the embeddings' rows above
        expected = slerp_by_hand(t, a[name], b[name])
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=1e-5)
        turned += not torch.allclose(expected, (1 - t) * a[name] + t * b[name], atol=1e-6)
    assert turned, "every tensor fell back to lerp: the test would not see the sphere"


def test_ties_config(configs, tmp_path, trio):
    recipe, merged = _run(configs["ties"], tmp_path)
    step = recipe["steps"][0]["merge"]
    assert [m["model"] for m in step["models"]] == ["a", "b"]  # the base contributes no task vector
    base, a, b = state_of(trio["base"]), state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        deltas = [a[name] - base[name], b[name] - base[name]]
        torch.testing.assert_close(tensor, ties_by_hand(base[name], deltas, [0.5, 0.3], 0.5), rtol=1e-5, atol=1e-6)


def test_dare_ties_config(configs, tmp_path, trio):
    text = import_mergekit(configs["dare_ties"])
    assert "int8_mask" in text.splitlines()[1]  # said, not silently dropped
    recipe, merged = _run(configs["dare_ties"], tmp_path)
    base, a, b = state_of(trio["base"]), state_of(trio["a"]), state_of(trio["b"])
    name = "model.layers.2.mlp.gate_proj.weight"
    change = merged[name] - base[name]
    # every entry is 0 or a rescaled delta of a or b (or their sign-agreeing sum)
    da, db = (a[name] - base[name]) / 0.53, (b[name] - base[name]) / 0.53
    options = torch.stack([torch.zeros_like(da), 0.4 * da, 0.3 * db, 0.4 * da + 0.3 * db])
    assert torch.isclose(change.unsqueeze(0), options, atol=1e-5).any(0).all()
    assert 0.3 < (change.abs() > 1e-7).float().mean() < 0.9


def test_passthrough_config_stacks_layer_ranges(configs, tmp_path, trio):
    recipe, merged = _run(configs["passthrough"], tmp_path)
    assert recipe["steps"][0]["stack"]["slices"] == [
        {"source": "base", "layers": ["0-2"]},
        {"source": "b", "layers": ["1-3"]},
    ]
    a, b = state_of(trio["a"]), state_of(trio["b"])
    picks = [(a, 0), (a, 1), (a, 2), (b, 1), (b, 2), (b, 3)]
    for index, (donor, layer) in enumerate(picks):
        name = f"model.layers.{index}.mlp.down_proj.weight"
        torch.testing.assert_close(merged[name], donor[f"model.layers.{layer}.mlp.down_proj.weight"])


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("models:\n  - model: ./a\n  - model: ./b\nmerge_method: model_stock\n", 4, "no 'model_stock' merge"),
        ("models:\n  - model: ./a+./lora\n  - model: ./b\nmerge_method: linear\n", 2, "applies a LoRA"),
        ("models:\n  - model: ./a\nmerge_method: ties\nbase_model: ./base\ntokenizer_source: union\n", 5, "union"),
        (
            "slices:\n  - sources:\n      - {model: ./a, layer_range: [0, 2]}\n"
            "      - {model: ./b, layer_range: [0, 2]}\n"
            "merge_method: slerp\nbase_model: ./a\nparameters: {t: 0.5}\n",
            3,
            "has 4 layers",
        ),
        (
            "models:\n  - model: ./a\n    parameters: {weight: 1, gamma: 0.1}\nmerge_method: ties\nbase_model: ./b\n",
            3,
            "gamma",
        ),
        ("models:\n  - model: ./a\nmerge_method: ties\nbase_model: ./b\nparameters: {rescale: true}\n", 5, "rescale"),
        (
            "models:\n  - model: ./a\n    parameters:\n      weight:\n        - {filter: 'layers.*.mlp', value: 1}\n"
            "merge_method: linear\n",
            5,
            "glob to surgeon",
        ),
        ("models:\n  - model: ./a\n  - model: ./b\n  - model: ./a\nmerge_method: linear\n", 4, "listed twice"),
    ],
)
def test_what_does_not_map_is_an_error_at_its_line(tmp_path, trio, text, line, message):
    for name, folder in trio.items():
        (tmp_path / name).symlink_to(folder, target_is_directory=True)
    config = tmp_path / "bad.yml"
    config.write_text(text)
    with pytest.raises(RecipeError) as caught:
        import_mergekit(config)
    assert f"bad.yml:{line}:" in str(caught.value) and message in str(caught.value), str(caught.value)


def test_cli_writes_a_recipe_that_runs(configs, tmp_path, capsys):
    recipe = tmp_path / "ties.yaml"
    assert cli.main(["import-mergekit", str(configs["ties"]), "-o", str(recipe)]) == 0
    assert cli.main(["import-mergekit", str(configs["ties"]), "-o", str(recipe)]) != 0  # no overwrite
    assert cli.main(["run", str(recipe), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "merge: ties merge of" in printed and printed.splitlines()[-1].startswith("exported")
    assert cli.main(["import-mergekit", str(configs["linear"])]) == 0
    assert "method: linear" in capsys.readouterr().out
