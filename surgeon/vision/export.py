"""What a grafted VLM is saved as, and the processor saved beside it.

- A transformers CLIP/SigLIP tower with LLaVA's projector (mlp2x_gelu) is exactly LLaVA:
  it is saved as `LlavaForConditionalGeneration`, which plain transformers, vLLM and SGLang load
  with no remote code. LLaVA looks the image token up in the embedding table, so the table gains
  one zero row for it (the image id's logit is then always 0; every other logit is unchanged).
- Anything else is saved as surgeon's own class with `auto_map` code beside the weights.

Either way the processor is transformers' `LlavaProcessor` (placeholder expansion) around a
`CLIPImageProcessor` set to the donor's square resize and normalisation, so `AutoProcessor` finds
it without remote code.
"""

from __future__ import annotations

import math

import torch


def llava_compatible(config) -> bool:
    return config.vision_config is not None and config.projector == "mlp2x_gelu"


def to_llava(vlm):
    """The same model as a LlavaForConditionalGeneration (weights shared where shapes allow)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = vlm.config
    text = config.text_config
    vocab = config.image_token_id + 1
    has_cls = vlm.vision_tower.has_cls
    llava_config = LlavaConfig(
        vision_config=config.vision_config.to_dict(),
        text_config={**text.to_dict(), "vocab_size": vocab},
        image_token_id=config.image_token_id,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        vision_feature_layer=config.vision_layer,
        # LLaVA's "default" drops the first token (CLIP's CLS); "full" keeps every token.
        vision_feature_select_strategy="default" if has_cls and config.drop_cls else "full",
        image_seq_length=config.image_seq_length,
        tie_word_embeddings=getattr(text, "tie_word_embeddings", False),
    )
    with torch.device("meta"):
        llava = LlavaForConditionalGeneration(llava_config)
    theirs = llava.state_dict()
    state = {}
    tower_keys = {k.removeprefix("model.vision_tower.") for k in theirs if k.startswith("model.vision_tower.")}
    for name, tensor in vlm.vision_tower.model.state_dict().items():
        key = name if name in tower_keys else name.removeprefix("vision_model.")
        state[f"model.vision_tower.{key}"] = tensor
    for ours, llava_name in (("proj.0", "linear_1"), ("proj.2", "linear_2")):
        for part in ("weight", "bias"):
            state[f"model.multi_modal_projector.{llava_name}.{part}"] = vlm.projector.state_dict()[f"{ours}.{part}"]
    for name, tensor in vlm.language_model.state_dict().items():
        key = "lm_head.weight" if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = torch.cat([tensor, tensor.new_zeros(1, tensor.shape[1])])  # the image token's row
        state[key] = tensor
    missing, unexpected = set(theirs) - set(state), set(state) - set(theirs)
    if llava_config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        unexpected.discard("lm_head.weight")
    if missing or unexpected:
        raise ValueError(f"LLaVA layout mismatch: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    llava.load_state_dict({k: v for k, v in state.items() if k in theirs}, strict=False, assign=True)
    if llava_config.tie_word_embeddings:
        llava.tie_weights()
    llava.generation_config = vlm.generation_config
    return llava.eval()


def hf_processor(config, tokenizer):
    """transformers' LlavaProcessor + CLIPImageProcessor reproducing the training-time inputs."""
    from transformers import CLIPImageProcessor, LlavaProcessor
    from transformers.image_utils import PILImageResampling

    size = {"height": config.image_size, "width": config.image_size}
    images = CLIPImageProcessor(
        size=size,
        crop_size=size,
        do_center_crop=False,
        resample=PILImageResampling.BICUBIC,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        do_convert_rgb=True,
    )
    tokens = config.image_seq_length
    side = math.isqrt(tokens)
    # LlavaProcessor writes (size // patch)^2 + extra placeholders per image.
    if side * side == tokens and config.image_size % side == 0:
        patch, extra = config.image_size // side, 0
    else:
        side = math.isqrt(tokens - 1) if tokens > 1 else 0
        patch, extra = (
            (config.image_size // side, tokens - side * side)
            if side and config.image_size % side == 0
            else (config.image_size, tokens - 1)
        )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=extra,
        chat_template=tokenizer.chat_template,
        image_token=config.image_token,
    )
