"""The step loop every heal loop shares (text distillation, image questions).

One optimizer step = `grad_accum` micro-batches of `batch_size` examples (split across processes
under `accelerate launch`). The example order is a seeded permutation per epoch, so step s always
sees the same examples: a run resumed from a checkpoint continues exactly where it stopped. The
driver owns the optimizer and schedule, the curve, held-out evaluations with early stopping (the
best weights are kept), and checkpoints every N steps and on Ctrl-C; a loop supplies what one step
computes and what held-out measure to watch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import SurgeonError
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .progress import report_step

log = logging.getLogger(__name__)

SHOWN = ("loss", "kl", "accuracy")  # what the progress bar shows of a step's measures


@dataclass
class LoopResult:
    curve: list[dict] = field(default_factory=list)  # every log_every steps
    evals: list[dict] = field(default_factory=list)  # held-out measures
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


def make_accelerator(spec):
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


def drive(spec, accelerator, trainable: dict[str, torch.nn.Parameter], body: torch.nn.Module, *,
          result: LoopResult, checkpoint_dir: Path, resume: bool, run_digest: str,
          one_step: Callable[[torch.nn.Module, int], tuple[dict[str, float], int]],
          evaluate: Callable[[torch.nn.Module], dict | None], metric: str, desc: str) -> LoopResult:
    """Run `spec.steps` optimizer steps. `one_step(body, step)` runs the step's micro-batches
    (forward and backward through `body` as accelerate prepared it) and returns its measures and
    target-token count; `evaluate(body)` returns held-out measures, in which `metric` is lower-better,
    or None when nothing is held out."""
    params = list(trainable.values())
    optimizer = torch.optim.AdamW(params, lr=spec.optimizer.lr, betas=spec.optimizer.betas,
                                  weight_decay=spec.optimizer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(spec.optimizer, spec.steps))
    body, optimizer = accelerator.prepare(body, optimizer)

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
        log.info("resuming at step %d of %d from %s", start, spec.steps, latest)
    elif (first := evaluate(body)) is not None:  # where training starts from
        result.evals.append({"step": 0, **first})
        # The untrained model is a candidate too: a run that only makes things worse keeps it.
        early.update(best=first[metric], best_step=0)
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

    bar = tqdm(total=spec.steps, initial=start, desc=desc, unit="step", disable=not accelerator.is_main_process)
    step, saved_at = start, start
    try:
        while step < spec.steps and not result.stopped_early:
            began = time.perf_counter()
            body.train()
            measures, tokens = one_step(body, step)
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
                result.curve.append({"step": step, **{k: round(v, 5) for k, v in measures.items()},
                                     "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                                     "tokens": result.tokens, "tokens_per_second": round(tokens / elapsed, 1),
                                     "step_seconds": round(elapsed, 3)})
            bar.update(1)
            report_step({"desc": desc, "step": step, "steps": spec.steps, **measures})
            bar.set_postfix(**{k: f"{v:.3f}" for k, v in measures.items() if k in SHOWN},
                            tok_s=f"{tokens / elapsed:.0f}")
            if step % spec.eval.every == 0 or step == spec.steps:
                measured = evaluate(body)
                if measured is not None:
                    result.evals.append({"step": step, **measured})
                    bar.write(f"step {step}: held-out " + ", ".join(f"{k} {v:.4f}" for k, v in measured.items()))
                    if measured[metric] < early["best"] - spec.eval.min_delta:
                        early.update(best=measured[metric], bad=0, best_step=step)
                        if spec.eval.patience:
                            best_tensors = {k: v.detach().clone() for k, v in trainable.items()}
                    else:
                        early["bad"] += 1
                        if spec.eval.patience and early["bad"] >= spec.eval.patience:
                            result.stopped_early = True
                            log.info("held-out %s has not improved for %d evaluations: stopping at step %d",
                                     metric, early["bad"], step)
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
                "keeping the weights of step %s (best held-out %s %.4f)", early["best_step"], metric, early["best"])
    result.steps_done, result.best_step = step, early["best_step"]
    accelerator.free_memory()
    return result


def batch_indices(step: int, micro: int, spec, n: int, accelerator) -> torch.Tensor:
    """Indices of the examples micro-batch `micro` of step `step` trains on, on this process."""
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


def lr_schedule(spec, steps: int):
    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        if spec.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, steps - spec.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if spec.schedule == "cosine" else 1 - progress
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * shape

    return factor
