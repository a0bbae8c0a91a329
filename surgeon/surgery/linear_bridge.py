"""A linear bridge over a dropped block, folded into the MLP just before it (cf. ReplaceMe, 2025).

Dropping layers a..b leaves layer b+1 reading the residual stream as it was after layer a-1, which
lacks everything the block added. Write layer a-1's output as Y + M (M: its MLP's output, Y: the
stream before the MLP) and the state entering layer b+1 as X. A matrix T fitted by least squares
so that Y + M T ~ X on calibration text, and folded into the MLP's down projection (W <- T^T W),
makes layer a-1 also stand in for the block, linearly. No parameter is added, so the model stays a
standard architecture. Training-free; healing starts from a much closer point.

It needs a family whose MLP output is added to the residual stream as it is (Llama, Mistral,
Qwen): Gemma normalises the MLP output before adding it, so a linear map there is not linear in
the stream.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .capture import on_input, on_output


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


@torch.inference_mode()
def fit_bridges(model, windows: torch.Tensor, runs: list[tuple[int, int]], ridge: float = 1e-4) -> dict:
    """{(a, b): (T [H, H] float64, relative residual)} for each run a..b of the unoperated `model`.

    Each run is fitted on the original model's activations (runs do not see each other's bridge).
    Position 0 is left out: its attention-sink state is orders of magnitude larger than the rest
    and would dominate the fit. `ridge` (relative to the mean diagonal of M^T M) pulls T towards the
    identity, which is the plain drop.
    """
    layers = model.base_model.layers
    n = len(layers)
    hidden = model.config.hidden_size
    stats = {
        run: {
            "mm": torch.zeros(hidden, hidden, dtype=torch.float64),
            "md": torch.zeros(hidden, hidden, dtype=torch.float64),
            "dd": 0.0,
            "ii": 0.0,
        }
        for run in runs
    }
    taken: dict = {}
    watched = {
        **{("mlp", a - 1): layers[a - 1].mlp for a, _ in runs},
        **{("out", a - 1): layers[a - 1] for a, _ in runs},
    }
    # The target: the stream entering layer b+1, or the final norm when the block ran to the top.
    targets = {("in", b + 1): layers[b + 1] if b + 1 < n else model.base_model.norm for _, b in runs}
    store = lambda key, state, *_: taken.__setitem__(key, state)
    device = next(model.parameters()).device
    with on_output(watched, store), on_input(targets, store):
        for row in tqdm(range(windows.shape[0]), desc="linear bridge", unit="window", leave=False):
            taken.clear()
            model.base_model(input_ids=windows[row : row + 1].to(device), use_cache=False)
            for a, b in runs:
                m = taken[("mlp", a - 1)][0, 1:].double().cpu()
                # What M T must supply: the target minus the stream before the MLP (Y = out - M).
                d = taken[("in", b + 1)][0, 1:].double().cpu() - taken[("out", a - 1)][0, 1:].double().cpu() + m
                s = stats[(a, b)]
                s["mm"] += m.T @ m
                s["md"] += m.T @ d
                s["dd"] += float((d * d).sum())
                s["ii"] += float(((d - m) ** 2).sum())  # the plain drop's error (T = I)
    eye = torch.eye(hidden, dtype=torch.float64)
    out = {}
    for run, s in stats.items():
        lam = ridge * s["mm"].diagonal().mean()
        t = torch.linalg.solve(s["mm"] + lam * eye, s["md"] + lam * eye)
        # ||M T - D||^2 = tr(T^T MM T) - 2 tr(T^T MD) + ||D||^2, from the accumulated moments
        err = float((t * (s["mm"] @ t)).sum() - 2 * (t * s["md"]).sum() + s["dd"])
        out[run] = (t, (max(err, 0.0) / max(s["ii"], 1e-30)) ** 0.5)
    return out


def fold_into_down_proj(layer, t: torch.Tensor) -> None:
    """down_proj(x) becomes down_proj(x) @ T: new tensors (the parent's stay as they were)."""
    down = layer.mlp.down_proj
    weight = (t.T @ down.weight.double()).to(down.weight.dtype)
    down.weight = torch.nn.Parameter(weight, requires_grad=False)
    if down.bias is not None:
        down.bias = torch.nn.Parameter((down.bias.double() @ t).to(down.bias.dtype), requires_grad=False)
