"""Training and measuring the lightning indexers of a sparse-attention model (DeepSeek-V3.2's recipe).

Stage 1, `warm_up`: selection off (the layers attend densely), the LM frozen; each indexer learns
KL(head-summed, L1-normalised attention of its layer || softmax of its scores) over all visible keys.
Stage 2 is the heal step with selection on: the LM is distilled from the dense parent while each
indexer keeps learning the same KL restricted to the keys it selected (`indexer_mode(dense=False, loss=True)`).
Both read the layer's attention probabilities, so the model runs with eager attention meanwhile.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..modeling.sparse_attention import mean_indexer_loss, sparse_modules
from ..text import TextData
from .driver import LoopResult, batch_indices, drive, make_accelerator
from .loop import EvalSpec, OptimSpec

log = logging.getLogger(__name__)


class WarmupSpec(BaseModel):
    """Indexer warm-up: `data` windows (the last `heldout_windows` held out for the curve)."""

    model_config = ConfigDict(extra="forbid")

    data: TextData
    heldout_windows: int = Field(4, ge=0)
    steps: int = Field(gt=0)
    batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    optimizer: OptimSpec = OptimSpec(lr=1e-3, warmup_steps=10)
    eval: EvalSpec = EvalSpec()
    checkpoint_every: int = Field(50, gt=0)
    log_every: int = Field(5, gt=0)
    precision: str = Field("auto", pattern="^(auto|fp32|bf16|fp16)$")
    seed: int = 0


@contextmanager
def indexer_mode(model, *, dense: bool, loss: bool = False, recall: bool = False):
    """Set every sparse layer's flags (and eager attention, whose probabilities the losses read)."""
    modules = sparse_modules(model)
    config = model.config
    saved = config._attn_implementation
    if loss or recall:
        config._attn_implementation = "eager"
    for module in modules:
        module.dense, module.want_loss, module.want_recall = dense, loss, recall
        module.indexer_loss, module.recall = None, None
    try:
        yield modules
    finally:
        config._attn_implementation = saved
        for module in modules:
            module.dense = module.want_loss = module.want_recall = False
            module.indexer_loss = None


def indexer_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: param for name, param in model.named_parameters() if ".indexer." in name}


class _IndexerBody(torch.nn.Module):
    """The LM's forward for the indexer losses alone (its output is not needed)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        self.model.model(input_ids=input_ids, use_cache=False)
        return mean_indexer_loss(sparse_modules(self.model))


def warm_up(
    model,
    train_ids: torch.Tensor,
    heldout_ids: torch.Tensor,
    spec: WarmupSpec,
    *,
    checkpoint_dir: Path,
    resume: bool,
    run_digest: str,
) -> LoopResult:
    accelerator, precision = make_accelerator(spec)
    trainable = indexer_parameters(model)
    for param in model.parameters():
        param.requires_grad_(False)
    for param in trainable.values():
        param.requires_grad_(True)
    result = LoopResult(precision=precision)
    model.train()

    def one_step(body, step: int):
        total = 0.0
        for micro in range(spec.grad_accum):
            ids = train_ids[batch_indices(step, micro, spec, train_ids.shape[0], accelerator)].to(accelerator.device)
            with accelerator.autocast():
                loss = body(ids)
            accelerator.backward(loss / spec.grad_accum)
            total += loss.item() / spec.grad_accum
        return {"loss": total, "kl": total}, spec.batch_size * spec.grad_accum * train_ids.shape[1]

    @torch.no_grad()
    def evaluate(body):
        if not heldout_ids.shape[0]:
            return None
        losses = [body(heldout_ids[i : i + 1].to(accelerator.device)).item() for i in range(heldout_ids.shape[0])]
        return {"indexer_kl": sum(losses) / len(losses)}

    try:
        with indexer_mode(model, dense=True, loss=True):
            drive(
                spec,
                accelerator,
                trainable,
                _IndexerBody(model),
                result=result,
                checkpoint_dir=checkpoint_dir,
                resume=resume,
                run_digest=run_digest,
                one_step=one_step,
                evaluate=evaluate,
                metric="indexer_kl",
                desc="indexer warm-up",
            )
    finally:
        model.eval()
        for param in trainable.values():
            param.requires_grad_(False)
    return result


@torch.no_grad()
def measure_recall(model, windows: torch.Tensor) -> dict[int, float]:
    """Per sparse layer: the share of its dense attention mass (summed over heads) that the indexer's
    selection would keep, averaged over queries that see more than top_k keys."""
    was_training = model.training
    model.eval()
    try:
        with indexer_mode(model, dense=True, recall=True) as modules:
            for row in windows:
                model.model(input_ids=row[None], use_cache=False)
            return {m.layer_idx: (m.recall[0] / m.recall[1] if m.recall and m.recall[1] else 1.0) for m in modules}
    finally:
        model.train(was_training)
