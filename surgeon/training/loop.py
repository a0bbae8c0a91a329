"""The healing loop: distil the teacher into the student, resumably, through accelerate.

One optimizer step = `grad_accum` micro-batches of `batch_size` windows (split across processes
under `accelerate launch`). The window order is a seeded permutation per epoch, so step s always
sees the same windows: a run resumed from a checkpoint continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from ..errors import SurgeonError
from ..metrics import compare_to_parent, parent_reference
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import TrainSet
from .distill_loss import DenseTeacher, LossConfig, distill_loss
from .forward import StudentBody, head_weight, logit_softcap, shared_prefix_length, teacher_forward
from .teacher_cache import TeacherCache
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


@dataclass
class LoopResult:
    curve: list[dict] = field(default_factory=list)  # every log_every steps
    evals: list[dict] = field(default_factory=list)  # held-out KL
    steps_done: int = 0
    stopped_early: bool = False
    best_step: int | None = None
    seconds: float = 0.0
    tokens: int = 0
    shared_prefix: int = 0
    precision: str = "fp32"

    def summary(self) -> dict:
        return {
            "steps": self.steps_done, "stopped_early": self.stopped_early, "best_step": self.best_step,
            "seconds": round(self.seconds, 1), "tokens": self.tokens,
            "tokens_per_second": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "shared_prefix_layers": self.shared_prefix, "precision": self.precision,
        }


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:  # bf16 pays off on CPUs with AVX-512 BF16 or AMX; elsewhere it is emulated and slow
        return "bf16" if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else "fp32"
    except AttributeError:
        return "fp32"


def make_accelerator(spec: LoopSpec):
    """(Accelerator, precision) for a heal loop: DDP or one process, mixed precision where it pays."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    precision = resolve_precision(spec.precision, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    AcceleratorState._reset_state()  # a second heal step in this process may use another precision
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        # The fused loss reads the LM head's weight directly and checkpoints hold plain tensors;
        # both assume every process has whole parameters, which sharded training does not give.
        raise SurgeonError(f"heal runs data-parallel (DDP) only, not {accelerator.distributed_type.name}: "
                           "launch with recipes/accelerate/ddp.yaml")
    if spec.batch_size % accelerator.num_processes:
        raise SurgeonError(f"batch_size {spec.batch_size} does not divide over {accelerator.num_processes} processes")
    return accelerator, precision


