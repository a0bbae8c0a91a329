"""A whole model's KV heads merged: the calibration statistic the inits fit to (each layer's
attention-input covariance) and the rewrite of every layer's q/k/v/o projections from the per-group
math in kv_heads.py. The result is a state dict for the same architecture with fewer KV heads.
Also what a merge is judged by before it is done, per layer: how alike the KV heads' outputs are
(mean pairwise cosine) and the output energy the svd merge loses; analyze and reduce_kv_heads
both report them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .. import families
from .architecture import head_dim
from .capture import on_input
from .kv_heads import INITS, fold_into_output, fold_into_queries, merge_keys, merge_values, relative_error


@contextmanager
def key_input_covariance(model, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """While open, accumulate per layer E[x x^T] (float64, a 1 appended to x for the bias) of the
    K/V projections' input over every forward pass; the list is complete on exit (empty when not
    `enabled`, so a caller can gather it only when it is needed)."""
    hidden = model.config.hidden_size
    layers = model.base_model.layers
    sums = [torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for _ in layers] if enabled else []
    count = [0]

    def take(index, x, _kwargs):
        x = x.reshape(-1, hidden).double()
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
        sums[index] += x.T @ x
        if index == 0:
            count[0] += x.shape[0]

    projections = {i: layer.self_attn.k_proj for i, layer in enumerate(layers)} if enabled else {}
    with on_input(projections, take):
        yield sums
    for s in sums:
        s /= max(count[0], 1)


@torch.inference_mode()
def attention_input_covariance(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """key_input_covariance over one pass of `windows` (one window at a time)."""
    with key_input_covariance(model) as sigmas:
        for row in tqdm(windows, desc="kv calibration", unit="window", leave=False):
            model.base_model(input_ids=row[None], use_cache=False)
    return sigmas


def merge_kv_heads(model, target: int, init: str, sigmas: list[torch.Tensor] | None):
    """(new state dict with `target` KV heads per layer, {init: {"k": error, "v": error}} of every
    init on the calibration statistic when `sigmas` are given, else {})."""
    config = model.config
    normed = families.has_qk_norm(config.model_type)  # keys normalised per head: the key map cannot pass the norm
    state = dict(model.state_dict())
    totals = {name: {"k": [0.0, 0.0], "v": [0.0, 0.0]} for name in INITS} if sigmas is not None else {}
    for index, layer in enumerate(model.base_model.layers):
        sigma = sigmas[index] if sigmas is not None else None
        merged = _merge_layer(layer.self_attn, config, target, init, normed, sigma, totals)
        state.update({f"model.layers.{index}.self_attn.{name}": tensor for name, tensor in merged.items()})
    errors = {name: {kind: (e / t if t else 0.0) for kind, (e, t) in kinds.items()} for name, kinds in totals.items()}
    return state, errors


def _merge_layer(attn, config, target: int, init: str, normed: bool, sigma, totals: dict) -> dict[str, torch.Tensor]:
    """One attention block's new q/k/v/o tensors; adds every init's error on `sigma` to `totals`."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = head_dim(config)
    r = kv // target
    per_kv = heads // kv  # query heads reading each old KV head
    parts = {}
    for kind in ("k", "v"):
        proj = getattr(attn, f"{kind}_proj")
        parts[kind] = (_with_bias(proj).split(hd), proj.bias is not None)  # rows of [kv*hd, in+1]
    q_rows = list(_with_bias(attn.q_proj).split(hd))
    o_cols = list(attn.o_proj.weight.double().split(hd, dim=1))
    new = {"k": [], "v": []}
    for group in range(target):
        members = list(range(group * r, (group + 1) * r))
        for kind in ("k", "v"):
            weights = [parts[kind][0][i] for i in members]
            sig = sigma if sigma is not None else torch.eye(weights[0].shape[1], dtype=torch.float64)
            merger = merge_keys if kind == "k" else merge_values

            def init_for(name: str, kind=kind) -> str:
                return "mean" if name == "svd" and kind == "k" and normed else name

            merged = merger(weights, sig, init_for(init))
            new[kind].append(merged.shared)
            for position, old in enumerate(members):
                for h in range(old * per_kv, (old + 1) * per_kv):
                    if kind == "k":
                        q_rows[h] = fold_into_queries(q_rows[h], merged.maps[position])
                    else:
                        o_cols[h] = fold_into_output(o_cols[h], merged.maps[position])
            if sigma is not None:
                for name in INITS:
                    err, tot = relative_error(weights, merger(weights, sigma, init_for(name)), sigma)
                    totals[name][kind][0] += err
                    totals[name][kind][1] += tot
    dtype = attn.k_proj.weight.dtype
    out = {}
    for kind in ("k", "v"):
        rows = torch.cat(new[kind])
        out[f"{kind}_proj.weight"] = rows[:, :-1].to(dtype).contiguous()
        if parts[kind][1]:
            out[f"{kind}_proj.bias"] = rows[:, -1].to(dtype).contiguous()
    q_new = torch.cat(q_rows)
    out["q_proj.weight"] = q_new[:, :-1].to(dtype).contiguous()
    if attn.q_proj.bias is not None:
        out["q_proj.bias"] = q_new[:, -1].to(dtype).contiguous()
    out["o_proj.weight"] = torch.cat(o_cols, dim=1).to(dtype).contiguous()
    return out


def kv_head_similarity(model, sigmas: list[torch.Tensor]) -> dict[str, list[float]]:
    """Per layer, the mean over pairs of KV heads of cos(head i's outputs, head j's outputs)."""
    hd = head_dim(model.config)
    result = {"k": [], "v": []}
    for layer, sigma in zip(model.base_model.layers, sigmas, strict=True):
        for kind in ("k", "v"):
            heads = _with_bias(getattr(layer.self_attn, f"{kind}_proj")).split(hd)
            projected = [w @ sigma for w in heads]
            gram = torch.tensor([[float((p * w).sum()) for w in heads] for p in projected])
            norms = gram.diagonal().clamp_min(1e-30).sqrt()
            cos = gram / (norms[:, None] * norms[None, :])
            pairs = torch.triu_indices(len(heads), len(heads), offset=1)
            result[kind].append(cos[pairs[0], pairs[1]].mean().item())
    return result


def svd_merge_loss(model, sigmas: list[torch.Tensor], target: int) -> dict[str, list[float]]:
    """Per layer, the share of K and V output energy lost when merging to `target` heads with the svd
    init (mean keys where a per-head norm forbids the key map, as reduce_kv_heads does)."""
    config = model.config
    hd = head_dim(config)
    r = config.num_key_value_heads // target
    key_init = "mean" if families.has_qk_norm(config.model_type) else "svd"
    result = {"k": [], "v": []}
    for layer, sigma in zip(model.base_model.layers, sigmas, strict=True):
        for kind, merger, init in (("k", merge_keys, key_init), ("v", merge_values, "svd")):
            heads = _with_bias(getattr(layer.self_attn, f"{kind}_proj")).split(hd)
            lost = total = 0.0
            for group in range(target):
                weights = list(heads[group * r : (group + 1) * r])
                err, tot = relative_error(weights, merger(weights, sigma, init), sigma)
                lost, total = lost + err, total + tot
            result[kind].append(lost / total if total else 0.0)
    return result


def _with_bias(linear: torch.nn.Linear) -> torch.Tensor:
    """[out, in + 1] in float64, the bias (or zeros) as the last column, matching the covariance."""
    weight = linear.weight.detach().double()
    bias = (
        linear.bias.detach().double() if linear.bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    )
    return torch.cat([weight, bias[:, None]], dim=1)
