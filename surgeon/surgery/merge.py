"""Weight merging math: linear averaging, SLERP, task arithmetic, TIES and DARE, on row chunks;
RegMean's closed form per Linear (surgeon/surgery/regmean.py gathers what it needs).

The merge step streams each tensor through here a block of rows at a time, so nothing is ever held
for all sources at once. What needs the whole tensor is measured first, in a pass of its own: the
magnitude threshold TIES trims at (`magnitude_trim`) and the norms and dot product SLERP
turns by (`SlerpStats`). Every function here takes and returns float32 tensors.

References: model soups (Wortsman et al. 2022) for linear; task arithmetic (Ilharco et al. 2023);
TIES-merging (Yadav et al. 2023: trim, elect sign, disjoint mean); DARE (Yu et al. 2024: drop each
delta entry with probability 1 - density, rescale the rest by 1 / density); RegMean (Jin et al.
2023, "Dataless Knowledge Fusion by Merging Weights of Language Models": each Linear takes the
weight whose outputs are closest, in least squares, to every model's own outputs on its own inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SLERP_PARALLEL = 0.9995  # |cos| above this: the vectors are treated as parallel and interpolated linearly
_EPS = 1e-8


@dataclass(frozen=True)
class Method:
    """What a merge method does with task vectors (delta = model - base)."""

    name: str
    uses_base: bool  # works on deltas from a base model (all but linear and regmean)
    sparsify: str | None  # None, "magnitude" (TIES's trim) or "random" (DARE's drop-and-rescale)
    sign_consensus: bool  # TIES: keep only entries agreeing with the elected sign
    normalize: bool  # default: divide the summed deltas by the summed weights


METHODS = {
    m.name: m
    for m in (
        Method("linear", uses_base=False, sparsify=None, sign_consensus=False, normalize=True),
        Method("slerp", uses_base=True, sparsify=None, sign_consensus=False, normalize=False),
        Method("task_arithmetic", uses_base=True, sparsify=None, sign_consensus=False, normalize=False),
        Method("ties", uses_base=True, sparsify="magnitude", sign_consensus=True, normalize=True),
        Method("dare_linear", uses_base=True, sparsify="random", sign_consensus=False, normalize=False),
        Method("dare_ties", uses_base=True, sparsify="random", sign_consensus=True, normalize=False),
        # Linears by least squares on each model's activations, every other tensor as `linear`.
        Method("regmean", uses_base=False, sparsify=None, sign_consensus=False, normalize=True),
    )
}


def gradient_value(values: list[float], t: float) -> float:
    """mergekit's gradients: `values` spread evenly over t in [0, 1], linearly interpolated."""
    if len(values) == 1:
        return float(values[0])
    scaled = min(max(t, 0.0), 1.0) * (len(values) - 1)
    low = int(scaled)
    high = min(low + 1, len(values) - 1)
    frac = scaled - low
    return (1 - frac) * values[low] + frac * values[high]


def linear(chunks: list[torch.Tensor], weights: list[float], normalize: bool) -> torch.Tensor:
    """Weighted sum of the models' tensors, divided by the weights' sum when `normalize`."""
    out = torch.zeros_like(chunks[0])
    for chunk, weight in zip(chunks, weights, strict=True):
        out.add_(chunk, alpha=weight)
    total = sum(weights)
    if normalize and abs(total) > _EPS:
        out.div_(total)
    return out


@dataclass
class SlerpStats:
    """Accumulated over a tensor's chunks: the two norms and the dot product SLERP needs."""

    dot: float = 0.0
    norm_a2: float = 0.0
    norm_b2: float = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.dot += float((a.double() * b.double()).sum())
        self.norm_a2 += float(a.double().square().sum())
        self.norm_b2 += float(b.double().square().sum())

    def coefficients(self, t: float) -> tuple[float, float]:
        """(ca, cb) with slerp(a, b, t) = ca * a + cb * b, a and b being the unnormalised tensors.

        The angle is measured between the normalised tensors; a zero tensor counts as unit length
        (it is left unnormalised) and near-parallel tensors fall back to linear interpolation, where
        sin(theta) would divide by almost nothing."""
        norm_a, norm_b = math.sqrt(self.norm_a2), math.sqrt(self.norm_b2)
        cos = self.dot / ((norm_a if norm_a > _EPS else 1.0) * (norm_b if norm_b > _EPS else 1.0))
        if abs(cos) > SLERP_PARALLEL:
            return 1.0 - t, t
        theta = math.acos(max(-1.0, min(1.0, cos)))
        sin_theta = math.sin(theta)
        return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


