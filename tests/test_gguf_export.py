"""GGUF export: transformers' GGUF loader reads the file back as the same model (within the
format's rounding), the tokenizer and chat template survive, and what GGUF cannot hold is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import requires_smollm2, tiny_family_config
from surgeon.checkpoints.gguf_export import export_gguf
from surgeon.errors import ExportError


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = reference.log_softmax(-1)
    return (p.exp() * (p - other.log_softmax(-1))).sum(-1).mean().item()


@pytest.mark.parametrize(
    "family,kind,bound",
    [("llama", "f16", 1e-5), ("llama", "q8_0", 2e-3), ("mistral", "q4_0", 0.05), ("qwen2", "bf16", 1e-3)],
)
def test_transformers_reads_the_gguf_back_as_the_same_model(tmp_path, tiny_models, family, kind, bound):
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    path = export_gguf(model, tokenizer, tmp_path / f"tiny-{kind}.gguf", kind)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 30, 31, 32, 33, 34, 35, 36, 37, 38]])
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits[0], loaded(input_ids=ids).logits[0]
    assert _kl(expected, got) < bound
    # A random tiny model has near-ties that rounding may flip.
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= (1.0 if kind == "f16" else 0.7)
    round_trip = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "The quick brown fox jumps over the lazy dog."
    assert round_trip(text)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_an_existing_file_is_kept_and_nothing_half_written_is_left(tmp_path, tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    target = tmp_path / "model.gguf"
    target.write_text("keep me")
    with pytest.raises(ExportError, match="already exists"):
        export_gguf(model, tokenizer, target, "q8_0")
    assert target.read_text() == "keep me"
    with pytest.raises(ExportError, match="choose one of"):
        export_gguf(model, tokenizer, tmp_path / "other.gguf", "q3_k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_sparse_attention_is_refused_with_the_reason(tmp_path, tiny_llama):
    from types import SimpleNamespace

    fake = SimpleNamespace(config=tiny_family_config("surgeon_sparse_llama"))
    with pytest.raises(ExportError, match="sparse attention .* has no GGUF"):
        export_gguf(fake, None, tmp_path / "dsa.gguf", "q8_0")


@pytest.mark.real_model
@requires_smollm2
def test_smollm2_q8_0_round_trip_is_within_the_format(tmp_path):
    from pathlib import Path

    from surgeon.checkpoints.sources import resolve_source

    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    model, tokenizer = source.load_model(), source.load_tokenizer()
    path = export_gguf(model, tokenizer, tmp_path / "smollm2-q8_0.gguf", "q8_0")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True, tokenize=False
    )
    answer = (
        "Red, orange and yellow are three of them. A rainbow forms when sunlight passes through drops of "
        "rain: each drop bends the light, splits it into its colours and reflects it back towards you, so "
        "the colours always appear in the same order, from red on the outside to violet on the inside. "
        "You see one only with the sun behind you and the rain in front of you, which is why rainbows are "
        "most common on showery afternoons and early evenings, when the sun is low in the sky."
    )
    ids = torch.tensor([tokenizer(chat + answer)["input_ids"]])
    with torch.no_grad():
        kl = _kl(model(input_ids=ids).logits[0], loaded(input_ids=ids).logits[0])
    assert kl < 0.002, kl
    round_trip = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert round_trip.chat_template == tokenizer.chat_template


def test_a_recipe_exports_gguf_beside_the_safetensors(tmp_path, tiny_llama, write_recipe):
    from surgeon.recipe.run import run_recipe
    from surgeon.recipe.schema import load_recipe

    path = write_recipe(
        f"""
        name: tiny-dropped
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [2, 3]}}
        export: {{gguf: [q8_0, f16]}}
        """
    )
    run_recipe(load_recipe(path), out=tmp_path / "out")
    for kind in ("q8_0", "f16"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file=f"tiny-dropped.{kind}.gguf")
        assert loaded.config.num_hidden_layers == 4


def test_a_recipe_asking_gguf_of_sparse_attention_fails_at_plan_with_its_line(tiny_llama, text_dir, write_recipe):
    from surgeon.errors import RecipeError
    from surgeon.recipe.plan import plan_recipe
    from surgeon.recipe.schema import load_recipe

    path = write_recipe(
        f"""
        name: tiny-dsa
        base: {tiny_llama}
        steps:
          - sparse_attention: {{top_k: 8, sinks: 2, window: 3, index_heads: 2, index_dim: 16, rope_dim: 8}}
        export:
          gguf: q8_0
        """
    )
    with pytest.raises(RecipeError, match=r"recipe.yaml:6: export.gguf: .*sparse attention"):
        plan_recipe(load_recipe(path))


def test_cli_export_gguf(tmp_path, tiny_llama):
    from surgeon.cli import main

    target = tmp_path / "tiny.gguf"
    assert main(["export-gguf", str(tiny_llama), "--type", "q4_1", "--out", str(target)]) in (0, None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert loaded.config.num_hidden_layers == 6


def test_tensor_type_overrides_pick_each_tensors_type_as_llama_quantize_does(tmp_path, tiny_llama):
    from gguf import GGMLQuantizationType, GGUFReader

    from surgeon.cli import main

    target = tmp_path / "mixed.gguf"
    argv = ["export-gguf", str(tiny_llama), "--type", "q8_0", "--out", str(target)]
    overrides = ["--tensor-type", "token_embd=F16", "--tensor-type", r"blk\.1\.ffn_=q4_0", "--tensor-type", "ffn_=f16"]
    assert main([*argv, *overrides]) in (0, None)
    types = {t.name: t.tensor_type for t in GGUFReader(str(target)).tensors}
    assert types["token_embd.weight"] == GGMLQuantizationType.F16
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType.Q4_0
    assert types["blk.0.ffn_down.weight"] == GGMLQuantizationType.F16  # the later pattern, where the first misses
    assert types["blk.1.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.1.ffn_norm.weight"] == GGMLQuantizationType.F32  # norms stay f32 whatever matches
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mixed.gguf")
    assert loaded.config.num_hidden_layers == 6


@pytest.mark.parametrize(
    "item,message",
    [("attn_q", "PATTERN=TYPE"), ("attn_q=q3_k", "PATTERN=TYPE"), ("attn_(=f16", "not a regular expression"),
     ("no_such_tensor=f16", "no 2-D tensor's GGUF name matches")],
)  # fmt: skip
def test_bad_tensor_types_are_refused_before_anything_is_written(tmp_path, tiny_llama, item, message, capsys):
    from surgeon.cli import main

    target = tmp_path / "never.gguf"
    assert main(["export-gguf", str(tiny_llama), "--out", str(target), "--tensor-type", item]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_pattern_given_twice_is_refused(tmp_path, tiny_llama, capsys):
    from surgeon.cli import main

    argv = ["export-gguf", str(tiny_llama), "--out", str(tmp_path / "never.gguf")]
    assert main([*argv, "--tensor-type", "attn_q=f16", "--tensor-type", "attn_q=q4_0"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
