"""The assembled VLM: text-only prompts are the LM exactly; images enter through their placeholders;
generate() with images matches a cache-free greedy loop; save and load give identical logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, CLIPVisionConfig

from conftest import tiny_config
from surgeon.errors import DataError
from surgeon.modeling import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration


def tiny_vlm(projector: str = "mlp2x_gelu", timm: bool = False, text=None) -> SurgeonVLMForConditionalGeneration:
    text = text or tiny_config("llama")
    torch.manual_seed(0)
    if timm:
        config = SurgeonVLMConfig(
            text_config=text,
            timm_architecture="tf_efficientnet_lite0",
            image_size=64,
            vision_hidden_size=1280,
            vision_grid=[2, 2],
            vision_tokens=4,
            projector=projector,
            image_token_id=text.vocab_size,
        )
    else:
        vision = CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
        config = SurgeonVLMConfig(
            text_config=text,
            vision_config=vision,
            image_size=32,
            vision_hidden_size=32,
            vision_grid=[4, 4],
            vision_tokens=16,
            vision_layer=-2,
            projector=projector,
            image_token_id=text.vocab_size,
        )
    model = SurgeonVLMForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the default init, so images visibly matter
        for p in model.projector.parameters():
            p.normal_(0, 0.2)
    return model


def prompt(model, images: int, text: list[int]) -> torch.Tensor:
    span = [model.config.image_token_id] * model.config.image_seq_length
    return torch.tensor([[1] + span * images + text])


def test_text_only_prompts_give_exactly_the_lms_logits():
    model = tiny_vlm()
    lm = AutoModelForCausalLM.from_config(model.config.text_config).eval()
    lm.load_state_dict(model.language_model.state_dict())
    ids = torch.tensor([[1, 5, 9, 40, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, lm(input_ids=ids).logits)


@pytest.mark.parametrize(
    "projector,timm",
    [
        ("mlp2x_gelu", False),
        ("pixel_shuffle", False),
        ("pixel_shuffle_mlp", False),
        ("pixel_shuffle_pooled", False),
        ("linear", True),
    ],
)
def test_images_replace_their_placeholders(projector, timm):
    model = tiny_vlm(projector, timm)
    size = model.config.image_size
    ids = prompt(model, 2, [5, 9, 40])
    a, b = torch.randn(2, 3, size, size), torch.randn(2, 3, size, size)
    with torch.no_grad():
        with_a = model(input_ids=ids, pixel_values=a).logits
        assert torch.equal(with_a, model(input_ids=ids, pixel_values=a).logits)
        assert not torch.allclose(with_a[0, -1], model(input_ids=ids, pixel_values=b).logits[0, -1])
        embeds = model.embed(ids, a)
        features = model.image_features(a)
        n = model.config.image_seq_length
        assert torch.equal(embeds[0, 1 : 1 + n], features[0]) and torch.equal(embeds[0, 1 + n : 1 + 2 * n], features[1])
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model(input_ids=ids, pixel_values=a[:1])
    with pytest.raises(ValueError, match="no pixel_values"):
        model(input_ids=ids)


def test_generate_with_images_matches_a_cache_free_greedy_loop():
    model = tiny_vlm()
    ids = prompt(model, 1, [5, 9])
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        generated = model.generate(
            input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=None
        )
        expected = ids
        for _ in range(6):
            logits = model(input_ids=expected, pixel_values=pixels).logits[0, -1]
            expected = torch.cat([expected, logits.argmax().view(1, 1)], dim=1)
    assert torch.equal(generated, expected)


def test_batched_generate_with_different_image_counts_matches_each_row_alone():
    model = tiny_vlm()
    n, image = model.config.image_seq_length, model.config.image_token_id
    rows = [[1] + [image] * n * 2 + [5, 9], [1] + [image] * n + [7, 40, 3, 11, 12, 13]]  # 2 images, 1 image
    pixels = torch.randn(3, 3, 32, 32)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[2] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.no_grad():
        batched = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, **settings)
        first = model.generate(input_ids=torch.tensor([rows[0]]), pixel_values=pixels[:2], **settings)
        second = model.generate(input_ids=torch.tensor([rows[1]]), pixel_values=pixels[2:], **settings)
    assert batched[0, -5:].tolist() == first[0, -5:].tolist()
    assert batched[1, -5:].tolist() == second[0, -5:].tolist()


def test_save_and_load_give_identical_logits(tmp_path):
    model = tiny_vlm()
    model.save_pretrained(tmp_path / "vlm")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm").eval()
    assert isinstance(loaded, SurgeonVLMForConditionalGeneration)
    ids, pixels = prompt(model, 1, [5, 9, 40]), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, pixel_values=pixels).logits, loaded(input_ids=ids, pixel_values=pixels).logits
        )


def test_plain_transformers_loads_the_export_as_remote_code(tmp_path):
    """save_pretrained writes the model's code beside the weights (auto_map): a process that never
    imports surgeon loads it with trust_remote_code=True and gets the same logits."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    model = tiny_vlm()
    folder = tmp_path / "vlm"
    model.save_pretrained(folder)
    assert {"vlm.py", "towers.py", "projector.py"} <= {p.name for p in folder.iterdir()}
    ids, pixels = prompt(model, 1, [5, 9]), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits
    save_file({"ids": ids, "pixels": pixels, "logits": logits}, str(tmp_path / "probe.safetensors"))
    code = f"""
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
probe = load_file({str(tmp_path / "probe.safetensors")!r})
with torch.no_grad():
    same = torch.equal(model(input_ids=probe["ids"], pixel_values=probe["pixels"]).logits, probe["logits"])
print(same, "surgeon" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


@pytest.fixture
def processor(tokenizer_dir):
    from transformers import AutoTokenizer

    from surgeon.vision.processor import ImageTransform, VLMProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return VLMProcessor(tokenizer, ImageTransform(32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), image_seq_length=16)


def test_processor_expands_images_and_targets_only_answers(processor):
    from surgeon.vision.processor import collate
    from surgeon.vision.synthetic import SyntheticQuestions

    assert processor.image_token_id == 320  # past the tiny LM's 320-token vocabulary
    one, two = SyntheticQuestions(seed=0, size=48).examples("train", 2)
    two["images"].append(one["images"][0])
    two["messages"][0]["content"].insert(0, {"type": "image"})
    a, b = processor.encode(one), processor.encode(two)
    assert a.ids.count(320) == 16 and b.ids.count(320) == 32 and b.pixel_values.shape == (2, 3, 32, 32)
    answer = processor.tokenizer.decode([t for t, m in zip(a.ids, a.mask) if m])
    assert answer.startswith(one["answer"])  # the answer and the end of the turn, nothing else
    batch = collate([a, b], pad_id=2)
    assert batch["pixel_values"].shape == (3, 3, 32, 32) and batch["input_ids"].shape[0] == 2
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    with pytest.raises(DataError, match="1 image parts in the messages but 2 images given"):
        processor.encode({"images": one["images"] * 2, "messages": one["messages"]})


def test_projector_only_training_step_touches_only_the_projector(processor):
    from surgeon.vision.processor import collate
    from surgeon.vision.synthetic import SyntheticQuestions

    model = tiny_vlm()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("projector."))
    records = list(SyntheticQuestions(seed=1, size=32).examples("train", 3))
    batch = collate([processor.encode(r) for r in records], pad_id=2)
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(n.startswith("projector.") for n in grads)
    inputs = processor.prompt(records[0]["messages"][:1], records[0]["images"])
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=2)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("how", ["special", "ordinary"])
def test_only_image_parts_make_image_slots(tokenizer_dir, how):
    """A typed "<image>" is text, whether the tokenizer holds the placeholder as a special token
    (as graft_vision adds it) or as an ordinary added one; with nothing typed, the ids are the
    rendered chat's in one tokenizer call, as before this care."""
    from transformers import AutoTokenizer

    from surgeon.vision.processor import ImageTransform, VLMProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if how == "ordinary":
        tokenizer.add_tokens(["<image>"])
    processor = VLMProcessor(tokenizer, ImageTransform(16, (0.5,) * 3, (0.5,) * 3), image_seq_length=4)
    image = processor.image_token_id
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "is <image> a tag? <image>"}]}]
    ids, mask = processor.encode_text(typed, 1, assistant_only=False)
    assert ids.count(image) == 4 and not any(m for t, m in zip(ids, mask) if t == image)
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}]
    rendered = tokenizer.apply_chat_template(processor.flatten(plain, 1, "test"), tokenize=False)
    assert (
        processor.encode_text(plain, 1, assistant_only=False)[0]
        == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    assert image not in processor.text_ids("a typed <image> in a plain prompt")


def test_the_shared_prompt_opening_runs_once_and_changes_no_loss_or_gradient(processor):
    from surgeon.training.vision_loop import AnswerLoss, shifted_targets
    from surgeon.vision.processor import collate
    from surgeon.vision.synthetic import SyntheticQuestions

    model = tiny_vlm()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("projector."))
    records = list(SyntheticQuestions(seed=2, size=32, kinds=("colour", "count")).examples("train", 4))
    encoded = [processor.encode(r) for r in records]
    batch = collate(encoded, pad_id=2)
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "targets": shifted_targets(batch["input_ids"], [e.mask for e in encoded]),
        "pixel_values": batch["pixel_values"],
    }
    shared = AnswerLoss(model)
    start, cache = shared.prefix.split(
        model.language_model, inputs["input_ids"], inputs["attention_mask"], inputs["targets"]
    )
    assert 0 < start < inputs["input_ids"].tolist()[0].index(model.config.image_token_id) + 1 and cache is not None

    def loss_and_grad(body):
        model.zero_grad()
        loss, correct, scored = body(**inputs)
        loss.backward()
        return loss.detach(), correct, scored.sum(1), model.projector.proj[0].weight.grad.clone()

    whole = AnswerLoss(model, shared_opening=False)
    for got, want in zip(loss_and_grad(shared), loss_and_grad(whole)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(shared.prefix._states) == 1  # computed once, reused by the second call
    loss_and_grad(shared)
    assert len(shared.prefix._states) == 1

    model.language_model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)  # a trained LM layer
    assert (
        shared.prefix.split(model.language_model, inputs["input_ids"], inputs["attention_mask"], inputs["targets"])[0]
        == 0
    )


