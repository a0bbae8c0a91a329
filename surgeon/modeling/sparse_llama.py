"""A Llama-architecture causal LM (SmolLM2, Llama, ...) whose chosen layers use DeepSeek-style
sparse attention: the parent's weights under their own names, plus one lightning indexer per
sparse layer (`model.layers.N.self_attn.indexer.*`).

`config.sparse_attention` holds the layers and the indexer's shape; generate() and the KV cache
work as in Llama (the indexer's keys are cached beside each layer's keys and values).
Like sparse_attention.py, this file imports nothing from surgeon outside modeling/.
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from .sparse_attention import LightningIndexer, SparseSettings, make_sparse

DEFAULTS = {"layers": None, "top_k": 64, "sinks": 4, "window": 16, "index_heads": 4, "index_dim": 32, "rope_dim": 16}


class SurgeonSparseLlamaConfig(LlamaConfig):
    """`sparse_attention`: {layers (indices; None = all), top_k, sinks, window, index_heads,
    index_dim, rope_dim}."""

    model_type = "surgeon_sparse_llama"

    def __init__(self, sparse_attention: dict | None = None, **kwargs):
        self.sparse_attention = {**DEFAULTS, **(sparse_attention or {})}
        super().__init__(**kwargs)

    def sparse_layers(self) -> list[int]:
        layers = self.sparse_attention["layers"]
        return list(range(self.num_hidden_layers)) if layers is None else list(layers)


class SurgeonSparseLlamaForCausalLM(LlamaForCausalLM):
    config_class = SurgeonSparseLlamaConfig

    def __init__(self, config: SurgeonSparseLlamaConfig):
        super().__init__(config)
        spec = config.sparse_attention
        settings = SparseSettings(top_k=spec["top_k"], sinks=spec["sinks"], window=spec["window"])
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        for index in config.sparse_layers():
            indexer = LightningIndexer(
                config.hidden_size, spec["index_heads"], spec["index_dim"], spec["rope_dim"], theta
            )
            make_sparse(self.model.layers[index].self_attn, indexer, settings)
