"""What one model step reads besides token ids: positions, where new keys go in the paged cache,
and which cached keys each query sees. Built by the runner, read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    prefill: bool
    positions: torch.Tensor  # [T] long, each token's position in its sequence
    slots: torch.Tensor  # [T] long, where each token's key/value are written (block * size + row)
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [B] int32, keys each sequence has after this step
    token_rows: torch.Tensor  # [T] long, the sequence (row of block_tables) of each token
    logit_rows: torch.Tensor  # [R] long, tokens whose next-token logits are needed
    # Prefill only: packed queries and keys per sequence (see kernels/prefill_attention.py).
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None  # [Tk] long, cache slots of every key of every sequence
    spans: torch.Tensor | None = None  # [Tk] int32 image ids for bidirectional image attention
    # Decode off CUDA: every sequence's key slots, padded, and which are real (one gather per layer).
    key_slots: torch.Tensor | None = None  # [B, S] long
    key_mask: torch.Tensor | None = None  # [B, 1, C, S] bool; C = 1 but in a verification
    # A verification off CUDA: each token's place in a [B * C] grid of its sequence's C query rows, so
    # a sequence's keys are gathered once for all its draft tokens.
    query_rows: torch.Tensor | None = None  # [T] long
    # Compiled on a CPU: attention whose rows do not depend on the step's width (runner.py).
    row_invariant: bool = False