@dataclass
class Trim:
    """TIES's trim of one tensor, applied a row block at a time: keep every |delta| above
    `threshold`, and of those equal to it only the first `ties` in row-major order, so exactly the
    `density` share is kept even where low-precision weights make many magnitudes equal."""

    threshold: float
    ties: int

    def __call__(self, delta: torch.Tensor) -> torch.Tensor:
        magnitude = delta.abs()
        keep = magnitude > self.threshold
        equal = (magnitude == self.threshold).flatten()
        if self.ties > 0 and equal.any():
            taken = equal & (equal.cumsum(0) <= self.ties)
            self.ties -= int(taken.sum())
            keep |= taken.view_as(keep)
        return delta * keep


def magnitude_trim(delta: torch.Tensor, density: float) -> Trim | None:
    """The trim that keeps the `density` share of `delta`'s largest magnitudes (None: all of them)."""
    if density >= 1.0:
        return None
    keep = int(density * delta.numel())
    if keep <= 0:
        return Trim(math.inf, 0)
    flat = delta.abs().flatten()
    threshold = float(torch.kthvalue(flat, flat.numel() - keep + 1).values)
    above = int((flat > threshold).sum())
    return Trim(threshold, keep - above)


def drop_and_rescale(delta: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: keep each entry with probability `density` and scale the kept ones by 1 / density, so
    the delta's expectation is unchanged."""
    if density >= 1.0:
        return delta
    if density <= 0.0:
        return torch.zeros_like(delta)
    keep = torch.rand(delta.shape, generator=generator) < density
    return delta * keep / density


def combine_deltas(
    deltas: list[torch.Tensor],
    weights: list[float],
    sign_consensus: bool,
    normalize: bool,
) -> torch.Tensor:
    """Sum of weighted (already sparsified) deltas. With `sign_consensus` (TIES) the sign of the
    weighted sum is elected per entry and only deltas of that sign count; `normalize` divides by the
    weights of the deltas that counted (TIES's disjoint mean), or by all weights."""
    weighted = [d * w for d, w in zip(deltas, weights, strict=True)]
    if not sign_consensus:
        mixed = torch.stack(weighted).sum(0)
        total = sum(weights)
        return mixed / total if normalize and abs(total) > _EPS else mixed
    elected = torch.where(torch.stack(weighted).sum(0) >= 0, 1.0, -1.0)
    mixed = torch.zeros_like(deltas[0])
    counted = torch.zeros_like(deltas[0])
    for w_delta, weight in zip(weighted, weights, strict=True):
        agrees = (torch.sign(w_delta) == elected).float()
        mixed += w_delta * agrees
        counted += weight * agrees
    if normalize:
        mixed /= torch.where(counted == 0, 1.0, counted)
    return mixed


def regularised_gram(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """RegMean's regularisation: the Gram matrix's off-diagonal entries scaled by `alpha` (1: plain
    least squares; 0: only each input's own scale, which makes the merge a per-column weighted
    average). Below 1 the sum stays well conditioned and the merge stays near the average."""
    out = gram * alpha
    out.diagonal().copy_(torch.diagonal(gram))
    return out


def regmean_solve(products: torch.Tensor, grams: torch.Tensor, damp: float = 1e-6) -> torch.Tensor:
    """W = (sum_i W_i G_i) (sum_i G_i)^-1: `products` [out, in] = sum_i W_i G_i, `grams` [in, in] =
    sum_i G_i (symmetric). Solved in float64, with `damp` x the mean diagonal added for inputs that
    never varied; the result in float32."""
    grams = grams.double()
    ridge = damp * torch.diagonal(grams).mean().clamp_min(_EPS)
    grams = grams + ridge * torch.eye(grams.shape[0], dtype=grams.dtype)
    return torch.linalg.solve(grams, products.double().T).T.float()
