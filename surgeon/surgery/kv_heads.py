"""Fewer KV heads: merge each group of r key/value heads into one shared head.

With H query heads and kv KV heads, query head h reads KV head h // (H / kv). Going to kv' heads
(kv' divides kv), new head j stands for old heads j*r .. j*r + r - 1 (r = kv / kv'). Inits:

- `mean` (Ainslie et al., 2023): the group's K and V projections averaged.
- `first`: the group's first head kept.
- `svd`: a shared head fitted to the group's activations on calibration text, with a per-old-head
  map folded into the weights that read it, so the model stays the standard architecture:
  * V: the top-hd principal subspace of the group's stacked values, v_i ~ P_i v_shared; P_i is
    folded into o_proj's columns for the query heads that read head i (exact: V has no rotary).
  * K: rotary position rotates each pair of dimensions (d, d + hd/2) like a complex number, so
    the per-head map must be a complex scale per pair to commute with it: per pair, the top
    eigenvector p of the group's complex key covariance gives k_i ~ p_i k_shared, and conj(p_i)
    is folded into q_proj for the query heads of head i. Families that normalise keys per head
    (q_norm / k_norm: Qwen3, Gemma-3) get `mean` keys, since the norm is not linear.

Everything works from Sigma = E[x x^T] of each layer's attention input (with a constant 1
appended when the projections have biases): errors and fits are quadratic forms in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INITS = ("mean", "first", "svd")


@dataclass
class Merge:
    """One group's shared head (rows [hd, in]) and, per old head, the map A_i [hd, hd] with
    old_i ~ A_i @ shared."""

    shared: torch.Tensor
    maps: list[torch.Tensor]


def merge_values(weights: list[torch.Tensor], sigma: torch.Tensor, init: str) -> Merge:
    """`weights`: the group's old heads, each [hd, in] (bias as the last column when present)."""
    hd = weights[0].shape[0]
    eye = torch.eye(hd, dtype=weights[0].dtype)
    if init == "first":
        return Merge(weights[0], [eye] * len(weights))
    if init == "mean":
        return Merge(torch.stack(weights).mean(0), [eye] * len(weights))
    stacked = torch.cat(weights)  # [r*hd, in]
    covariance = stacked @ sigma @ stacked.T
    _, vectors = torch.linalg.eigh(covariance)  # ascending
    basis = vectors[:, -hd:]  # [r*hd, hd], orthonormal columns
    return Merge(basis.T @ stacked, list(basis.split(hd)))


def merge_keys(weights: list[torch.Tensor], sigma: torch.Tensor, init: str) -> Merge:
    """As merge_values, but for rotary keys: maps are complex scales per dimension pair."""
    if init != "svd":
        return merge_values(weights, sigma, init)
    hd = weights[0].shape[0]
    half = hd // 2
    # Row d and row d + hd/2 of a head are the real and imaginary parts of one complex projection.
    complex_rows = torch.stack([torch.complex(w[:half], w[half:]) for w in weights])  # [r, half, in]
    sigma_c = sigma.to(complex_rows.dtype)
    shared = torch.zeros(half, weights[0].shape[1], dtype=complex_rows.dtype)
    scales = torch.zeros(len(weights), half, dtype=complex_rows.dtype)
    for d in range(half):
        rows = complex_rows[:, d]  # [r, in]
        covariance = rows @ sigma_c @ rows.conj().T  # E[k k^H] for k = rows @ x (x real)
        covariance = (covariance + covariance.conj().T) / 2
        _, vectors = torch.linalg.eigh(covariance)
        p = vectors[:, -1]  # unit, the dominant direction of the group's keys at this pair
        shared[d] = p.conj() @ rows
        scales[:, d] = p
    maps = []
    for i in range(len(weights)):
        a, b = scales[i].real, scales[i].imag
        block = torch.zeros(hd, hd, dtype=weights[0].dtype)
        idx = torch.arange(half)
        # k_i = p_i * s  ->  real part a*s_re - b*s_im, imaginary part b*s_re + a*s_im
        block[idx, idx], block[idx, idx + half] = a, -b
        block[idx + half, idx], block[idx + half, idx + half] = b, a
        maps.append(block)
    return Merge(torch.cat([shared.real, shared.imag]), maps)


def relative_error(weights: list[torch.Tensor], merge: Merge, sigma: torch.Tensor) -> tuple[float, float]:
    """(sum_i E||old_i - A_i shared||^2, sum_i E||old_i||^2) over calibration activations."""
    error = total = 0.0
    for weight, a in zip(weights, merge.maps):
        diff = weight - a @ merge.shared
        error += float(torch.einsum("ij,jk,ik->", diff, sigma, diff))
        total += float(torch.einsum("ij,jk,ik->", weight, sigma, weight))
    return error, total


def fold_into_queries(q_rows: torch.Tensor, key_map: torch.Tensor) -> torch.Tensor:
    """q_proj rows [hd, in] of a query head that read old key head i: since scores are
    q . k_i ~ q . (A_i k_shared) = (A_i^T q) . k_shared, the new rows are A_i^T @ q_rows."""
    return key_map.T @ q_rows


def fold_into_output(o_columns: torch.Tensor, value_map: torch.Tensor) -> torch.Tensor:
    """o_proj columns [hidden, hd] of a query head that read old value head i: o_i ~ A_i o_shared."""
    return o_columns @ value_map
