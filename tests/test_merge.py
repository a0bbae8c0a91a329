"""The merge step against hand computations on tiny checkpoints: each method's formula written out
here in plain torch over the saved state dicts, independent of surgeon's implementation."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import save_tiny_model
from merge_reference import LAYERS, layer_t, slerp_by_hand, state_of, ties_by_hand
from surgeon import cli
from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe


def _merge(tmp_path, trio, step: str, base: str = "base", extra_sources: str = ""):
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""\
            name: merged
            base: {trio[base]}
            sources:
              a: {trio["a"]}
              b: {trio["b"]}
            {extra_sources}
            steps:
              - merge:
            """
        )
        + textwrap.indent(textwrap.dedent(step), " " * 6)
    )
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    return state_of(result.target), result


def test_linear_is_the_normalised_weighted_average(tmp_path, trio):
    merged, _ = _merge(tmp_path, trio, "method: linear\nmodels: [{model: a, weight: 0.3}, {model: b, weight: 0.9}]")
    a, b = state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, (0.3 * a[name] + 0.9 * b[name]) / 1.2, rtol=1e-5, atol=1e-6)


def test_gradients_and_filters_pick_a_value_per_tensor(tmp_path, trio):
    step = """\
        method: linear
        normalize: false
        models:
          - model: a
            weight:
              - {filter: self_attn, value: [0, 1]}
              - {filter: "model.layers.*.mlp.up_proj", value: 0.25}
              - {value: 0.5}
          - {model: b, weight: 0}
        """
    merged, _ = _merge(tmp_path, trio, step)
    a = state_of(trio["a"])
    for name, tensor in merged.items():
        if "self_attn" in name:
            weight = layer_t(name)  # the gradient [0, 1] read at the layer's depth
        elif ".mlp.up_proj" in name:
            weight = 0.25
        else:
            weight = 0.5
        torch.testing.assert_close(tensor, weight * a[name], rtol=1e-5, atol=1e-6)


def test_slerp_follows_the_great_circle(tmp_path, trio):
    merged, _ = _merge(tmp_path, trio, "method: slerp\nbase: a\nmodels: [{model: a}, {model: b}]\nt: [0.2, 0.8]")
    a, b = state_of(trio["a"]), state_of(trio["b"])
    turned = 0
    for name, tensor in merged.items():
        t = 0.2 + 0.6 * layer_t(name)
        expected = slerp_by_hand(t, a[name], b[name])
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=1e-5)
        turned += not torch.allclose(expected, (1 - t) * a[name] + t * b[name], atol=1e-6)
    assert turned, "every tensor fell back to lerp: the test would not see the sphere"


def test_task_arithmetic_adds_scaled_deltas(tmp_path, trio):
    merged, _ = _merge(
        tmp_path,
        trio,
        "method: task_arithmetic\nmodels: [{model: a, weight: 1.0}, {model: b, weight: 0.5}]\nlambda: 0.8",
    )
    base, a, b = state_of(trio["base"]), state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        expected = base[name] + 0.8 * (1.0 * (a[name] - base[name]) + 0.5 * (b[name] - base[name]))
        torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-6)


def test_ties_trims_elects_a_sign_and_takes_the_disjoint_mean(tmp_path, trio):
    merged, _ = _merge(
        tmp_path, trio, "method: ties\nmodels: [{model: a, weight: 1.0}, {model: b, weight: 0.6}]\ndensity: 0.4"
    )
    base, a, b = state_of(trio["base"]), state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        deltas = [a[name] - base[name], b[name] - base[name]]
        torch.testing.assert_close(tensor, ties_by_hand(base[name], deltas, [1.0, 0.6], 0.4), rtol=1e-5, atol=1e-6)


def test_dare_drops_and_rescales_repeatably(tmp_path, trio):
    step = "method: dare_linear\nmodels: [{model: a, weight: 1.0, density: 0.3}]\nseed: "
    runs = []
    for index, seed in enumerate((7, 7, 8)):
        (tmp_path / str(index)).mkdir()
        runs.append(_merge(tmp_path / str(index), trio, step + str(seed))[0])
    first, again, other = runs
    base, a = state_of(trio["base"]), state_of(trio["a"])
    name = "model.layers.1.mlp.down_proj.weight"
    delta, merged_delta = a[name] - base[name], first[name] - base[name]
    kept = merged_delta.abs() > 1e-7
    # every kept entry is the delta scaled by 1 / density, every other one is dropped
    torch.testing.assert_close(merged_delta[kept], delta[kept] / 0.3, rtol=1e-4, atol=1e-6)
    assert abs(kept.float().mean().item() - 0.3) < 0.03
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first[name], other[name])


