"""Training and measuring the lightning indexers of a sparse-attention model (DeepSeek-V3.2's recipe).

Stage 1, `warm_up`: selection off (the layers attend densely), the LM frozen; each indexer learns
KL(head-summed, L1-normalised attention of its layer || softmax of its scores) over all visible keys.
With the LM frozen and selection off, every layer sees exactly the parent's states whatever the
indexers do, so the model runs once over the warm-up windows and each layer's attention input and
attention target are cached (bf16); the steps then train the indexers on that cache without running
the LM, which makes a step several times cheaper and a longer warm-up affordable.
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

from ..modeling.sparse_attention import attention_target, indexer_kl, sparse_modules
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
    seed: int = 0
    # The cache holds, per sparse layer and window, the attention input [T, hidden] and target [T, T].
    cache_gb: float = Field(6.0, gt=0)


@contextmanager
def indexer_mode(model, *, dense: bool, loss: bool = False, recall: bool = False, weights: bool = False):
    """Set every sparse layer's flags (and eager attention, whose probabilities the losses read, or
    the caller with `weights`)."""
    modules = sparse_modules(model)
    config = model.config
    saved = config._attn_implementation
    if loss or recall or weights:
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


DenseStates = dict[int, tuple[torch.Tensor, torch.Tensor]]


def cache_bytes(layers: int, windows: int, length: int, hidden: int) -> int:
    """Bytes `capture_dense_states` holds: bf16 inputs [T, hidden] and targets [T, T] per layer and window."""
    return layers * windows * length * (hidden + length) * 2


@torch.no_grad()
def capture_dense_states(model, windows: torch.Tensor, dtype=torch.bfloat16) -> DenseStates:
    """Per sparse layer: its attention's input states [N, T, hidden] and head-summed, normalised dense
    attention [N, T, T] over `windows` [N, T], with selection off (the parent's attention); kept in
    `dtype` on the CPU."""
    modules = sparse_modules(model)
    n, length = windows.shape
    states = {
        m.layer_idx: (
            torch.empty(n, length, model.config.hidden_size, dtype=dtype),
            torch.empty(n, length, length, dtype=dtype),
        )
        for m in modules
    }
    row = 0

    def keep_input(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        states[module.layer_idx][0][row] = hidden[0].cpu()

    def keep_target(module, args, kwargs, output):
        states[module.layer_idx][1][row] = attention_target(output[1])[0].cpu()

    hooks = [m.register_forward_pre_hook(keep_input, with_kwargs=True) for m in modules]
    hooks += [m.register_forward_hook(keep_target, with_kwargs=True) for m in modules]
    was_training = model.training
    model.eval()
    try:
        with indexer_mode(model, dense=True, weights=True):
            for row in range(n):
                model.model(input_ids=windows[row : row + 1].to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return states


class _CachedIndexerBody(torch.nn.Module):
    """One sparse layer's warm-up indexer KL on cached windows `rows` (no LM forward). The layers'
    indexers are independent, so a step backpropagates layer by layer: one small graph at a time."""

    def __init__(self, model, states: DenseStates):
        super().__init__()
        self.model = model
        self.states = states
        self.layers = {module.layer_idx: module for module in sparse_modules(model)}

    def forward(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        device, indexer = self.model.device, self.layers[layer].indexer
        inputs, targets = self.states[layer]
        with torch.autocast(device.type, enabled=False):  # the indexer runs in fp32, as in the model
            hidden, target = inputs[rows].to(device).float(), targets[rows].to(device).float()
            batch, length = hidden.shape[:2]
            positions = torch.arange(length, device=device)[None].expand(batch, -1)
            scores = indexer.scores(hidden, positions, indexer.keys(hidden, positions))
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
            target = target / target.sum(-1, keepdim=True)  # rows summed to 1 before the bf16 rounding
            return indexer_kl(scores, target, causal)


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
    windows = torch.cat([train_ids, heldout_ids])
    # fp32: the indexers compute in fp32 (as in the model) and the LM never runs in a step.
    accelerator, precision = make_accelerator(spec, precision="fp32")
    trainable = indexer_parameters(model)
    for param in model.parameters():
        param.requires_grad_(False)
    states = capture_dense_states(model, windows)
    layers, train_rows = sorted(states), train_ids.shape[0]
    for param in trainable.values():
        param.requires_grad_(True)
    result = LoopResult(precision=precision)
    model.train()

    def one_step(body, step: int):
        # The loss is the mean over layers of each layer's KL, as a live warm-up computes it.
        total, share = 0.0, 1 / (spec.grad_accum * len(layers))
        for micro in range(spec.grad_accum):
            rows = batch_indices(step, micro, spec, train_rows, accelerator)
            for layer in layers:
                loss = body(rows, layer)
                accelerator.backward(loss * share)
                total += loss.item() * share
        return {"loss": total, "kl": total}, spec.batch_size * spec.grad_accum * train_ids.shape[1]

    @torch.no_grad()
    def evaluate(body):
        if not heldout_ids.shape[0]:
            return None
        rows = range(train_rows, windows.shape[0])
        losses = [body(torch.tensor([row]), layer).item() for row in rows for layer in layers]
        return {"indexer_kl": sum(losses) / len(losses)}

    try:
        drive(
            spec,
            accelerator,
            trainable,
            _CachedIndexerBody(model, states),
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
