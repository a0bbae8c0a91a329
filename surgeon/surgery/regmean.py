"""What RegMean needs from each model, one model at a time: the Gram matrix of every decoder Linear's
inputs on that model's own text, and the product of its weight with that matrix. Both are summed
over the models as they come, so the memory held is the sums plus the one model being run, however
many models are merged; `RegMeanSums.solve` then gives each Linear its merged weight.

Grams are means over the tokens (X^T X / n), so a model's `weight` says how much it counts whatever
the length of its text; Linears that read the same tensor (q/k/v, gate/up) share one.
"""

from __future__ import annotations

import torch

from . import architecture
from .merge import regmean_solve, regularised_gram
from .quantize import input_hessians, linear_inputs


def decoder_linears(model: torch.nn.Module) -> list[str]:
    """Module names of the Linears inside the decoder layers (the head and embeddings are averaged)."""
    return [name for name in linear_inputs(model) if architecture.split_layer_name(f"{name}.weight")]


class RegMeanSums:
    def __init__(self, names: list[str], alpha: float):
        self.names, self.alpha = names, alpha
        self.grams: dict[str, torch.Tensor] = {}  # by the first Linear that reads the input
        self.products: dict[str, torch.Tensor] = {}
        self.shared: dict[str, str] = {}  # Linear -> the Linear whose input Gram it shares

    def add(self, model: torch.nn.Module, windows: torch.Tensor, weight: float) -> None:
        """Run `model` over its own `windows` and add its weighted terms."""
        hessians = input_hessians(model, self.names, windows)
        tokens = windows.numel()
        first_of: dict[int, str] = {}
        state = model.state_dict()
        for name in self.names:
            owner = first_of.setdefault(id(hessians[name]), name)
            self.shared.setdefault(name, owner)
            if owner == name:
                gram = weight * regularised_gram(hessians[name] / tokens, self.alpha)
                _accumulate(self.grams, name, gram.float())
            gram = weight * regularised_gram(hessians[owner] / tokens, self.alpha)
            _accumulate(self.products, name, (state[f"{name}.weight"].double() @ gram).float())
        del hessians

    def solve(self, name: str) -> torch.Tensor:
        return regmean_solve(self.products[name], self.grams[self.shared[name]])


def _accumulate(sums: dict[str, torch.Tensor], name: str, term: torch.Tensor) -> None:
    if name in sums:
        sums[name] += term
    else:
        sums[name] = term