def test_dare_ties_at_density_one_is_ties_without_trimming(tmp_path, trio):
    merged, _ = _merge(
        tmp_path, trio, "method: dare_ties\nmodels: [{model: a, weight: 0.7}, {model: b, weight: 0.4}]\nnormalize: true"
    )
    base, a, b = state_of(trio["base"]), state_of(trio["a"]), state_of(trio["b"])
    for name, tensor in merged.items():
        deltas = [a[name] - base[name], b[name] - base[name]]
        torch.testing.assert_close(tensor, ties_by_hand(base[name], deltas, [0.7, 0.4], 1.0), rtol=1e-5, atol=1e-6)


def test_tensors_outside_the_globs_come_from_the_base(tmp_path, trio):
    merged, _ = _merge(
        tmp_path,
        trio,
        "method: task_arithmetic\nmodels: [{model: a, weight: 1}]\ntensors: ['model.layers.*.mlp']\ntokenizer: a",
    )
    base, a = state_of(trio["base"]), state_of(trio["a"])
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, a[name] if ".mlp." in name else base[name], rtol=1e-5, atol=1e-6)


def test_the_card_records_sources_fingerprints_and_the_mergekit_config(tmp_path, trio):
    _, result = _merge(tmp_path, trio, "method: ties\nmodels: [{model: a, weight: 1, density: 0.5}, {model: b}]")
    card = (result.target / "README.md").read_text()
    report = json.loads((result.target / "report.json").read_text())
    merge_entry = report["provenance"][0]
    assert merge_entry["op"] == "merge"
    for name in ("a", "b", "base"):
        assert merge_entry["details"]["sources"][name]["fingerprint"] in card
    assert "merge_method: ties" in card and "density: 0.5" in card


def _plan_error(tmp_path, trio, step: str, extra_sources: str = "") -> str:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        f"name: bad\nbase: {trio['base']}\nsources:\n  a: {trio['a']}\n  b: {trio['b']}\n{extra_sources}"
        "steps:\n  - merge:\n" + textwrap.indent(textwrap.dedent(step), " " * 6)
    )
    with pytest.raises(RecipeError) as caught:
        plan_recipe(load_recipe(recipe))
    return str(caught.value)


def test_mistakes_are_reported_with_file_and_line(tmp_path, trio, tokenizer_dir):
    message = _plan_error(tmp_path, trio, "method: slerp\nmodels: [{model: a}, {model: b}]\nt: 0.5")
    assert "bad.yaml:" in message and "exactly one other model" in message
    message = _plan_error(tmp_path, trio, "method: ties\nmodels: [{model: a, density: 1.5}]")
    assert "between 0 and 1" in message
    message = _plan_error(tmp_path, trio, "method: linear\nmodels: [{model: a}, {model: nope}]")
    assert "unknown source 'nope'" in message and "bad.yaml:9" in message


def test_other_shapes_and_other_vocabularies_stop_before_loading(tmp_path, trio, tokenizer_dir):
    wide = save_tiny_model(tmp_path / "wide", "llama", tokenizer_dir, layers=LAYERS, intermediate_size=96)
    message = _plan_error(
        tmp_path, trio, "method: linear\nmodels: [{model: a}, {model: wide}]", extra_sources=f"  wide: {wide}\n"
    )
    assert "intermediate_size is 96 there, 128 here" in message
    other = save_tiny_model(tmp_path / "other", "llama", tokenizer_dir, layers=LAYERS)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    t100, t101 = (next(t for t, i in vocab.items() if i == n) for n in (100, 101))
    vocab[t100], vocab[t101] = 101, 100  # two tokens swap ids: same size, another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(spec))
    message = _plan_error(
        tmp_path, trio, "method: linear\nmodels: [{model: a}, {model: other}]", extra_sources=f"  other: {other}\n"
    )
    assert "another vocabulary" in message and "token 100" in message


