"""The Llama family as the engine runs it: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms),
and surgeon's sparse-attention Llama (a lightning indexer on chosen layers).

Weights come from the transformers model that loaded the checkpoint; q/k/v and gate/up are fused
into one matmul each (at batch 1 a step is mostly per-call overhead). Tokens of every sequence in
a step are packed along one axis; `StepBatch` says where each one sits in the paged cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import dense_attention, sparse_topk_attention
from ..batch import StepBatch


class RMSNorm(nn.Module):
    def __init__(self, source: nn.Module):
        super().__init__()
        self.weight = source.weight
        self.eps = getattr(source, "variance_epsilon", getattr(source, "eps", 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As transformers does it: normalise in fp32, scale in the weights' dtype.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _fused(*linears: nn.Linear) -> nn.Linear:
    weight = torch.cat([linear.weight.data for linear in linears])
    biases = [linear.bias for linear in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        fused.bias = nn.Parameter(torch.cat([b.data for b in biases]), requires_grad=False)
    return fused


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] cos/sin -> [T, 1, D] tables for `rotate`, the sign of rotate-half folded into sin
    (once per step, not once per layer)."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Llama rotary on [T, heads, D] (halves paired): x cos + rotate_half(x) sin, the same
    products transformers computes."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, source: nn.Module, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = source.head_dim
        self.scale = source.scaling
        self.qkv = _fused(source.q_proj, source.k_proj, source.v_proj)
        self.o = source.o_proj
        # Qwen3 normalises each head's query and key before rotary.
        self.q_norm = RMSNorm(source.q_norm) if hasattr(source, "q_norm") else None
        self.k_norm = RMSNorm(source.k_norm) if hasattr(source, "k_norm") else None
        self.indexer = getattr(source, "indexer", None)
        self.sparse = getattr(source, "sparse", None)
        self.k_cache = self.v_cache = self.index_cache = None  # set by the runner

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv[:, : self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.heads]), self.k_norm(qk[:, self.heads :])], dim=1)
        qk = rotate(qk, cos, sin)  # queries and keys in one pass: fewer small ops per layer
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        self.k_cache.view(-1, self.kv_heads, self.head_dim).index_copy_(0, batch.slots, k)
        self.v_cache.view(-1, self.kv_heads, self.head_dim).index_copy_(0, batch.slots, v)
        if self.indexer is None:
            out = dense_attention(q, self.k_cache, self.v_cache, batch, self.scale)
        else:
            out = self._sparse(x, q, batch)
        return self.o(out.reshape(tokens, -1))

    def _sparse(self, x: torch.Tensor, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        indexer, settings = self.indexer, self.sparse
        # The indexer works in fp32 whatever the model's dtype (as in surgeon.modeling).
        hidden, positions = x.float()[None], batch.positions[None]
        keys = indexer.keys(hidden, positions)[0]
        self.index_cache.view(-1, indexer.dim).index_copy_(0, batch.slots, keys.to(self.index_cache.dtype))
        index_q = indexer._rotate(indexer.wq(hidden).view(1, -1, indexer.heads, indexer.dim), positions)[0]
        weights = indexer.weights_proj(hidden)[0].float() * indexer.heads**-0.5
        return sparse_topk_attention(
            q,
            self.k_cache,
            self.v_cache,
            index_q,
            weights,
            self.index_cache,
            batch,
            self.scale,
            indexer.dim**-0.5,
            settings.top_k,
            settings.sinks,
            settings.window,
        )


class MLP(nn.Module):
    def __init__(self, source: nn.Module):
        super().__init__()
        self.gate_up = _fused(source.gate_proj, source.up_proj)
        self.down = source.down_proj
        self.act = source.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, source: nn.Module, config):
        super().__init__()
        self.input_norm = RMSNorm(source.input_layernorm)
        self.attention = Attention(source.self_attn, config)
        self.post_attention_norm = RMSNorm(source.post_attention_layernorm)
        self.mlp = MLP(source.mlp)

    def forward(self, x, cos, sin, batch):
        x = x + self.attention(self.input_norm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaEngineModel(nn.Module):
    """Built from a loaded transformers `*ForCausalLM` of one of families.engine_types() (its weights are shared,
    q/k/v and gate/up copied once into fused matrices)."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        config = causal_lm.config
        inner = causal_lm.model
        self.config = config
        self.embed_tokens = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, config) for layer in inner.layers)
        self.norm = RMSNorm(inner.norm)
        self.lm_head = causal_lm.lm_head

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.attention.indexer is not None]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def forward(self, embeds: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """embeds [T, hidden] -> logits [len(batch.logit_rows), vocab] in fp32."""
        cos, sin = self.rotary(embeds[None], batch.positions[None])
        cos, sin = rotary_tables(cos[0], sin[0])
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        x = self.norm(x[batch.logit_rows])
        return self.lm_head(x).float()
