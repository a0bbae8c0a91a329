"""Model classes transformers lacks, registered with its Auto classes on import (so
`AutoModelForImageTextToText.from_pretrained` loads a surgeon VLM once surgeon is imported).

They are also registered for `auto_map`: save_pretrained writes vlm.py and the files it imports
beside the weights, so plain transformers loads the export with `trust_remote_code=True`."""

from transformers import AutoConfig, AutoModelForImageTextToText

from .vlm import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration

AutoConfig.register(SurgeonVLMConfig.model_type, SurgeonVLMConfig, exist_ok=True)
AutoModelForImageTextToText.register(SurgeonVLMConfig, SurgeonVLMForConditionalGeneration, exist_ok=True)
SurgeonVLMConfig.register_for_auto_class()
SurgeonVLMForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

__all__ = ["SurgeonVLMConfig", "SurgeonVLMForConditionalGeneration"]
