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
