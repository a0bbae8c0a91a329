"""Merge methods written out by hand in plain torch, for tests to compare surgeon's merges with, and
the tiny checkpoints they merge (a base and two small, partly opposing changes of it)."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file, save_file

from conftest import save_tiny_model

LAYERS = 4


def make_trio(root, tokenizer_dir) -> dict:
    base = save_tiny_model(root / "base", "llama", tokenizer_dir, seed=0, layers=LAYERS)
    base_state = state_of(base)
    folders = {"base": base}
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        changed = {k: v + 0.02 * torch.randn_like(v) for k, v in base_state.items()}
        folders[name] = save_tiny_model(root / name, "llama", tokenizer_dir, seed=0, layers=LAYERS)
        save_file(changed, str(folders[name] / "model.safetensors"), metadata={"format": "pt"})
    return folders


def state_of(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def layer_t(name: str) -> float:
    """mergekit's depth of a tensor: layer i of LAYERS at i / (LAYERS - 1), other tensors at 0."""
    parts = name.split(".")
    return int(parts[2]) / (LAYERS - 1) if parts[:2] == ["model", "layers"] else 0.0


def gradient(values: list[float], t: float) -> float:
    position = t * (len(values) - 1)
    low = min(int(position), len(values) - 2)
    return values[low] + (position - low) * (values[low + 1] - values[low])


def slerp_by_hand(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    a, b = v0.double().flatten(), v1.double().flatten()
    cos = float((a / a.norm()) @ (b / b.norm()))
    if abs(cos) > 0.9995:
        return ((1 - t) * v0.double() + t * v1.double()).float()
    theta = math.acos(cos)
    s0, s1 = math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
    return (s0 * v0.double() + s1 * v1.double()).float()


def ties_by_hand(base, deltas, weights, density):
    trimmed = []
    for delta in deltas:
        keep = int(density * delta.numel())
        order = delta.abs().flatten().argsort(descending=True)
        mask = torch.zeros(delta.numel())
        mask[order[:keep]] = 1
        trimmed.append(delta * mask.view_as(delta))
    weighted = [w * d for w, d in zip(weights, trimmed)]
    sign = torch.where(sum(weighted) >= 0, 1.0, -1.0)
    agree = [(torch.sign(wd) == sign).float() for wd in weighted]
    total = sum(wd * m for wd, m in zip(weighted, agree))
    divisor = sum(w * m for w, m in zip(weights, agree))
    return base + total / torch.where(divisor == 0, 1.0, divisor)


def regmean_by_hand(models, windows, weights, alpha):
    """RegMean written out: per decoder Linear, W = (sum_i w_i W_i G_i)(sum_i w_i G_i)^-1 with
    G_i = X_i^T X_i / tokens over model i's own windows, off-diagonals scaled by alpha; the other
    tensors the weighted average. Returns the merged state dict."""
    grams_of = []
    for model, rows in zip(models, windows):
        inputs = {}
        hooks = [
            module.register_forward_hook(
                lambda _m, args, _out, name=name, seen=inputs: seen.setdefault(name, []).append(args[0])
            )
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
        ]
        with torch.no_grad():
            for row in rows:
                model(input_ids=row[None])
        for hook in hooks:
            hook.remove()
        grams = {}
        for name, seen in inputs.items():
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen]).double()
            gram = x.T @ x / rows.numel()
            off = gram * alpha
            off.diagonal().copy_(gram.diagonal())
            grams[name] = off
        grams_of.append(grams)
    states = [{k: v.double() for k, v in m.state_dict().items()} for m in models]
    merged = {}
    for key in states[0]:
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in grams_of[0]:
            products = sum(w * s[key] @ g[module] for w, s, g in zip(weights, states, grams_of))
            total = sum(w * g[module] for w, g in zip(weights, grams_of))
            merged[key] = (products @ torch.linalg.inv(total)).float()
        else:
            merged[key] = (sum(w * s[key] for w, s in zip(weights, states)) / sum(weights)).float()
    return merged
