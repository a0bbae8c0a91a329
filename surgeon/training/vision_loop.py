"""Training a grafted VLM on image questions: cross-entropy on the answers (LLaVA stage 1 and 2).

There is no teacher: the parent LM has never seen an image. What trains is the projector, and
optionally tower blocks or LoRA on the LM; everything else is frozen. With the tower frozen its
outputs never change, so they are computed once for every image (and shared by all epochs):
a step is then the LM forward and backward only, and with the LM frozen too, only from the end of
the chat template's opening, which every question shares (shared_prefix.py). Logits are computed
at the answer positions only, since nothing else is scored. The step loop (checkpoints,
`--resume`, early stopping on the held-out answer loss) is driver.py's, as for text.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from ..vision.features import TowerFeatures, tower_features
from .driver import LoopResult, batch_indices, drive, make_accelerator
from .loop import LoopSpec
from .shared_prefix import SharedPrefix

log = logging.getLogger(__name__)


class AnswerLoss(torch.nn.Module):
    """VLM forward to the LM's final hidden states, then CE at the answer positions only. One
    module so accelerate/DDP can wrap it."""

    def __init__(self, vlm, shared_opening: bool = True):
        super().__init__()
        self.vlm = vlm
        self.prefix = SharedPrefix(vlm.config.image_token_id) if shared_opening else None

    def forward(self, input_ids, attention_mask, targets, pixel_values=None, tower_tokens=None):
        vlm = self.vlm
        embeds = vlm.embed(input_ids, pixel_values, tower_tokens)
        lm = vlm.language_model
        base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
        start, cache = self.prefix.split(base, input_ids, attention_mask, targets) if self.prefix else (0, None)
        hidden = base.model(
            inputs_embeds=embeds[:, start:],
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
        ).last_hidden_state
        targets = targets[:, start:]
        scored = targets != -100
        logits = base.get_output_embeddings()(hidden[scored]).float()
        cap = getattr(base.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        answers = targets[scored]
        loss = torch.nn.functional.cross_entropy(logits, answers)
        return loss, logits.argmax(-1) == answers, scored


def shifted_targets(input_ids: torch.Tensor, masks: list[list[bool]]) -> torch.Tensor:
    """targets[b, t] = the token at t+1 where that token is an answer token, else -100."""
    targets = torch.full_like(input_ids, -100)
    for row, mask in enumerate(masks):
        for t in range(len(mask) - 1):
            if mask[t + 1]:
                targets[row, t] = input_ids[row, t + 1]
    return targets


class Batches:
    """Padded ids, targets and image inputs for lists of examples; tower outputs cached when frozen."""

    def __init__(self, vlm, processor, examples: dict[str, list], pad_id: int, cache_tower: bool, device):
        self.vlm, self.processor, self.pad_id, self.device = vlm, processor, pad_id, device
        self.examples = examples
        self.cached: dict[str, TowerFeatures] = {}
        if cache_tower:
            for split, items in examples.items():
                self.cached[split] = tower_features(
                    vlm, processor, items, device=device, desc=f"tower features ({split})"
                )

    def features_summary(self) -> dict:
        """What computing the frozen tower's outputs took before the first step (data preparation)."""
        parts = [f.summary() for f in self.cached.values()]
        return {key: sum(p[key] for p in parts) for key in ("images", "from_cache", "seconds")} if parts else {}

    def batch(self, split: str, indices: list[int]) -> dict:
        items = [self.examples[split][i] for i in indices]
        length = max(len(e.ids) for e in items)
        ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(items), length, dtype=torch.long)
        for row, example in enumerate(items):
            ids[row, : len(example.ids)] = torch.tensor(example.ids)
            attention[row, : len(example.ids)] = 1
        out = {
            "input_ids": ids.to(self.device),
            "attention_mask": attention.to(self.device),
            "targets": shifted_targets(ids, [e.mask for e in items]).to(self.device),
        }
        if split in self.cached:
            cached = self.cached[split]
            rows = [r for i in indices for r in range(*cached.spans[i])]
            out["tower_tokens"] = cached.features[rows].to(self.device) if rows else None
        else:
            loaders = [load for e in items for load in e.images]
            out["pixel_values"] = (
                self.processor.pixels([load() for load in loaders]).to(self.device) if loaders else None
            )
        return out


def train_vision(
    vlm,
    trainable: dict[str, torch.nn.Parameter],
    data,
    processor,
    spec: LoopSpec,
    *,
    checkpoint_dir,
    resume: bool,
    run_digest: str,
) -> LoopResult:
    accelerator, precision = make_accelerator(spec)
    device = accelerator.device
    vlm.to(device)
    result = LoopResult(precision=precision)
    tower_trains = any(name.startswith("vision_tower.") or ".vision_tower." in name for name in trainable)
    pad_id = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else 0
    batches = Batches(
        vlm,
        processor,
        {"train": data.train, "heldout": data.heldout},
        pad_id,
        cache_tower=not tower_trains,
        device=device,
    )
    result.prepared = batches.features_summary()

    def one_step(body, step: int):
        totals, tokens = {"loss": 0.0, "accuracy": 0.0}, 0
        for micro in range(spec.grad_accum):
            indices = batch_indices(step, micro, spec, len(data.train), accelerator).tolist()
            inputs = batches.batch("train", indices)
            sync = micro == spec.grad_accum - 1
            with accelerator.no_sync(body) if not sync else nullcontext(), accelerator.autocast():
                loss, correct, _ = body(**inputs)
                accelerator.backward(loss / spec.grad_accum)
            totals["loss"] += loss.item() / spec.grad_accum
            totals["accuracy"] += correct.float().mean().item() / spec.grad_accum  # answer tokens right
            tokens += int(correct.numel()) * accelerator.num_processes
        return totals, tokens

    def evaluate(body):
        return _heldout(body, batches, accelerator) if data.heldout else None

    drive(
        spec,
        accelerator,
        trainable,
        AnswerLoss(vlm),
        result=result,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        run_digest=run_digest,
        one_step=one_step,
        evaluate=evaluate,
        metric="loss",
        desc="train",
    )
    log.info(
        "trained %d steps on %s answer tokens in %.0f s (%s)",
        result.steps_done,
        f"{result.tokens:,}",
        result.seconds,
        precision,
    )
    return result


@torch.no_grad()
def _heldout(body, batches: Batches, accelerator, batch: int = 32) -> dict:
    """Answer loss (per token) and the share of examples whose every answer token is the argmax."""
    was_training = body.training
    body.eval()
    total_loss, total_tokens, exact, count = 0.0, 0, 0, 0
    try:
        n = len(batches.examples["heldout"])
        for start in range(0, n, batch):
            indices = list(range(start, min(n, start + batch)))
            inputs = batches.batch("heldout", indices)
            with accelerator.autocast():
                loss, correct, scored = body(**inputs)
            total_loss += loss.item() * correct.numel()
            total_tokens += correct.numel()
            per_row = scored.sum(1).tolist()
            for chunk in torch.split(correct, per_row):
                exact += bool(chunk.all())
                count += 1
    finally:
        body.train(was_training)
    return {"loss": total_loss / max(total_tokens, 1), "exact": exact / max(count, 1)}
