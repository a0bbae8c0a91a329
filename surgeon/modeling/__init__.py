"""Model classes transformers lacks, registered with its Auto classes on import (so
`AutoModelForImageTextToText.from_pretrained` loads a surgeon VLM once surgeon is imported)."""

from transformers import AutoConfig, AutoModelForImageTextToText

from .vlm import SurgeonVLMConfig, SurgeonVLMForConditionalGeneration

AutoConfig.register(SurgeonVLMConfig.model_type, SurgeonVLMConfig, exist_ok=True)
AutoModelForImageTextToText.register(SurgeonVLMConfig, SurgeonVLMForConditionalGeneration, exist_ok=True)

__all__ = ["SurgeonVLMConfig", "SurgeonVLMForConditionalGeneration"]
