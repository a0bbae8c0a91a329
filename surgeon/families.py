"""What surgeon knows of each model family, one frozen row per transformers `model_type` (cf.
mergekit's architecture definitions as data). Every caller asks the helpers below; no other module
names a model type.

Adding a family is adding a row, after a tiny fixture in tests/conftest.py builds it and the tests
named in `tested` run on it (tests/test_families.py checks the fixture exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SURGEON_VLM = "surgeon_vlm"  # modeling/vlm.py's SurgeonVLMConfig.model_type (a test holds them equal)
SURGEON_SPARSE_LLAMA = "surgeon_sparse_llama"  # modeling/sparse_llama.py's config
LLAVA = "llava"


@dataclass(frozen=True)
class Family:
    model_type: str
    role: Literal["lm", "vlm", "vision"]  # decoder LM, image+text container, or image encoder
    surgery: bool = False  # a recipe may load it as a source and operate on its layers and heads
    engine: bool = False  # the embedded engine serves it (surgeon chat / serve)
    residual_mlp: bool = False  # plain pre-norm residual MLP: a dropped run's linear bridge folds into down_proj
    qk_norm: bool = False  # per-head q/k RMSNorm: merged keys must start from the mean, not an SVD mix
    sparse_base: bool = False  # sparse_attention converts its attention (lightning indexer + top-k)
    plain_cache: bool = False  # its forward continues from a DynamicCache built from given keys/values
    vision_tower: str | None = None  # for an image encoder: the tower kind it donates ("clip", "siglip")
    gguf_arch: str | None = None  # llama.cpp's architecture name: `surgeon export-gguf` writes it
    gguf_interleaved_rope: bool = False  # llama.cpp rotates interleaved pairs: q/k rows are permuted
    tested: tuple[str, ...] = ()  # the test files that run it (each through a tiny fixture)
    real: str = ""  # a real checkpoint the tests also run it on, if any


_LM_TESTS = ("test_layers.py", "test_metrics.py", "test_kv_heads.py")

FAMILIES: dict[str, Family] = {
    row.model_type: row
    for row in (
        Family(
            "llama",
            "lm",
            surgery=True,
            plain_cache=True,
            engine=True,
            residual_mlp=True,
            sparse_base=True,
            gguf_arch="llama",
            gguf_interleaved_rope=True,
            tested=(*_LM_TESTS, "test_export.py", "test_engine.py", "test_sparse_attention.py", "test_gguf_export.py"),
            real="SmolLM2-135M-Instruct",
        ),
        Family(
            "mistral",
            "lm",
            surgery=True,
            engine=True,
            residual_mlp=True,
            gguf_arch="llama",
            gguf_interleaved_rope=True,
            tested=(*_LM_TESTS, "test_engine.py", "test_gguf_export.py"),
        ),
        Family(
            "qwen2",
            "lm",
            surgery=True,
            plain_cache=True,
            engine=True,
            residual_mlp=True,
            gguf_arch="qwen2",
            tested=(*_LM_TESTS, "test_engine.py", "test_gguf_export.py"),
        ),
        Family(
            "qwen3",
            "lm",
            surgery=True,
            plain_cache=True,
            engine=True,
            residual_mlp=True,
            qk_norm=True,
            tested=(*_LM_TESTS, "test_engine.py"),
        ),
        # Gemma's MLP output passes a post-feedforward norm before the residual: no linear bridge.
        Family("gemma2", "lm", surgery=True, tested=_LM_TESTS),
        Family(
            "gemma3_text",
            "lm",
            surgery=True,
            qk_norm=True,
            tested=(*_LM_TESTS, "test_export.py"),
            real="gemma3-270m (GGUF)",
        ),
        Family(SURGEON_SPARSE_LLAMA, "lm", engine=True, tested=("test_sparse_attention.py", "test_engine.py")),
        Family(SURGEON_VLM, "vlm", engine=True, tested=("test_vlm.py", "test_graft_vision.py")),
        Family(LLAVA, "vlm", engine=True, tested=("test_graft_vision.py",)),
        Family("clip", "vision", vision_tower="clip", tested=("test_graft_vision.py",)),
        Family(
            "clip_vision_model", "vision", vision_tower="clip", tested=("test_graft_vision.py", "test_vision_parts.py")
        ),
        Family("siglip", "vision", vision_tower="siglip"),
        Family(
            "siglip_vision_model",
            "vision",
            vision_tower="siglip",
            tested=("test_graft_vision.py", "test_vision_parts.py"),
        ),
    )
}


# llama.cpp's names for a byte-level BPE tokenizer's split rule (`tokenizer.ggml.pre`), recognised
# by a piece of the rule's regex; ByteLevel alone is "gpt2", digits split first then ByteLevel "smollm".
GGUF_PRE_TOKENIZERS = {
    r"\p{N}{1,3}": "llama-bpe",  # Llama 3: numbers in runs of up to three digits
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}": "qwen2",  # Qwen2: one digit at a time
}


def family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


def model_type_of(config) -> str | None:
    return getattr(config, "model_type", None)


def _where(flag: str) -> tuple[str, ...]:
    return tuple(t for t, row in FAMILIES.items() if getattr(row, flag))


def surgery_types() -> tuple[str, ...]:
    return _where("surgery")


def engine_types() -> tuple[str, ...]:
    """The decoder LMs the engine serves (VLMs are served when their language model is one)."""
    return tuple(t for t in _where("engine") if FAMILIES[t].role == "lm")


def bridgeable_types() -> tuple[str, ...]:
    return _where("residual_mlp")


def _flag(model_type: str | None, flag: str) -> bool:
    row = family(model_type)
    return bool(row and getattr(row, flag))


def is_bridgeable(model_type: str | None) -> bool:
    return _flag(model_type, "residual_mlp")


def has_qk_norm(model_type: str | None) -> bool:
    return _flag(model_type, "qk_norm")


def has_plain_cache(model_type: str | None) -> bool:
    """Full attention everywhere and nothing kept beside the keys and values (no sliding windows,
    no indexer keys): a cache built from a shared prefix's keys and values continues it exactly."""
    return _flag(model_type, "plain_cache")


def is_sparse_base(model_type: str | None) -> bool:
    return _flag(model_type, "sparse_base")


def is_sparse_export(model_type: str | None) -> bool:
    """A model sparse_attention made (its config carries the indexers' settings)."""
    return model_type == SURGEON_SPARSE_LLAMA


def sparse_base_types() -> tuple[str, ...]:
    return _where("sparse_base")


def is_surgeon_vlm(config) -> bool:
    """A VLM surgeon grafted (its language model in `text_config`)."""
    return model_type_of(config) == SURGEON_VLM


def is_llava(config) -> bool:
    return model_type_of(config) == LLAVA


def vision_tower_kind(model_type: str | None) -> str | None:
    row = family(model_type)
    return row.vision_tower if row else None
