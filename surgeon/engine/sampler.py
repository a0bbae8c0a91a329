"""Next tokens from logits, per sequence: repetition penalty, temperature, top-k, top-p, seed."""

from __future__ import annotations

import torch

from .sampling import SamplingParams
from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [B, vocab] fp32, one row per sequence. Greedy rows without a penalty (the common
    case) are one batched argmax."""
    plain = [i for i, seq in enumerate(seqs) if seq.params.greedy and seq.params.repetition_penalty == 1.0]
    tokens = [0] * len(seqs)
    if plain:
        picked = logits[plain].argmax(-1).tolist()
        for i, token in zip(plain, picked):
            tokens[i] = token
    for i, seq in enumerate(seqs):
        if i not in plain:
            tokens[i] = _sample_row(logits[i], seq)
    return tokens


def _sample_row(row: torch.Tensor, seq: Sequence) -> int:
    params = seq.params
    if params.greedy:
        return int(penalised(row, params, seq.token_ids).argmax())
    return draw(distribution(row, params, seq.token_ids), seq.generator)


def penalised(row: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The row with the repetition penalty applied to every token in `history` (HF's rule)."""
    if params.repetition_penalty == 1.0:
        return row
    seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=row.device)
    seen = seen[seen < row.shape[0]]  # image placeholders lie past the vocabulary
    values = row[seen]
    row = row.clone()
    row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    return row


def distribution(row: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The probabilities a sampled request draws its next token from: penalty, temperature, top-k,
    top-p. Speculative verification compares these, so both paths share this one function."""
    row = penalised(row, params, history) / params.temperature
    if params.top_k and params.top_k < row.shape[0]:
        threshold = row.topk(params.top_k).values[-1]
        row = row.masked_fill(row < threshold, -torch.inf)
    probs = row.softmax(-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p (the token that crosses it included).
        drop = ordered.cumsum(-1) - ordered >= params.top_p
        probs = probs.scatter(0, order, ordered.masked_fill(drop, 0.0))
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from (possibly unnormalised) probabilities. Inverse CDF with one uniform draw: the
    same distribution as torch.multinomial, which spends ~1 ms per row drawing an exponential for
    every vocabulary entry."""
    cdf = probs.cpu().cumsum(0)
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
