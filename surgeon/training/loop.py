"""The healing loop: distil the teacher into the student, resumably, through accelerate.

What one step computes is here (teacher and student passes, the fused loss, the hidden-state
term); the step loop itself (schedule, held-out KL with early stopping, checkpoints, resume) is
driver.py's, shared with the image-question loop.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..measure.metrics import compare_to_parent, parent_reference
from ..modeling.sparse_attention import mean_indexer_loss, sparse_modules
from .distill_loss import DenseTeacher, LossConfig, distill_loss
from .driver import LoopResult, batch_indices, drive, make_accelerator
from .forward import StudentBody, head_weight, logit_softcap, shared_prefix_length, teacher_forward
from .teacher_cache import TeacherCache
from .text_set import TrainSet
from .trainable import first_trainable_layer

log = logging.getLogger(__name__)


class LossSpec(BaseModel):
    """`kl`, `ce`, `hidden`: weights of KL to the teacher (at `temperature`), cross-entropy on the
    text, and normalised MSE between each trained student layer's output and the teacher layer it
    stands for (after a layer drop: layer i+count for layers after the cut)."""

    model_config = ConfigDict(extra="forbid")

    kl: float = Field(1.0, ge=0)
    ce: float = Field(0.0, ge=0)
    hidden: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)


class OptimSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(10, ge=0)
    schedule: str = Field("cosine", pattern="^(cosine|constant|linear)$")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)


class EvalSpec(BaseModel):
    """Held-out KL every `every` steps; stop after `patience` evaluations without an improvement
    of at least `min_delta` (then the best weights are kept)."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, gt=0)
    patience: int | None = Field(None, gt=0)
    min_delta: float = Field(0.0, ge=0)