def test_tower_outputs_come_back_from_the_disk_cache_keyed_by_pixels_and_weights(processor):
    from types import SimpleNamespace

    from PIL import Image

    from surgeon.vision.feature_cache import FeatureCache
    from surgeon.vision.features import tower_features

    model = tiny_vlm()

    def example(shade: int):
        image = Image.new("RGB", (32, 32), (shade, 17, 255 - shade))
        return SimpleNamespace(images=[lambda: image])

    examples = [example(shade) for shade in (11, 83, 201)]
    first = tower_features(model, processor, examples, batch=2)
    assert first.from_cache == 0 and first.features.shape[0] == 3
    again = tower_features(model, processor, examples, batch=2)
    assert again.from_cache == 3 and torch.equal(again.features, first.features)
    regrouped = tower_features(model, processor, examples[::-1], batch=3)  # another order and batch size
    assert regrouped.from_cache == 3 and torch.equal(regrouped.features, first.features.flip(0))
    mixed = tower_features(model, processor, [example(12), examples[1]], batch=2)  # other pixels, other entry
    assert mixed.from_cache == 1 and torch.equal(mixed.features[1], first.features[1])

    folder = FeatureCache(model.vision_tower, model.projector_dtype, torch.bfloat16).folder
    for entry in folder.glob("*.safetensors"):
        entry.write_bytes(b"damaged")
    mended = tower_features(model, processor, examples, batch=2)
    assert mended.from_cache == 0 and torch.equal(mended.features, first.features)

    with torch.no_grad():  # other weights: another fingerprint, so nothing is read back
        for param in model.vision_tower.parameters():
            param.add_(0.05 * torch.randn_like(param))
    changed = tower_features(model, processor, examples, batch=2)
    assert changed.from_cache == 0 and not torch.equal(changed.features, first.features)
