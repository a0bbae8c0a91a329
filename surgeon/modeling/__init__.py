"""Model classes transformers lacks, registered with its Auto classes on import (so
`AutoModelForImageTextToText.from_pretrained` loads a surgeon VLM, and `AutoModelForCausalLM` a
sparse-attention LM, once surgeon is imported).

They are also registered for `auto_map`: save_pretrained writes the model's file and the files it
imports beside the weights, so plain transformers loads the export with `trust_remote_code=True`."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from .sparse_llama import SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM
from .vlm import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration

AutoConfig.register(SurgeonVLMConfig.model_type, SurgeonVLMConfig, exist_ok=True)
AutoModelForImageTextToText.register(SurgeonVLMConfig, SurgeonVLMForConditionalGeneration, exist_ok=True)
SurgeonVLMConfig.register_for_auto_class()
SurgeonVLMForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

AutoConfig.register(SurgeonSparseLlamaConfig.model_type, SurgeonSparseLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM, exist_ok=True)
SurgeonSparseLlamaConfig.register_for_auto_class()
SurgeonSparseLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "SurgeonSparseLlamaConfig",
    "SurgeonSparseLlamaForCausalLM",
    "SurgeonVLMConfig",
    "SurgeonVLMForConditionalGeneration",
]