def test_merge_recipe_runs_through_the_cli_with_a_summary(tmp_path, trio, capsys):
    recipe = tmp_path / "cli.yaml"
    recipe.write_text(
        f"name: cli-merge\nbase: {trio['base']}\nsources:\n  a: {trio['a']}\n  b: {trio['b']}\n"
        "steps:\n  - merge: {method: ties, models: [{model: a, weight: 1}, {model: b, weight: 1}], density: 0.5}\n"
    )
    code = cli.main(["run", str(recipe), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert printed.out.splitlines()[-1].startswith("exported")


def test_the_trim_keeps_exactly_the_density_share_even_among_equal_magnitudes():
    from surgeon.surgery.merge import magnitude_trim

    delta = torch.tensor([[0.5, -0.5, 0.5, 0.25], [0.5, -0.5, 0.125, 0.5], [0.5, 0.0, -0.5, 0.5]])
    trim = magnitude_trim(delta, 0.5)  # 6 of 12 kept, though 8 share the largest magnitude
    kept = torch.cat([trim(delta[:1]), trim(delta[1:2]), trim(delta[2:])])  # applied a row block at a time
    assert int((kept != 0).sum()) == 6
    assert torch.equal(kept[kept != 0], delta[delta.abs() == 0.5][:6])  # the first ones, in row-major order


def test_a_model_listed_twice_is_refused(tmp_path, trio):
    message = _plan_error(tmp_path, trio, "method: ties\nmodels: [{model: a}, {model: b}, {model: a}]")
    assert "'a' is listed twice" in message and "bad.yaml:9" in message


def test_regmean_fits_each_linear_to_every_models_own_activations(tmp_path, trio, text_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from merge_reference import regmean_by_hand
    from surgeon.text import TextData, token_windows

    texts = {"a": text_dir / "calibration.txt", "b": text_dir / "heldout.txt"}
    step = f"""\
        method: regmean
        alpha: 0.8
        models:
          - {{model: a, data: {{text: {texts["a"]}, tokens: 256, window: 64}}}}
          - {{model: b, weight: 2, data: {{text: {texts["b"]}, tokens: 256, window: 64}}}}
        """
    merged, result = _merge(tmp_path, trio, step)
    tokenizer = AutoTokenizer.from_pretrained(trio["a"])
    models = [AutoModelForCausalLM.from_pretrained(trio[n], dtype=torch.float32).eval() for n in ("a", "b")]
    windows = [token_windows(tokenizer, [texts[n]], TextData(text=str(texts[n]), tokens=256, window=64)) for n in "ab"]
    expected = regmean_by_hand(models, windows, [1.0, 2.0], 0.8)
    solved = [name for name in merged if ".layers." in name and name.endswith("_proj.weight")]
    assert len(solved) == LAYERS * 7
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    # Not a plain average: the Linears moved toward what each model's own text needs.
    a, b = state_of(trio["a"]), state_of(trio["b"])
    assert not torch.allclose(merged[solved[0]], (a[solved[0]] + 2 * b[solved[0]]) / 3, atol=1e-4)
    details = json.loads((result.target / "report.json").read_text())["provenance"][0]["details"]
    assert details["regmean"]["a"]["text"] == "calibration.txt" and details["regmean"]["b"]["tokens"] == 256
    assert "regmean (alpha 0.8) is not a mergekit method" in (result.target / "README.md").read_text()


def test_regmean_mistakes_are_reported_with_file_and_line(tmp_path, trio, text_dir):
    data = f"{{text: {text_dir / 'calibration.txt'}, tokens: 128, window: 64}}"
    message = _plan_error(tmp_path, trio, f"method: regmean\nmodels: [{{model: a, data: {data}}}, {{model: b}}]")
    assert "bad.yaml:" in message and "give each model `data`" in message
    message = _plan_error(tmp_path, trio, f"method: ties\nmodels: [{{model: a, data: {data}}}, {{model: b}}]")
    assert "`data` is regmean's" in message
    message = _plan_error(tmp_path, trio, "method: linear\nalpha: 0.5\nmodels: [{model: a}, {model: b}]")
    assert "`alpha` is regmean's" in message
    for extra, expected in (
        ("normalize: false", "drop `normalize: false`"),
        ("lambda: 0.5", "`lambda` scales task vectors"),
        ("weight: 0", "give a weight above 0"),
        ("weight: [0.5, 1.0]", "weighs a model as a whole"),
    ):
        step = f"method: regmean\n{extra}\nmodels: [{{model: a, data: {data}}}, {{model: b, data: {data}}}]"
        message = _plan_error(tmp_path, trio, step)
        assert "bad.yaml:" in message and expected in message, (extra, message)
    missing = "{text: no-such-file.txt}"
    message = _plan_error(
        tmp_path, trio, f"method: regmean\nmodels: [{{model: a, data: {missing}}}, {{model: b, data: {data}}}]"
    )
    assert "bad.yaml:" in message and "no-such-file.txt" in message


def test_regmean_refuses_linears_with_biases_at_plan(tmp_path, tiny_models, text_dir):
    data = f"{{text: {text_dir / 'calibration.txt'}, tokens: 128, window: 64}}"
    recipe = tmp_path / "biased.yaml"
    recipe.write_text(
        f"name: biased\nbase: {tiny_models['qwen2']}\nsources:\n  a: {tiny_models['qwen2']}\nsteps:\n"
        "  - merge:\n      method: regmean\n"
        f"      models: [{{model: patient, data: {data}}}, {{model: a, data: {data}}}]\n"
    )
    with pytest.raises(RecipeError) as caught:
        plan_recipe(load_recipe(recipe))
    assert "biased.yaml:" in str(caught.value) and "without biases; this model has model.layers.0.self_attn." in str(
        caught.value
    )
