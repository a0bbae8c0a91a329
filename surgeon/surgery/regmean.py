"""What RegMean needs from each model, one model at a time: the Gram matrix of every decoder Linear's
inputs on that model's own text, and the product of its weight with that matrix. Both are summed
over the models as they come, so the memory held is the sums plus the one model being run, however
many models are merged; `RegMeanSums.take` then gives each Linear its merged weight and frees its sum.

Grams are means over the tokens (X^T X / n), so a model's `weight` says how much it counts whatever
the length of its text; Linears that read the same tensor (q/k/v, gate/up) share one. Gram sums stay
in float64 (an input channel with outliers makes them badly conditioned), products in float32.
"""

from __future__ import annotations

import torch

from ..errors import SourceError
from . import architecture
from .merge import regmean_solve, regularised_gram
from .quantize import input_hessians, linear_inputs


def decoder_linears(model: torch.nn.Module) -> list[str]:
    """Module names of the Linears inside the decoder layers (the head and embeddings are averaged)."""
    return [name for name in linear_inputs(model) if architecture.split_layer_name(f"{name}.weight")]


class RegMeanSums:
    """Running sums of w_i G_i (per Linear input) and w_i W_i G_i (per Linear) over the models added."""

    def __init__(self, names: list[str], alpha: float):
        self.names, self.alpha = names, alpha
        self.grams: dict[str, torch.Tensor] = {}  # by the first Linear that reads the input
        self.products: dict[str, torch.Tensor] = {}
        self.shared: dict[str, str] = {}  # Linear -> the Linear whose input Gram it shares
        self.readers: dict[str, int] = {}  # Gram -> Linears still to solve with it

    def add(self, model: torch.nn.Module, windows: torch.Tensor, weight: float, label: str) -> None:
        """Run `model` over its own `windows` and add its weighted terms."""
        hessians = input_hessians(model, self.names, windows)
        tokens = windows.numel()
        first_of: dict[int, str] = {}
        grams: dict[str, torch.Tensor] = {}  # this model's weighted Grams, one per input
        state = model.state_dict()
        for name in self.names:
            owner = first_of.setdefault(id(hessians[name]), name)
            if self.shared.setdefault(name, owner) != owner:  # the sums would no longer line up
                raise SourceError(
                    f"regmean: in '{label}' {name} reads the input of {owner}, in the first model that of "
                    f"{self.shared[name]}: the models do not compute alike"
                )
            if owner == name:
                grams[name] = weight * regularised_gram(hessians[name] / tokens, self.alpha)
                _accumulate(self.grams, name, grams[name])
            _accumulate(self.products, name, (state[f"{name}.weight"].double() @ grams[owner]).float())
        del hessians
        self.readers = {}
        for owner in self.shared.values():
            self.readers[owner] = self.readers.get(owner, 0) + 1

    def __contains__(self, weight_name: str) -> bool:
        return weight_name.removesuffix(".weight") in self.products

    def take(self, weight_name: str) -> torch.Tensor:
        """The merged weight of a Linear (by its weight's name); its sums are freed once used."""
        name = weight_name.removesuffix(".weight")
        owner = self.shared[name]
        solved = regmean_solve(self.products.pop(name), self.grams[owner])
        self.readers[owner] -= 1
        if not self.readers[owner]:
            del self.grams[owner]
        return solved


def _accumulate(sums: dict[str, torch.Tensor], name: str, term: torch.Tensor) -> None:
    if name in sums:
        sums[name] += term
    else:
        sums[name] = term
