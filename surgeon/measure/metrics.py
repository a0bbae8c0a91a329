"""How far a child model is from its parent: the figures of llama.cpp's `perplexity --kl-divergence`.

Per scored token: KL(parent || child) over the whole vocabulary, whether the two argmaxes agree,
and both models' negative log-likelihood of the actual next token. The parent's side is computed
once and cached on disk (log-probabilities in fp16, argmax and NLL exact), keyed by the parent's
fingerprint and the exact token windows, so evaluating many children costs one parent pass.

Logits are formed a slice of positions at a time, so peak memory does not grow with
window x vocabulary (a 262k vocabulary at 512 positions would be 0.5 GB per window in fp32).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .. import families
from ..checkpoints.atomic import atomic_folder
from ..checkpoints.cache import cache_dir, prune_entries
from ..surgery.architecture import output_logits

METRIC_NAMES = ("kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement", "ppl", "ppl_parent", "tokens")
_CHUNK_BYTES = 64 * 2**20  # fp32 logits formed at once


@dataclass(frozen=True)
class ParentReference:
    """The parent's cached side of an evaluation: one safetensors file per window."""

    folder: Path
    windows: int

    def file(self, index: int) -> str:
        return str(self.folder / f"window-{index:05d}.safetensors")


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last axis, in place, as logits - logsumexp(logits).

    Not torch.log_softmax: its vectorised CPU kernel (AVX2 at least) leaves sum(exp) off 1 by
    ~1.6e-5, a bias that enters every KL whole; logsumexp is exact to ~1e-8 (tests/test_metrics.py).
    """
    return logits.sub_(logits.logsumexp(dim=-1, keepdim=True))


def windows_digest(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.numpy().tobytes() + str(tuple(windows.shape)).encode()).hexdigest()[:16]


@torch.inference_mode()
def iter_logprob_chunks(model, windows: torch.Tensor, desc: str) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """Yield (window, positions, log-probabilities [len(positions), V] fp32) covering every window.

    Position p predicts token p+1, so positions run over 0..W-2.
    """
    n, length = windows.shape
    if families.is_surgeon_vlm(model.config):
        # Text-only windows: a grafted VLM's forward is its language model's, bit for bit
        # (tests/test_vlm.py), so the text path is measured through the LM's own modules.
        model = model.language_model
    chunk = max(16, _CHUNK_BYTES // (model.config.vocab_size * 4))
    device = next(model.parameters()).device
    for index in tqdm(range(n), desc=desc, unit="window", leave=False):
        hidden = model.base_model(input_ids=windows[index : index + 1].to(device), use_cache=False).last_hidden_state[0]
        for start in range(0, length - 1, chunk):
            positions = slice(start, min(start + chunk, length - 1))
            logits = output_logits(model, hidden[positions])
            yield index, positions, log_probabilities(logits).cpu()


def parent_reference(
    load_parent: Callable[[], torch.nn.Module], windows: torch.Tensor, parent_fingerprint: str
) -> ParentReference:
    """The parent's log-probs for `windows`, from the cache, or computed now (loading the parent only
    then) and cached."""
    key = hashlib.sha256(f"{parent_fingerprint}|{windows_digest(windows)}".encode()).hexdigest()[:24]
    root = cache_dir("logits")
    folder = root / key
    if (folder / "done").is_file():
        os.utime(folder)  # most recently used: pruned last
        return ParentReference(folder, windows.shape[0])
    model = load_parent()
    with atomic_folder(folder, existing="keep") as tmp:
        reference = ParentReference(tmp, windows.shape[0])
        length = windows.shape[1] - 1
        current, buffers = -1, {}
        for index, positions, logprobs in iter_logprob_chunks(model, windows, "parent logits"):
            if index != current:
                if current >= 0:
                    save_file(buffers, reference.file(current))
                current = index
                buffers = {
                    "logprobs": torch.empty(length, logprobs.shape[-1], dtype=torch.float16),
                    "argmax": torch.empty(length, dtype=torch.int32),
                    "nll": torch.empty(length, dtype=torch.float32),
                }
            targets = windows[index, 1:][positions]
            buffers["logprobs"][positions] = logprobs.half()
            buffers["argmax"][positions] = logprobs.argmax(-1).int()
            buffers["nll"][positions] = -logprobs.gather(-1, targets[:, None]).squeeze(-1)
        save_file(buffers, reference.file(current))
        (tmp / "done").write_text("")
    max_bytes = int(float(os.environ.get("SURGEON_LOGITS_CACHE_GB", "8")) * 2**30)
    prune_entries(root, max_bytes, keep=folder)
    return ParentReference(folder, windows.shape[0])


def compare_to_parent(child_model, windows: torch.Tensor, reference: ParentReference) -> dict:
    """KL(parent || child), top-1 agreement and perplexities over every scored token."""
    kls, agree, child_nll, parent_nll = [], [], [], []
    handle, current = None, -1
    for index, positions, child_logprobs in iter_logprob_chunks(child_model, windows, "child logits"):
        if index != current:
            handle, current = safe_open(reference.file(index), framework="pt"), index
            # Copies: a tensor read from the file can keep the whole window's mapping alive.
            parent_nll.append(handle.get_tensor("nll").clone())
            parent_argmax = handle.get_tensor("argmax").clone()
        # Renormalise the fp16 log-probs so the parent side is an exact distribution: KL stays >= 0
        # and a model compared with itself scores ~5e-7 (the fp16 rounding), not noise of either sign.
        parent_logprobs = log_probabilities(handle.get_slice("logprobs")[positions].float())
        kls.append((parent_logprobs.exp() * (parent_logprobs - child_logprobs)).sum(-1).clamp_min(0))
        agree.append(child_logprobs.argmax(-1) == parent_argmax[positions].long())
        targets = windows[index, 1:][positions]
        child_nll.append(-child_logprobs.gather(-1, targets[:, None]).squeeze(-1))
    return summarize(torch.cat(kls), torch.cat(agree), torch.cat(child_nll), torch.cat(parent_nll))


def summarize(kl: torch.Tensor, agree: torch.Tensor, child_nll: torch.Tensor, parent_nll: torch.Tensor) -> dict:
    kl = kl.double()
    return {
        "kl_mean": kl.mean().item(),
        "kl_median": kl.median().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": agree.double().mean().item(),
        "ppl": math.exp(child_nll.double().mean().item()),
        "ppl_parent": math.exp(parent_nll.double().mean().item()),
        "tokens": int(kl.numel()),
    }
