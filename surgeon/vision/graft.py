"""Assemble a VLM from a donor tower, a new projector and the patient's LM.

The LM is not copied: the VLM holds the patient's own module, so until something trains it the
VLM's language model *is* the parent's (same tensors), which is what makes text-only prompts give
exactly the parent's logits.
"""

from __future__ import annotations

import copy

import torch

from .. import families
from ..modeling import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration
from ..modeling.projector import Projector
from .donors import Donor
from .processor import IMAGE_TOKEN, ImageTransform, VLMProcessor, add_image_token

# Prepended to the LM's chat template: structured content ({"type": "image"} / {"type": "text"}
# parts, as transformers' VLM processors pass it) becomes a string with one image token per image,
# which the processor expands to the image's token count. Plain string content is left alone.
IMAGE_PARTS_PREAMBLE = """{%- set flat = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}
{%- set flat.messages = flat.messages + [message] -%}
{%- else -%}
{%- set text = namespace(value='') -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}{%- set text.value = text.value + '@@IMAGE@@\\n' -%}
{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}{%- endif -%}
{%- endfor -%}
{%- set flat.messages = flat.messages + [{'role': message['role'], 'content': text.value}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = flat.messages -%}
"""


def image_chat_template(template: str, image_token: str = IMAGE_TOKEN) -> str:
    if template.startswith(IMAGE_PARTS_PREAMBLE.split("\n", 1)[0]):
        return template  # already wrapped
    return IMAGE_PARTS_PREAMBLE.replace("@@IMAGE@@", image_token) + template


def vlm_config(
    text_config, donor: Donor, projector: str, pixel_shuffle_factor: int, image_token: str, image_token_id: int
) -> SurgeonVLMConfig:
    """The grafted VLM's config: the LM's, the donor tower's layout and preprocessing, the projector."""
    return SurgeonVLMConfig(
        text_config=text_config,
        vision_config=donor.vision_config,
        timm_architecture=donor.timm_architecture,
        image_size=donor.image_size,
        vision_hidden_size=donor.hidden_size,
        vision_grid=list(donor.grid) if donor.grid else None,
        vision_tokens=donor.tokens,
        vision_layer=donor.layer,
        drop_cls=donor.drop_cls,
        projector=projector,
        pixel_shuffle_factor=pixel_shuffle_factor,
        image_token_id=image_token_id,
        image_token=image_token,
        image_mean=list(donor.mean),
        image_std=list(donor.std),
    )


def assemble(
    lm,
    tokenizer,
    donor: Donor,
    projector: str,
    pixel_shuffle_factor: int = 2,
    image_token: str = IMAGE_TOKEN,
    seed: int = 0,
):
    """(VLM, tokenizer with the image token and an image-aware chat template)."""
    tokenizer = copy.deepcopy(tokenizer)  # the parent's tokenizer stays as it was
    image_token_id = add_image_token(tokenizer, image_token)
    if image_token_id < lm.config.vocab_size:
        # An id inside the vocabulary would have a trained embedding and a logit of its own.
        raise ValueError(
            f"{image_token!r} is already token {image_token_id} of the LM's vocabulary; choose another image_token"
        )
    if tokenizer.chat_template:
        tokenizer.chat_template = image_chat_template(tokenizer.chat_template, image_token)
    config = vlm_config(lm.config, donor, projector, pixel_shuffle_factor, image_token, image_token_id)
    with torch.device("meta"):  # the parts below replace everything; nothing is allocated twice
        vlm = SurgeonVLMForConditionalGeneration(config)
    vlm.vision_tower = donor.tower
    vlm.language_model = lm
    generator = torch.random.fork_rng()
    with generator:
        torch.manual_seed(seed)
        vlm.projector = Projector(
            projector, donor.hidden_size, lm.config.hidden_size, grid=donor.grid, factor=pixel_shuffle_factor
        ).to(lm.dtype)
    if donor.projector_state is not None:
        load_llava_projector(vlm.projector, donor.projector_state)
    vlm.generation_config = copy.deepcopy(lm.generation_config)
    for param in vlm.parameters():
        param.requires_grad_(False)
    return vlm.eval(), tokenizer


def load_llava_projector(projector: Projector, state: dict[str, torch.Tensor]) -> None:
    """LLaVA's multi_modal_projector (linear_1, GELU, linear_2) into an mlp2x_gelu projector."""
    if projector.kind != "mlp2x_gelu":
        raise ValueError(f"a LLaVA projector is an mlp2x_gelu, not {projector.kind}")
    mapped = {name.replace("linear_1.", "proj.0.").replace("linear_2.", "proj.2."): t for name, t in state.items()}
    ours = projector.state_dict()
    for name, tensor in mapped.items():
        if name not in ours or ours[name].shape != tensor.shape:
            raise ValueError(
                f"the donor projector's {name} {tuple(tensor.shape)} does not fit "
                f"({tuple(ours[name].shape) if name in ours else 'no such tensor'}): "
                "its LM width must equal the patient's hidden size"
            )
    projector.load_state_dict(mapped)


def processor_for(model, tokenizer) -> VLMProcessor:
    """Training/evaluation inputs for a grafted VLM, from its config."""
    config = model.config
    transform = ImageTransform(config.image_size, tuple(config.image_mean), tuple(config.image_std))
    return VLMProcessor(tokenizer, transform, config.image_seq_length, config.image_token)


def is_vlm(model) -> bool:
    return families.is_surgeon_vlm(model.config)


def language_model(model):
    """The causal LM that answers text: a VLM's own language model, else the model itself (text-only
    measures such as chat_kl and IFEval run on it through the engine)."""
    return model.language_model if is_vlm(model) else model
