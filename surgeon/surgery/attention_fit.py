"""Layer-local fitting of a rewritten attention block to its parent's (used after merging KV heads).

Each layer's attention is trained, on its own, to give the parent's attention output for the
parent's attention input on calibration text: relative squared error, Adam over q/k/v/o (and
norms). Teacher-forced and layer-independent, it costs a few attention-block passes per layer
rather than whole-model steps with a vocabulary-sized loss, and it goes through the softmax that
the closed-form inits (kv_heads.py) cannot see. Whole-model healing then fixes what compounds.

The parent's inputs and outputs are captured with hooks in one forward pass, together with the
keyword arguments the family passes its attention (rotary tables, masks), so any family's attention
module is called exactly as its decoder layer calls it.
"""

from __future__ import annotations

import logging
import math

import torch
from tqdm.auto import tqdm

from .capture import on_input, on_output

log = logging.getLogger(__name__)


@torch.no_grad()
def capture_attention(model, windows: torch.Tensor) -> list[dict]:
    """Per layer: {"x": [N, T, H] inputs, "y": [N, T, H] outputs, "kwargs": what the layer passed}."""
    layers = model.base_model.layers
    taken = [{"x": [], "y": [], "kwargs": None} for _ in layers]
    attentions = {index: layer.self_attn for index, layer in enumerate(layers)}

    def before(index, hidden, kwargs):
        taken[index]["x"].append(hidden.float())
        if taken[index]["kwargs"] is None:  # equal-length windows without padding: the same for all
            taken[index]["kwargs"] = {
                k: v for k, v in kwargs.items() if k not in ("hidden_states", "cache", "past_key_values")
            }

    with on_input(attentions, before), on_output(attentions, lambda index, out: taken[index]["y"].append(out.float())):
        for row in tqdm(windows, desc="parent attention", unit="window", leave=False):
            model.base_model(input_ids=row[None], use_cache=False)
    return [{"x": torch.cat(t["x"]), "y": torch.cat(t["y"]), "kwargs": t["kwargs"]} for t in taken]


def output_error(attention, x: torch.Tensor, y: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = attention(hidden_states=x.to(_dtype(attention)), **kwargs)[0].float()
    return (out - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-12)


def fit_attention(model, captured: list[dict], steps: int, lr: float, batch: int = 4, seed: int = 0) -> list[dict]:
    """Train each layer's attention in place (its parameters must be the model's own copies).
    Returns per layer {"before": error, "after": error} on all captured windows."""
    generator = torch.Generator().manual_seed(seed)
    report = []
    for index, layer in enumerate(tqdm(model.base_model.layers, desc="attention fit", unit="layer", leave=False)):
        attention, data = layer.self_attn, captured[index]
        params = list(attention.parameters())
        for param in params:
            param.data = param.data.clone()  # tensors still shared with the parent (norms) stay untouched
            param.requires_grad_(True)
        with torch.no_grad():
            before = output_error(attention, data["x"], data["y"], data["kwargs"]).item()
        optimizer = torch.optim.Adam(params, lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))
        )
        n = data["x"].shape[0]
        for _ in range(steps):
            rows = torch.randint(0, n, (min(batch, n),), generator=generator)
            loss = output_error(attention, data["x"][rows], data["y"][rows], data["kwargs"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        for param in params:
            param.requires_grad_(False)
        with torch.no_grad():
            after = output_error(attention, data["x"], data["y"], data["kwargs"]).item()
        report.append({"before": before, "after": after})
        log.debug("layer %d attention error %.4f -> %.4f", index, before, after)
    return report


def _dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype
