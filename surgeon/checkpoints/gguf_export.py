"""Write a model as a GGUF file that llama.cpp (and Ollama, and transformers' GGUF loader) runs.

The `gguf` package (llama.cpp's own Python writer and quantizers) does the encoding; this module
maps names and metadata. Types: f16, bf16, q8_0, q4_0, q4_1 (blocks of 32: 576-wide rows divide
into them, not into the 256-element blocks of the K-quants). Norms stay f32. With a 4-bit type the
token embeddings (also the output head when tied) are written q8_0, as llama.cpp's own SmolLM2 file
has them: a 4-bit embedding table costs far more quality than it saves. `tensor_types` overrides
the type of chosen tensors, as llama-quantize's `--tensor-type PATTERN=TYPE` does (a regular
expression searched in the GGUF tensor name: `token_embd=f16`, `attn_=f16`, `blk[.]0[.]=f16`).

llama.cpp's `llama` architecture applies rotary embedding to interleaved pairs of dimensions,
transformers' Llama to the two halves of each head: the q and k projections' rows are permuted so
the same model comes out (transformers' loader undoes it when reading a GGUF back).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from .. import families
from ..errors import ExportError
from .atomic import atomic_file

log = logging.getLogger(__name__)

TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1")

# llama.cpp picks its pre-tokenizer (how text is split before BPE) by name. Vocabularies it knows by
# another name than their split rule suggests, keyed by the sha256 of the token list:
KNOWN_VOCABULARIES = {
    "d1f2ce856b324081b621d9e2e8dbd22879f462329f3fd4aa39fa758dddb2ce55": "smollm",  # SmolLM2 (its GGUF says so)
}


def _types():
    from gguf import GGMLQuantizationType, LlamaFileType

    return {
        "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
        "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
        "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
        "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
        "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    }


def check_exportable(config, where: str) -> str:
    """The GGUF architecture for `config`, or an ExportError saying why there is none."""
    row = families.family(config.model_type)
    arch = row.gguf_arch if row is not None else None
    if arch is None:
        if families.is_sparse_export(config.model_type):
            why = "DeepSeek-style sparse attention (a lightning indexer and top-k keys) has no GGUF/llama.cpp form"
        elif row is not None and row.role == "vlm":
            why = (
                "surgeon's vision-language class has no GGUF/llama.cpp form "
                "(llama.cpp keeps vision towers in a separate mmproj file)"
            )
        else:
            supported = ", ".join(sorted(t for t, r in families.FAMILIES.items() if r.gguf_arch))
            why = f"GGUF export knows {supported}"
        raise ExportError(f"{where}: cannot export '{config.model_type}' as GGUF: {why}")
    return arch


def parse_tensor_types(items: list[str], where: str = "--tensor-type") -> dict[str, str]:
    """["PATTERN=TYPE", ...] -> {pattern: type}, each pattern a valid regular expression."""
    overrides = {}
    for item in items:
        pattern, _, kind = item.rpartition("=")
        kind = kind.lower()  # Q8_0 as llama-quantize writes it, or q8_0
        if not pattern or kind not in TYPES:
            raise ExportError(f"{where} '{item}': write PATTERN=TYPE with TYPE one of {', '.join(TYPES)}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ExportError(f"{where} '{item}': '{pattern}' is not a regular expression ({exc})") from None
        if pattern in overrides:
            raise ExportError(f"{where} '{item}': '{pattern}' is given twice (the first match wins: give it once)")
        overrides[pattern] = kind
    return overrides


def export_gguf(
    model,
    tokenizer,
    target: Path,
    kind: str,
    name: str = "",
    overwrite: bool = False,
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write `model` as `target` (a .gguf file), atomically: a temporary file renamed into place.
    `tensor_types`: {regular expression searched in the GGUF name: type} for chosen 2-D tensors
    (the first that matches wins); a pattern that matches no tensor is an error."""
    from gguf import GGMLQuantizationType, GGUFWriter

    if kind not in TYPES:
        raise ExportError(f"GGUF type '{kind}': choose one of {', '.join(TYPES)}")
    tensor_types = tensor_types or {}
    config = model.config
    arch = check_exportable(config, str(target))
    target = Path(target)
    if target.exists() and not overwrite:
        raise ExportError(f"{target} already exists (pass --overwrite)")
    names = [gguf_name for gguf_name, tensor in _tensors(model, False) if tensor.dim() == 2]
    unused = [p for p in tensor_types if not any(re.search(p, n) for n in names)]
    if unused:  # before writing anything
        raise ExportError(f"{target}: no 2-D tensor's GGUF name matches tensor type pattern(s) {', '.join(unused)}")
    qtype, file_type = _types()[kind]
    with atomic_file(target) as tmp:
        writer = GGUFWriter(str(tmp), arch)
        _write_metadata(writer, config, arch, name or target.stem, file_type)
        _write_tokenizer(writer, tokenizer)
        embed_type = GGMLQuantizationType.Q8_0 if kind.startswith("q4") else qtype
        permute = families.family(config.model_type).gguf_interleaved_rope
        for gguf_name, tensor in _tensors(model, permute):
            is_embedding = gguf_name in ("token_embd.weight", "output.weight")
            chosen = embed_type if is_embedding else qtype
            pattern = next((p for p in tensor_types if re.search(p, gguf_name)), None)
            if pattern is not None and tensor.dim() == 2:
                chosen = _types()[tensor_types[pattern]][0]
            _add_tensor(writer, gguf_name, tensor, chosen)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    log.info("wrote %s (%s, %.1f MB)", target, kind, target.stat().st_size / 1e6)
    return target


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def _write_metadata(writer, config, arch: str, name: str, file_type) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for how this tokenizer splits text before BPE."""
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    digest = hashlib.sha256("\n".join(tokens).encode()).hexdigest()
    if digest in KNOWN_VOCABULARIES:
        return KNOWN_VOCABULARIES[digest]
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = backend.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in pre.get("pretokenizers", [pre])]
    if kinds == ["ByteLevel"]:
        return "gpt2"
    if "Digits" in kinds and "ByteLevel" in kinds:
        return "smollm"  # digits one by one, then GPT-2's rule
    if kinds == ["Split", "ByteLevel"]:
        pattern = str(pre["pretokenizers"][0].get("pattern", {}).get("Regex", ""))
        for piece, name in families.GGUF_PRE_TOKENIZERS.items():
            if piece in pattern:
                return name
    raise ExportError(f"GGUF export: no llama.cpp pre-tokenizer is known for a {' + '.join(map(str, kinds))} split")


def _write_tokenizer(writer, tokenizer) -> None:
    from gguf import TokenType

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"GGUF export writes byte-level BPE vocabularies; this tokenizer is {model.get('type')}")
    vocab = tokenizer.get_vocab()
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TokenType.UNUSED] * size
    special = {added["content"] for added in backend.get("added_tokens", []) if added.get("special")}
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = TokenType.CONTROL if token in special else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for role, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)  # the chat template writes its own start tokens
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' half-split rotary layout -> llama.cpp's interleaved pairs, per head."""
    rows, columns = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _tensors(model, permute_rotary: bool):
    """(GGUF name, tensor) for every weight, in llama.cpp's naming."""
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    state = model.state_dict()
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    tied = getattr(config, "tie_word_embeddings", False)
    if not tied:
        yield "output.weight", state["lm_head.weight"]
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for index in range(config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        for suffix, gguf_suffix in names.items():
            tensor = state.get(prefix + suffix)
            if tensor is None:
                continue
            if permute_rotary and suffix.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = config.num_attention_heads if "q_proj" in suffix else kv_heads
                tensor = _permute_rotary(tensor if tensor.dim() == 2 else tensor[:, None], heads).reshape(tensor.shape)
            yield f"blk.{index}.{gguf_suffix}", tensor


def _add_tensor(writer, name: str, tensor: torch.Tensor, qtype) -> None:
    from gguf import GGMLQuantizationType, quants

    data = tensor.detach().float().contiguous().numpy()
    if data.ndim == 1:  # norms and biases: f32 (llama.cpp reads them so)
        writer.add_tensor(name, data.astype(np.float32))
        return
    if qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
        return
    writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