def train(student, trainable: dict[str, torch.nn.Parameter], teacher, data: TrainSet, spec: LoopSpec, *,
          teacher_fingerprint: str, teacher_is_parent: bool, layer_origin: list[int | None],
          checkpoint_dir: Path, resume: bool, run_digest: str) -> LoopResult:
    accelerator, precision = make_accelerator(spec)
    device = accelerator.device
    teacher.to(device).eval()
    result = LoopResult(precision=precision)

    first = first_trainable_layer(student)
    use_cache = spec.teacher_cache is not None
    prefix = 0 if use_cache or not teacher_is_parent else shared_prefix_length(student, teacher, first)
    result.shared_prefix = prefix
    pairs = _hidden_pairs(layer_origin, first, spec.loss.hidden, teacher_is_parent)
    cache = TeacherCache(teacher, teacher_fingerprint, data.digest(), spec.teacher_cache.top_k) if use_cache else None

    body = StudentBody(student)
    params = list(trainable.values())
    optimizer = torch.optim.AdamW(params, lr=spec.optimizer.lr, betas=spec.optimizer.betas,
                                  weight_decay=spec.optimizer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(spec.optimizer, spec.steps))
    body, optimizer = accelerator.prepare(body, optimizer)
    loss_config = LossConfig(
        temperature=spec.loss.temperature, kl_weight=spec.loss.kl, ce_weight=spec.loss.ce,
        matmul_dtype=torch.bfloat16 if precision == "bf16" else torch.float16 if precision == "fp16" else torch.float32,
    )

    start, early = 0, {"best": math.inf, "bad": 0, "best_step": None}
    best_tensors: dict[str, torch.Tensor] | None = None
    latest = latest_checkpoint(checkpoint_dir) if resume else None
    if latest is not None:
        meta = load_checkpoint(latest, trainable, optimizer, scheduler)
        if meta.get("run_digest") != run_digest:
            raise SurgeonError(f"{latest} was written by a different recipe or data; remove it or run without --resume")
        start, early = meta["step"], meta["early_stop"]
        result.curve, result.evals = meta["curve"], meta["evals"]
        result.tokens, result.seconds = meta["tokens"], meta["seconds"]
        if early["best_step"] is not None and spec.eval.patience:
            from safetensors.torch import load_file

            best_tensors = {k.removeprefix("best."): v for k, v in load_file(str(latest / "best.safetensors")).items()}
        log.info("resuming healing at step %d of %d from %s", start, spec.steps, latest)

    reference = None
    if data.heldout_ids.shape[0]:
        reference = parent_reference(lambda: teacher, data.heldout_ids, teacher_fingerprint)
        if start == 0:  # where healing starts from: the cost of the surgery on held-out text
            result.evals.append({"step": 0, "kl_mean": _heldout_kl(student, data, reference)})
            # The untrained student is a candidate too: a run that only makes things worse keeps it.
            early.update(best=result.evals[0]["kl_mean"], best_step=0)
            if spec.eval.patience:
                best_tensors = {k: v.detach().clone() for k, v in trainable.items()}

    def save(step: int) -> None:
        if not accelerator.is_main_process:
            return
        extra = {"run_digest": run_digest, "early_stop": early, "curve": result.curve, "evals": result.evals,
                 "tokens": result.tokens, "seconds": result.seconds}
        path = save_checkpoint(checkpoint_dir, step, trainable, optimizer, scheduler, extra)
        if best_tensors is not None:
            from safetensors.torch import save_file

            save_file({f"best.{k}": v.contiguous() for k, v in best_tensors.items()}, str(path / "best.safetensors"))

    per_step = spec.batch_size * spec.grad_accum
    bar = tqdm(total=spec.steps, initial=start, desc="heal", unit="step", disable=not accelerator.is_main_process)
    step, saved_at = start, start
    try:
        while step < spec.steps and not result.stopped_early:
            began = time.perf_counter()
            body.train()
            totals = {"loss": 0.0, "kl": 0.0, "ce": 0.0, "hidden": 0.0}
            tokens = 0
            for micro in range(spec.grad_accum):
                windows = batch_indices(step, micro, spec, data.train_ids.shape[0], accelerator)
                ids = data.train_ids[windows].to(device)
                mask = data.train_mask[windows].to(device)
                sync = micro == spec.grad_accum - 1
                with (accelerator.no_sync(body) if not sync else nullcontext()), accelerator.autocast():
                    loss, parts = _micro_step(body, student, teacher, ids, mask, windows, prefix, pairs, cache,
                                              loss_config, spec.loss.hidden)
                    accelerator.backward(loss / spec.grad_accum)
                for key in totals:
                    totals[key] += parts.get(key, 0.0) / spec.grad_accum
                tokens += int(mask.sum()) * accelerator.num_processes
            grad_norm = None
            if spec.optimizer.max_grad_norm:
                grad_norm = float(accelerator.clip_grad_norm_(params, spec.optimizer.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            elapsed = time.perf_counter() - began
            result.seconds += elapsed
            result.tokens += tokens
            if step % spec.log_every == 0 or step == spec.steps:
                result.curve.append({"step": step, **{k: round(v, 5) for k, v in totals.items()},
                                     "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                                     "tokens": result.tokens, "tokens_per_second": round(tokens / elapsed, 1),
                                     "step_seconds": round(elapsed, 3)})
            bar.update(1)
            bar.set_postfix(loss=f"{totals['loss']:.3f}", kl=f"{totals['kl']:.3f}", tok_s=f"{tokens / elapsed:.0f}")
            if reference is not None and (step % spec.eval.every == 0 or step == spec.steps):
                heldout = _heldout_kl(student, data, reference)
                result.evals.append({"step": step, "kl_mean": heldout})
                if heldout < early["best"] - spec.eval.min_delta:
                    early.update(best=heldout, bad=0, best_step=step)
                    if spec.eval.patience:
                        best_tensors = {k: v.detach().clone() for k, v in trainable.items()}
                else:
                    early["bad"] += 1
                    if spec.eval.patience and early["bad"] >= spec.eval.patience:
                        result.stopped_early = True
                        log.info("held-out KL has not improved for %d evaluations: stopping at step %d",
                                 early["bad"], step)
            if step % spec.checkpoint_every == 0 or step == spec.steps or result.stopped_early:
                save(step)
                saved_at = step
    except KeyboardInterrupt:
        if step > saved_at:
            save(step)  # the state after the last whole step, so --resume loses nothing
            log.warning("interrupted: checkpoint saved at step %d; continue with --resume", step)
        raise
    finally:
        bar.close()
    if best_tensors is not None and early["best_step"] != step:
        with torch.no_grad():
            for name, param in trainable.items():
                param.copy_(best_tensors[name])
        log.log(logging.WARNING if early["best_step"] == 0 else logging.INFO,
                "keeping the weights of step %s (best held-out KL %.4f)", early["best_step"], early["best"])
    result.steps_done, result.best_step = step, early["best_step"]
    accelerator.free_memory()
    log.info("healed %d steps: %s target tokens at %.0f tokens/s (%s, first %d layers shared with the teacher)",
             step, f"{result.tokens:,}", result.tokens / max(result.seconds, 1e-9), precision, prefix)
    return result


def _micro_step(body, student, teacher, ids, mask, windows, prefix, pairs, cache, config, hidden_weight):
    capture_teacher = [t for _, t in pairs]
    start_hidden, dense = None, None
    if cache is None:
        out = teacher_forward(teacher, ids, prefix, capture_teacher)
        start_hidden = out.boundary
        selected = mask.bool()
        dense = DenseTeacher(out.final_hidden[selected].clone(), head_weight(teacher), logit_softcap(teacher))
        teacher_layers = out.layer_outputs
    else:
        teacher_layers = teacher_forward(teacher, ids, 0, capture_teacher).layer_outputs if pairs else {}
    hidden, student_layers = body(ids, start_hidden, prefix, tuple(s for s, _ in pairs))
    selected = mask.bool()
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    teacher_targets = dense if cache is None else cache.targets(windows.tolist(), ids, mask)
    loss, stats = distill_loss(hidden[selected], head_weight(student), teacher_targets, targets[selected],
                               torch.ones(int(selected.sum()), device=ids.device), config, logit_softcap(student))
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


def batch_indices(step: int, micro: int, spec: LoopSpec, n: int, accelerator) -> torch.Tensor:
    """Indices of the windows micro-batch `micro` of step `step` trains on, on this process."""
    global_batch = spec.batch_size * spec.grad_accum
    first = step * global_batch + micro * spec.batch_size
    picks = []
    for sample in range(first, first + spec.batch_size):
        epoch, offset = divmod(sample, n)
        picks.append(int(_epoch_order(spec.seed, epoch, n)[offset]))
    return torch.tensor(picks[accelerator.process_index :: accelerator.num_processes], dtype=torch.long)


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))


@torch.no_grad()
def _heldout_kl(student, data: TrainSet, reference) -> float:
    model = student.get_base_model() if hasattr(student, "get_base_model") else student
    was_training = model.training
    model.eval()
    try:
        return compare_to_parent(model, data.heldout_ids, reference)["kl_mean"]
    finally:
        model.train(was_training)


def lr_schedule(spec: OptimSpec, steps: int):
    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        if spec.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if spec.schedule == "cosine" else 1 - progress
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * shape

    return factor