class TeacherCacheSpec(BaseModel):
    """Keep the teacher's `top_k` logits per window on disk: later epochs and runs skip the teacher."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(64, gt=0, le=4096)


class LoopSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0)
    batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    loss: LossSpec = LossSpec()
    optimizer: OptimSpec = OptimSpec()
    eval: EvalSpec = EvalSpec()
    checkpoint_every: int = Field(50, gt=0)
    log_every: int = Field(5, gt=0)
    precision: str = Field("auto", pattern="^(auto|fp32|bf16|fp16)$")
    teacher_cache: TeacherCacheSpec | None = None
    seed: int = 0


def train(
    student,
    trainable: dict[str, torch.nn.Parameter],
    teacher,
    data: TrainSet,
    spec: LoopSpec,
    *,
    teacher_fingerprint: str,
    teacher_is_parent: bool,
    layer_origin: list[int | None],
    checkpoint_dir: Path,
    resume: bool,
    run_digest: str,
) -> LoopResult:
    accelerator, precision = make_accelerator(spec)
    device = accelerator.device
    teacher.to(device).eval()
    result = LoopResult(precision=precision)

    first = first_trainable_layer(student)
    use_cache = spec.teacher_cache is not None
    pairs = _hidden_pairs(layer_origin, first, spec.loss.hidden, teacher_is_parent)
    # Cross-entropy alone (a fine-tune) needs no teacher forward at all.
    teacher_free = spec.loss.kl == 0 and not pairs
    shares_prefix = not (use_cache or teacher_free) and teacher_is_parent
    prefix = shared_prefix_length(student, teacher, first) if shares_prefix else 0
    result.shared_prefix = prefix
    cache = TeacherCache(teacher, teacher_fingerprint, data.digest(), spec.teacher_cache.top_k) if use_cache else None
    loss_config = LossConfig(
        temperature=spec.loss.temperature,
        kl_weight=spec.loss.kl,
        ce_weight=spec.loss.ce,
        matmul_dtype=torch.bfloat16 if precision == "bf16" else torch.float16 if precision == "fp16" else torch.float32,
    )
    reference = None
    if data.heldout_ids.shape[0]:
        reference = parent_reference(lambda: teacher, data.heldout_ids, teacher_fingerprint)

    # Sparse-attention layers set to learn (surgeon/training/indexer.py): their indexer KL joins the loss.
    indexers = [m for m in sparse_modules(student) if m.want_loss]

    def one_step(body, step: int):
        totals = {"loss": 0.0, "kl": 0.0, "ce": 0.0, "hidden": 0.0}
        if indexers:
            totals["indexer"] = 0.0
        tokens = 0
        for micro in range(spec.grad_accum):
            windows = batch_indices(step, micro, spec, data.train_ids.shape[0], accelerator)
            ids = data.train_ids[windows].to(device)
            mask = data.train_mask[windows].to(device)
            sync = micro == spec.grad_accum - 1
            with accelerator.no_sync(body) if not sync else nullcontext(), accelerator.autocast():
                loss, parts = _micro_step(
                    body,
                    student,
                    None if teacher_free else teacher,
                    ids,
                    mask,
                    windows,
                    prefix,
                    pairs,
                    cache,
                    loss_config,
                    spec.loss.hidden,
                )
                if indexers:
                    index_loss = mean_indexer_loss(indexers)
                    loss = loss + index_loss
                    parts["indexer"] = index_loss.item()
                accelerator.backward(loss / spec.grad_accum)
            for key in totals:
                totals[key] += parts.get(key, 0.0) / spec.grad_accum
            tokens += int(mask.sum()) * accelerator.num_processes
        return totals, tokens

    def evaluate(_body):
        return None if reference is None else {"kl_mean": _heldout_kl(student, data, reference)}

    drive(
        spec,
        accelerator,
        trainable,
        StudentBody(student),
        result=result,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        run_digest=run_digest,
        one_step=one_step,
        evaluate=evaluate,
        metric="kl_mean",
        desc="heal",
    )
    log.info(
        "healed %d steps: %s target tokens at %.0f tokens/s (%s, first %d layers shared with the teacher)",
        result.steps_done,
        f"{result.tokens:,}",
        result.tokens / max(result.seconds, 1e-9),
        precision,
        prefix,
    )
    return result


def _micro_step(body, student, teacher, ids, mask, windows, prefix, pairs, cache, config, hidden_weight):
    capture_teacher = [t for _, t in pairs]
    start_hidden, dense, teacher_layers = None, None, {}
    if teacher is not None and cache is None:
        out = teacher_forward(teacher, ids, prefix, capture_teacher)
        start_hidden = out.boundary
        selected = mask.bool()
        dense = DenseTeacher(out.final_hidden[selected].clone(), head_weight(teacher), logit_softcap(teacher))
        teacher_layers = out.layer_outputs
    elif teacher is not None and pairs:
        teacher_layers = teacher_forward(teacher, ids, 0, capture_teacher).layer_outputs
    hidden, student_layers = body(ids, start_hidden, prefix, tuple(s for s, _ in pairs))
    selected = mask.bool()
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    teacher_targets = cache.targets(windows.tolist(), ids, mask) if cache is not None else dense
    loss, stats = distill_loss(
        hidden[selected],
        head_weight(student),
        teacher_targets,
        targets[selected],
        torch.ones(int(selected.sum()), device=ids.device),
        config,
        logit_softcap(student),
    )
    parts = {"kl": stats["kl"], "ce": stats["ce"] if config.ce_weight else 0.0}
    if pairs and hidden_weight:
        terms = []
        for s_index, t_index in pairs:
            s_out = student_layers[s_index][selected].float()
            t_out = teacher_layers[t_index][selected].float().clone()
            terms.append(((s_out - t_out).pow(2).sum(-1) / t_out.pow(2).sum(-1).clamp_min(1e-6)).mean())
        hidden_loss = torch.stack(terms).mean()
        loss = loss + hidden_weight * hidden_loss
        parts["hidden"] = hidden_loss.item()
    parts["loss"] = loss.item()
    return loss, parts


def _hidden_pairs(origin: list[int | None], first: int | None, weight: float, teacher_is_parent: bool):
    """(student layer, teacher layer) pairs for the hidden-state loss: trained layers only."""
    if not weight or not teacher_is_parent:
        return []
    lowest = first or 0
    return [(i, o) for i, o in enumerate(origin) if o is not None and i >= lowest]


@torch.no_grad()
def _heldout_kl(student, data: TrainSet, reference) -> float:
    model = student.get_base_model() if hasattr(student, "get_base_model") else student
    was_training = model.training
    model.eval()
    try:
        return compare_to_parent(model, data.heldout_ids, reference)["kl_mean"]
    finally:
        model.train(was_training)
