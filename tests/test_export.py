"""Exports: atomic, complete, and loadable by plain transformers with identical logits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from surgeon.errors import ExportError
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe


def drop_recipe(write_recipe, model, text_dir, extra: str = "") -> str:
    return write_recipe(f"""
        name: tiny-drop
        description: A tiny model with two layers fewer.
        base: {model}
        steps:
          - evaluate: {{data: {{text: {text_dir}/heldout.txt, tokens: 512, window: 128}}}}
          - drop_layers:
              auto: {{metric: angular, count: 2}}
              calibration: {{text: {text_dir}/calibration.txt, tokens: 1024, window: 128}}
          - evaluate: {{data: {{text: {text_dir}/heldout.txt, tokens: 512, window: 128}}}}
        {extra}
        """)


def plain_transformers_logits(folder, ids_file, out_file) -> None:
    """Load the export in a fresh interpreter that never imports surgeon."""
    script = textwrap.dedent(f"""
        import sys, torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r})
        AutoTokenizer.from_pretrained({str(folder)!r})
        ids = load_file({str(ids_file)!r})["ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert not any(name.split(".")[0] == "surgeon" for name in sys.modules), "surgeon was imported"
        save_file({{"logits": logits.contiguous()}}, {str(out_file)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=folder.parent)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_export_loads_in_plain_transformers_with_identical_logits(
    family, tiny_models, text_dir, write_recipe, tmp_path
):
    recipe = load_recipe(drop_recipe(write_recipe, tiny_models[family], text_dir))
    result = run_recipe(recipe, out=tmp_path / "export")
    folder = result.target
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    plain_transformers_logits(folder, tmp_path / "ids.safetensors", tmp_path / "logits.safetensors")
    with torch.no_grad():
        expected = result.patient.model(input_ids=ids).logits
    loaded = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    assert (loaded - expected).abs().max().item() <= 1e-4

    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and "quantization_config" not in config
    assert "auto_map" not in config  # a standard architecture: no remote code


def test_export_contents_report_and_card(tiny_llama, text_dir, write_recipe, tmp_path):
    path = drop_recipe(write_recipe, tiny_llama, text_dir)
    result = run_recipe(load_recipe(path), out=tmp_path / "export")
    folder = result.target
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "recipe.yaml",
        "report.json",
        "README.md",
    ):
        assert (folder / name).is_file(), name
    assert (folder / "recipe.yaml").read_text() == path.read_text()

    report = json.loads((folder / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["base", "after drop_layers"]
    for stage in report["stages"]:
        assert set(stage["metrics"]) == {
            "kl_mean",
            "kl_median",
            "kl_p99",
            "kl_max",
            "top1_agreement",
            "ppl",
            "ppl_parent",
            "tokens",
        }
    base_stage, after = (s["metrics"] for s in report["stages"])
    assert base_stage["kl_mean"] < 1e-5 and base_stage["top1_agreement"] == 1.0
    assert after["kl_mean"] > base_stage["kl_mean"] and after["ppl_parent"] == pytest.approx(base_stage["ppl_parent"])
    (entry,) = report["provenance"]
    assert entry["op"] == "drop_layers" and len(entry["params"]["layers"]) == 2
    assert report["shape"]["before"]["layers"] == 6 and report["shape"]["after"]["layers"] == 4
    assert report["memory"]["peak_rss_bytes"] > 0

    card = (folder / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert "model-surgeon" in front["tags"] and "layer-pruning" in front["tags"]
    assert "| after drop_layers | heldout.txt |" in card and "```yaml" in card


def test_export_dtype_converts_weights_and_keeps_ties(tiny_llama, text_dir, write_recipe, tmp_path):
    path = drop_recipe(write_recipe, tiny_llama, text_dir, extra="export: {dtype: bfloat16}")
    folder = run_recipe(load_recipe(path), out=tmp_path / "export").target
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in names  # tied to the embeddings, saved once
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_existing_target_is_refused_before_any_work(tiny_llama, text_dir, write_recipe, tmp_path, monkeypatch):
    target = tmp_path / "export"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    monkeypatch.setattr("surgeon.recipe.patient.Patient.from_source", lambda *_: pytest.fail("weights were loaded"))
    with pytest.raises(ExportError, match="already exists"):
        run_recipe(load_recipe(drop_recipe(write_recipe, tiny_llama, text_dir)), out=target)
    assert (target / "keep.txt").read_text() == "mine"


def test_failed_export_leaves_nothing_behind(tiny_llama, text_dir, write_recipe, tmp_path, monkeypatch):
    def broken_card(*_args, **_kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("surgeon.checkpoints.export.render_card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        run_recipe(load_recipe(drop_recipe(write_recipe, tiny_llama, text_dir)), out=tmp_path / "out" / "export")
    assert list((tmp_path / "out").iterdir()) == []


def test_overwrite_replaces_the_previous_export(tiny_llama, text_dir, write_recipe, tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    run_recipe(load_recipe(drop_recipe(write_recipe, tiny_llama, text_dir)), out=target, overwrite=True)
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
