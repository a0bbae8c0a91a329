"""The assembled VLM: text-only prompts are the LM exactly; images enter through their placeholders;
generate() with images matches a cache-free greedy loop; save and load give identical logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, CLIPVisionConfig

from surgeon.modeling import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration

from conftest import tiny_config


def tiny_vlm(projector: str = "mlp2x_gelu", timm: bool = False) -> SurgeonVLMForConditionalGeneration:
    text = tiny_config("llama")
    torch.manual_seed(0)
    if timm:
        config = SurgeonVLMConfig(text_config=text, timm_architecture="tf_efficientnet_lite0", image_size=64,
                                  vision_hidden_size=1280, vision_grid=[2, 2], vision_tokens=4,
                                  projector=projector, image_token_id=text.vocab_size)
    else:
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8)
        config = SurgeonVLMConfig(text_config=text, vision_config=vision, image_size=32, vision_hidden_size=32,
                                  vision_grid=[4, 4], vision_tokens=16, vision_layer=-2, projector=projector,
                                  image_token_id=text.vocab_size)
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


@pytest.mark.parametrize("projector,timm", [("mlp2x_gelu", False), ("pixel_shuffle", False), ("linear", True)])
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
        assert torch.equal(embeds[0, 1:1 + n], features[0]) and torch.equal(embeds[0, 1 + n:1 + 2 * n], features[1])
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model(input_ids=ids, pixel_values=a[:1])
    with pytest.raises(ValueError, match="no pixel_values"):
        model(input_ids=ids)


def test_generate_with_images_matches_a_cache_free_greedy_loop():
    model = tiny_vlm()
    ids = prompt(model, 1, [5, 9])
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        generated = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False,
                                   pad_token_id=2, eos_token_id=None)
        expected = ids
        for _ in range(6):
            logits = model(input_ids=expected, pixel_values=pixels).logits[0, -1]
            expected = torch.cat([expected, logits.argmax().view(1, 1)], dim=1)
    assert torch.equal(generated, expected)


def test_save_and_load_give_identical_logits(tmp_path):
    model = tiny_vlm()
    model.save_pretrained(tmp_path / "vlm")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm").eval()
    assert isinstance(loaded, SurgeonVLMForConditionalGeneration)
    ids, pixels = prompt(model, 1, [5, 9, 40]), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, pixel_values=pixels).logits,
                           loaded(input_ids=ids, pixel_values=pixels).logits)
