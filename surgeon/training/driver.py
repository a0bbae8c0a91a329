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

from ..errors import RunCancelled, SurgeonError
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
    prepared: dict = field(default_factory=dict)  # inputs made before the first step (tower features); not in seconds

    def summary(self) -> dict:
        return {
            "steps": self.steps_done,
            "stopped_early": self.stopped_early,
            "best_step": self.best_step,
            "seconds": round(self.seconds, 1),
            "tokens": self.tokens,
            "tokens_per_second": round(self.tokens / self.seconds, 1) if self.seconds else None,
            "shared_prefix_layers": self.shared_prefix,
            "precision": self.precision,
        } | ({"prepared": self.prepared} if self.prepared else {})


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:  # bf16 pays off on CPUs with AVX-512 BF16 or AMX; elsewhere it is emulated and slow
        return "bf16" if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else "fp32"
    except AttributeError:
        return "fp32"


def make_accelerator(spec, precision: str | None = None):
    """(Accelerator, precision) for a heal loop: DDP or one process, mixed precision where it pays
    (`spec.precision` unless the caller fixes `precision`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(precision or spec.precision, device)
    AcceleratorState._reset_state()  # a second heal step in this process may use another precision
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]
    )
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        # The fused loss reads the LM head's weight directly and checkpoints hold plain tensors;
        # both assume every process has whole parameters, which sharded training does not give.
        raise SurgeonError(
            f"heal runs data-parallel (DDP) only, not {accelerator.distributed_type.name}: "
            "launch with recipes/accelerate/ddp.yaml"
        )
    if spec.batch_size % accelerator.num_processes:
        raise SurgeonError(f"batch_size {spec.batch_size} does not divide over {accelerator.num_processes} processes")
    return accelerator, precision


def drive(
    spec,
    accelerator,
    trainable: dict[str, torch.nn.Parameter],
    body: torch.nn.Module,
    *,
    result: LoopResult,
    checkpoint_dir: Path,
    resume: bool,
    run_digest: str,
    one_step: Callable[[torch.nn.Module, int], tuple[dict[str, float], int]],
    evaluate: Callable[[torch.nn.Module], dict | None],
    metric: str,
    desc: str,
) -> LoopResult:
    """Run `spec.steps` optimizer steps. `one_step(body, step)` runs the step's micro-batches
    (forward and backward through `body` as accelerate prepared it) and returns its measures and
    target-token count; `evaluate(body)` returns held-out measures, in which `metric` is lower-better,
    or None when nothing is held out."""
    run = _Run(spec, accelerator, trainable, result, checkpoint_dir, run_digest, metric)
    body = run.prepare(body)
    start = run.resume_or_begin(evaluate, body) if resume else run.begin(evaluate, body)
    bar = tqdm(total=spec.steps, initial=start, desc=desc, unit="step", disable=not accelerator.is_main_process)
    step, saved_at = start, start
    try:
        while step < spec.steps and not result.stopped_early:
            measures, tokens, elapsed = run.optimizer_step(one_step, body, step)
            step += 1
            run.record(step, measures, tokens, elapsed)
            bar.update(1)
            report_step({"desc": desc, "step": step, "steps": spec.steps, **measures})
            bar.set_postfix(
                **{k: f"{v:.3f}" for k, v in measures.items() if k in SHOWN}, tok_s=f"{tokens / elapsed:.0f}"
            )
            if step % spec.eval.every == 0 or step == spec.steps:
                if (measured := evaluate(body)) is not None:
                    bar.write(f"step {step}: held-out " + ", ".join(f"{k} {v:.4f}" for k, v in measured.items()))
                    run.watch(step, measured)
            if step % spec.checkpoint_every == 0 or step == spec.steps or result.stopped_early:
                run.save(step)
                saved_at = step
    except (KeyboardInterrupt, RunCancelled):
        if step > saved_at:
            run.save(step)  # the state after the last whole step, so --resume loses nothing
            log.warning("interrupted: checkpoint saved at step %d; continue with --resume", step)
        raise
    finally:
        bar.close()
    run.keep_best(step)
    accelerator.free_memory()
    return result


class _Run:
    """One drive's state: the optimizer and schedule, early stopping with the best weights, and the
    checkpoints that carry all of it across an interruption."""

    def __init__(
        self, spec, accelerator, trainable, result: LoopResult, checkpoint_dir: Path, run_digest: str, metric: str
    ):
        self.spec, self.accelerator, self.trainable, self.result = spec, accelerator, trainable, result
        self.checkpoint_dir, self.run_digest, self.metric = checkpoint_dir, run_digest, metric
        self.params = list(trainable.values())
        self.early = {"best": math.inf, "bad": 0, "best_step": None}
        self.best_tensors: dict[str, torch.Tensor] | None = None

    def prepare(self, body: torch.nn.Module) -> torch.nn.Module:
        opt = self.spec.optimizer
        optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(opt, self.spec.steps))
        body, self.optimizer = self.accelerator.prepare(body, optimizer)
        return body

    def resume_or_begin(self, evaluate, body) -> int:
        """The step to start from: the latest checkpoint's, else 0 (see begin)."""
        latest = latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            return self.begin(evaluate, body)
        meta = load_checkpoint(latest, self.trainable, self.optimizer, self.scheduler)
        if meta.get("run_digest") != self.run_digest:
            raise SurgeonError(f"{latest} was written by a different recipe or data; remove it or run without --resume")
        self.early = meta["early_stop"]
        result = self.result
        result.curve, result.evals = meta["curve"], meta["evals"]
        result.tokens, result.seconds = meta["tokens"], meta["seconds"]
        if self.early["best_step"] is not None and self.spec.eval.patience:
            from safetensors.torch import load_file

            best = load_file(str(latest / "best.safetensors"))
            self.best_tensors = {k.removeprefix("best."): v for k, v in best.items()}
        log.info("resuming at step %d of %d from %s", meta["step"], self.spec.steps, latest)
        return meta["step"]

    def begin(self, evaluate, body) -> int:
        """Step 0: the held-out measure where training starts from, if anything is held out."""
        if (first := evaluate(body)) is not None:
            self.result.evals.append({"step": 0, **first})
            # The untrained model is a candidate too: a run that only makes things worse keeps it.
            self.early.update(best=first[self.metric], best_step=0)
            if self.spec.eval.patience:
                self.best_tensors = self._copy()
        return 0

    def optimizer_step(self, one_step, body, step: int) -> tuple[dict[str, float], int, float]:
        began = time.perf_counter()
        body.train()
        measures, tokens = one_step(body, step)
        self.grad_norm = None
        if self.spec.optimizer.max_grad_norm:
            self.grad_norm = float(self.accelerator.clip_grad_norm_(self.params, self.spec.optimizer.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return measures, tokens, time.perf_counter() - began

    def record(self, step: int, measures: dict[str, float], tokens: int, elapsed: float) -> None:
        result = self.result
        result.seconds += elapsed
        result.tokens += tokens
        if step % self.spec.log_every == 0 or step == self.spec.steps:
            result.curve.append(
                {
                    "step": step,
                    **{k: round(v, 5) for k, v in measures.items()},
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": self.grad_norm,
                    "tokens": result.tokens,
                    "tokens_per_second": round(tokens / elapsed, 1),
                    "step_seconds": round(elapsed, 3),
                }
            )

    def watch(self, step: int, measured: dict) -> None:
        """Early stopping on the held-out `metric`, keeping the best weights when patience is set."""
        self.result.evals.append({"step": step, **measured})
        early, patience = self.early, self.spec.eval.patience
        if measured[self.metric] < early["best"] - self.spec.eval.min_delta:
            early.update(best=measured[self.metric], bad=0, best_step=step)
            if patience:
                self.best_tensors = self._copy()
            return
        early["bad"] += 1
        if patience and early["bad"] >= patience:
            self.result.stopped_early = True
            log.info(
                "held-out %s has not improved for %d evaluations: stopping at step %d", self.metric, early["bad"], step
            )

    def save(self, step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        result = self.result
        extra = {
            "run_digest": self.run_digest,
            "early_stop": self.early,
            "curve": result.curve,
            "evals": result.evals,
            "tokens": result.tokens,
            "seconds": result.seconds,
        }
        path = save_checkpoint(self.checkpoint_dir, step, self.trainable, self.optimizer, self.scheduler, extra)
        if self.best_tensors is not None:
            from safetensors.torch import save_file

            save_file(
                {f"best.{k}": v.contiguous() for k, v in self.best_tensors.items()}, str(path / "best.safetensors")
            )

    def keep_best(self, step: int) -> None:
        """Put back the best held-out weights (when they are not the last), and record where it ended."""
        early = self.early
        if self.best_tensors is not None and early["best_step"] != step:
            with torch.no_grad():
                for name, param in self.trainable.items():
                    param.copy_(self.best_tensors[name])
            log.log(
                logging.WARNING if early["best_step"] == 0 else logging.INFO,
                "keeping the weights of step %s (best held-out %s %.4f)",
                early["best_step"],
                self.metric,
                early["best"],
            )
        self.result.steps_done, self.result.best_step = step, early["best_step"]

    def _copy(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.trainable.items()}


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
