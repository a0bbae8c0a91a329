"""Which layers matter least, measured on calibration text (no weights change here).

- angular distance (Gromov et al., "The Unreasonable Ineffectiveness of the Deeper Layers"): for a
  block of n layers starting at l, arccos of the cosine between the hidden states entering layer l
  and layer l+n, over pi; the block with the smallest distance changes the residual stream least.
- block influence (Men et al., "ShortGPT"): 1 - cos between a layer's input and output, per layer;
  the layers with the smallest influence are dropped, contiguous or not.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .capture import on_input, on_output


@torch.inference_mode()
def boundary_statistics(model, windows: torch.Tensor, batch: int = 2) -> dict[str, torch.Tensor]:
    """One pass over `windows` collecting, at each of the L+1 layer boundaries:

    - `last`: the last token's hidden state per window, [L+1, N, H] (for angular distance);
    - `influence`: per layer, mean over tokens of 1 - cos(input, output), [L] (position 0, which
      has no context and carries the attention-sink outlier, is left out).
    The final norm and LM head are not run: only the decoder stack matters here.
    """
    decoder = model.base_model
    layers = decoder.layers
    captured: list[torch.Tensor] = []

    take = lambda _key, hidden, *_: captured.append(hidden)
    last, influence_sum, influence_count = [], torch.zeros(len(layers), dtype=torch.float64), 0
    device = next(model.parameters()).device
    with on_input(dict(enumerate(layers)), take), on_output({"top": layers[-1]}, take):
        for start in tqdm(range(0, windows.shape[0], batch), desc="calibration", unit="batch", leave=False):
            captured.clear()
            decoder(input_ids=windows[start : start + batch].to(device), use_cache=False)
            last.append(torch.stack([h[:, -1].float().cpu() for h in captured]))  # [L+1, B, H]
            for layer in range(len(layers)):  # pair by pair: the full [L+1, B, T, H] stack would be large
                cos = torch.nn.functional.cosine_similarity(
                    captured[layer][:, 1:].float(), captured[layer + 1][:, 1:].float(), dim=-1
                )
                influence_sum[layer] += (1 - cos.double()).sum().item()
            influence_count += cos.numel()
    return {"last": torch.cat(last, dim=1), "influence": influence_sum / influence_count}


def angular_distances(last: torch.Tensor, count: int) -> list[float]:
    """Mean angular distance for every block [l, l+count): entry l of the result, l = 0..L-count."""
    n_boundaries = last.shape[0]
    distances = []
    for start in range(n_boundaries - count):
        cos = torch.nn.functional.cosine_similarity(last[start], last[start + count], dim=-1)
        distances.append((torch.arccos(cos.clamp(-1, 1)) / math.pi).mean().item())
    return distances


def cheapest_block(distances: list[float], count: int) -> list[int]:
    start = min(range(len(distances)), key=distances.__getitem__)
    return list(range(start, start + count))


def least_influential(influence: torch.Tensor, count: int) -> list[int]:
    return sorted(torch.argsort(influence)[:count].tolist())
