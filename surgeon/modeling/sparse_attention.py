"""DeepSeek-style sparse attention (DSA): a lightning indexer picks, for each query, the top-k keys
that the layer's own attention then reads.

- `LightningIndexer`: a few small heads with queries from the hidden state and ONE key per token
  (LayerNorm, rotary on its first `rope_dim` dimensions); score(t, s) = sum_h w_th * ReLU(q_th . k_s),
  with per-head weights w_t computed from the hidden state (DeepSeek-V3.2, section 2.1).
- `select_keys`: causal top-k over those scores, the first `sinks` tokens and a local `window`
  always kept (inside the k budget); a query that sees at most k keys keeps them all, so short
  contexts are exactly dense.
- `SparseAttention`: mixed into a family's own attention class (Llama's, Qwen's, ...). It turns the
  selection into the attention mask and calls the family's forward unchanged, so the q/k/v/o
  weights keep their names and the KV cache, rotary and GQA work as they did. The indexer's keys
  are cached beside the layer's KV cache.
- `sparse_attention_reference`: the same attention from gathered keys (what a kernel computes):
  the plain-torch reference the Triton kernels are checked against.

Training (surgeon/training/indexer.py) reads `indexer_loss`: KL from the layer's head-summed,
L1-normalised attention to the indexer's softmax, over all visible keys (warm-up, dense) or over the
selected ones (sparse healing). The indexer's input is detached, so that loss trains only the
indexer and the LM's loss never reaches it (top-k has no gradient).

This file imports nothing from surgeon: it is copied beside exported weights as `auto_map` code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SparseSettings:
    top_k: int = 64
    sinks: int = 4
    window: int = 16


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, heads: int, dim: int, rope_dim: int, rope_theta: float):
        super().__init__()
        self.heads, self.dim, self.rope_dim, self.rope_theta = heads, dim, rope_dim, rope_theta
        self.wq = nn.Linear(hidden_size, heads * dim, bias=False)
        self.wk = nn.Linear(hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary position on the first rope_dim dimensions (halves paired, as in Llama)."""
        half = self.rope_dim // 2
        freqs = self.rope_theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = positions.float()[..., None] * freqs  # [B, T, half]
        if x.dim() == 4:
            angles = angles[:, :, None]
        cos, sin = angles.cos(), angles.sin()
        a, b, rest = x[..., :half].float(), x[..., half : self.rope_dim].float(), x[..., self.rope_dim :]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
        return torch.cat([rotated, rest], dim=-1)

    def keys(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, T, dim]: one key per token, shared by every indexer head."""
        return self._rotate(self.k_norm(self.wk(hidden)), positions)

    def scores(self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, T, S] fp32 index scores of T queries against S keys."""
        batch, length, _ = hidden.shape
        queries = self._rotate(self.wq(hidden).view(batch, length, self.heads, self.dim), positions)
        weights = self.weights_proj(hidden).float() * self.heads**-0.5
        logits = torch.einsum("bthd,bsd->bths", queries.float(), keys.float()) * self.dim**-0.5
        return (logits.relu() * weights[..., None]).sum(dim=2)


def attention_target(weights: torch.Tensor) -> torch.Tensor:
    """[B, T, S] fp32: attention probabilities [B, H, T, S] summed over heads, L1-normalised per query:
    what the indexer learns to predict (one selection serves every head)."""
    target = weights.float().sum(dim=1)
    return target / target.sum(-1, keepdim=True).clamp_min(1e-12)


def indexer_kl(scores: torch.Tensor, target: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores)), both over `keys` only ([B, T, S] bool)."""
    logp = scores.masked_fill(~keys, -math.inf).log_softmax(-1)
    terms = torch.where(keys, target * (target.clamp_min(1e-12).log() - logp), 0.0)
    return terms.sum(-1).mean()


def select_keys(scores: torch.Tensor, visible: torch.Tensor, offset: int, settings: SparseSettings) -> torch.Tensor:
    """[B, T, S] bool: each query's selected keys. `visible` says which keys a query may see at all
    (causal and padding); query t sits at key position offset + t."""
    length, keys = scores.shape[-2:]
    if keys <= settings.top_k:
        return visible
    query_pos = torch.arange(length, device=scores.device)[:, None] + offset
    key_pos = torch.arange(keys, device=scores.device)[None, :]
    forced = (key_pos < settings.sinks) | (query_pos - key_pos < settings.window)
    ranked = scores.detach().masked_fill(forced, math.inf).masked_fill(~visible, -math.inf)
    # A stable sort over the keys newest-first: ties (ReLU scores are often exactly 0) go to the
    # nearest keys, and a query picks the same keys whether the sequence is complete or still growing.
    order = ranked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., : settings.top_k]
    chosen = torch.zeros_like(visible).scatter_(-1, keys - 1 - order, True)
    return chosen & visible


def visible_keys(attention_mask, batch: int, length: int, keys: int, offset: int, device) -> torch.Tensor:
    """[B, T, S] bool from the causal position and the mask the model passed (bool, additive or None)."""
    causal = torch.arange(keys, device=device)[None, :] <= torch.arange(length, device=device)[:, None] + offset
    visible = causal.expand(batch, length, keys)
    if attention_mask is not None:
        mask = attention_mask[:, 0, :, -keys:] if attention_mask.dim() == 4 else attention_mask[:, None, -keys:]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        visible = visible & allowed
    return visible


class SparseAttention:
    """Mixed into a family's attention class by `make_sparse`; needs `self.indexer` and `self.sparse`.

    Flags set by surgeon.training (plain attributes, so inference never pays for them):
    `dense` (the indexer scores but selection is off: warm-up), `want_loss`, `want_recall`.
    """

    dense = False
    want_loss = False
    want_recall = False
    indexer_loss = None
    recall = None  # (captured attention mass summed over long-context queries, how many such queries)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        batch, length, _ = hidden_states.shape
        layer_cache = None
        if cache is not None and self.layer_idx < len(cache.layers):
            layer_cache = cache.layers[self.layer_idx]
        offset = cache.get_seq_length(self.layer_idx) if layer_cache is not None else 0
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(offset, offset + length, device=hidden_states.device)[None].expand(batch, -1)
        # Detached: the indexer learns only from its own loss, never from the LM's. In fp32 with
        # autocast off: bf16 scores tie far more often, and CPU bf16 einsum and sort are slow.
        hidden = hidden_states.detach()
        with torch.autocast(hidden.device.type, enabled=False):
            keys = self.indexer.keys(hidden, positions)
            past = getattr(layer_cache, "indexer_keys", None)
            if past is not None:
                keys = torch.cat([past[:, :offset], keys], dim=1)  # [:offset]: the cache may have been cropped
            total = keys.shape[1]
            scores = self.indexer.scores(hidden, positions, keys)
        visible = visible_keys(attention_mask, batch, length, total, offset, hidden.device)
        chosen = visible if self.dense else select_keys(scores, visible, offset, self.sparse)
        if chosen is not visible:  # else exactly the dense layer, mask and all
            attention_mask = self._as_mask(chosen, hidden_states.dtype)
        output, weights = super().forward(
            hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache, **kwargs
        )
        if cache is not None:
            cache.layers[self.layer_idx].indexer_keys = keys
        if self.want_loss or self.want_recall:
            if weights is None:
                raise RuntimeError("indexer training needs the attention weights: run with attn_implementation eager")
            target = attention_target(weights.detach())
            if self.want_loss:
                self.indexer_loss = indexer_kl(scores, target, chosen)
            if self.want_recall:
                picked = select_keys(scores, visible, offset, self.sparse)
                long = visible.sum(-1) > self.sparse.top_k
                captured = (target * picked).sum(-1)[long]
                done = self.recall or (0.0, 0)
                self.recall = (done[0] + captured.sum().item(), done[1] + captured.numel())
        return output, weights

    def _as_mask(self, chosen: torch.Tensor, dtype) -> torch.Tensor:
        """[B, 1, T, S] in the form the attention implementation reads: additive for eager, bool otherwise."""
        if self.config._attn_implementation == "eager":
            return torch.zeros(chosen.shape, dtype=dtype, device=chosen.device).masked_fill_(
                ~chosen, torch.finfo(dtype).min
            )[:, None]
        return chosen[:, None]


_SPARSE_CLASSES: dict[type, type] = {}


def make_sparse(attention: nn.Module, indexer: LightningIndexer, settings: SparseSettings) -> None:
    """Turn one attention module into its sparse version in place (its weights and names unchanged)."""
    base = type(attention)
    if base not in _SPARSE_CLASSES:
        _SPARSE_CLASSES[base] = type(f"Sparse{base.__name__}", (SparseAttention, base), {})
    attention.__class__ = _SPARSE_CLASSES[base]
    attention.indexer = indexer
    attention.sparse = settings


def sparse_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, SparseAttention)]


def mean_indexer_loss(modules) -> torch.Tensor:
    """Mean over sparse layers of the indexer KL each computed in the last forward."""
    return torch.stack([m.indexer_loss for m in modules]).mean()


def sparse_attention_reference(query, key, value, indices, scaling: float) -> torch.Tensor:
    """Attention of each query over its own gathered keys.

    query [B, H, T, D]; key, value [B, Hkv, S, D]; indices [B, T, K] key positions, -1 for none.
    Returns [B, H, T, D]. Query head h reads KV head h // (H / Hkv), as in GQA.
    """
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    valid = indices >= 0
    safe = indices.clamp_min(0)
    gather = safe[:, None, :, :, None].expand(batch, key.shape[1], length, safe.shape[-1], dim)
    k = torch.gather(key[:, :, None].expand(-1, -1, length, -1, -1), 3, gather)  # [B, Hkv, T, K, D]
    v = torch.gather(value[:, :, None].expand(-1, -1, length, -1, -1), 3, gather)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.einsum("bhtd,bhtkd->bhtk", query.float(), k.float()) * scaling
    probs = logits.masked_fill(~valid[:, None], -math.inf).softmax(-1)
    return torch.einsum("bhtk,bhtkd->bhtd", probs, v.float()).to(query.dtype)


def attention_flops(
    length: int,
    layers: int,
    heads: int,
    head_dim: int,
    settings: SparseSettings | None = None,
    index_heads: int = 0,
    index_dim: int = 0,
) -> int:
    """Multiply-adds x 2 of the score and value products over one causal sequence (projections excluded).

    Dense: every query reads every earlier key. Sparse: min(t + 1, k) keys for query t, plus the
    indexer's ReLU scores over every earlier key (its heads x dim per pair)."""
    pairs = length * (length + 1) // 2
    if settings is None:
        return 2 * 2 * heads * head_dim * pairs * layers
    k = settings.top_k
    read = sum(min(t + 1, k) for t in range(length)) if length > k else pairs
    return (2 * 2 * heads * head_dim * read + 2 * index_heads * index_dim * pairs) * layers
