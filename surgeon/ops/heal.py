"""heal: brief distillation from the unoperated parent (or a named teacher) to win back quality.

Student: the patient. Teacher: `parent` (the base before the recipe's first step) or a named
source with the same vocabulary. What trains is given by globs and/or LoRA; everything else is
frozen. Checkpoints go beside the export, so `surgeon run RECIPE --resume` continues a killed run
exactly.
"""

from __future__ import annotations

import logging

from pydantic import ConfigDict

from ..errors import ParamError
from ..modeling.sparse_attention import sparse_modules
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery import architecture
from ..surgery.architecture import shape_of
from ..text import describe_files
from ..training.heal_data import IMAGE_KINDS, HealData, check_sources
from ..training.indexer import indexer_mode
from ..training.loop import LoopSpec, train
from ..training.text_set import build_train_set, describe_self_distill
from ..training.trainable import TrainSpec, check_trainable, finish_student, prepare_student
from ..training.vision_heal import apply_vision_heal, plan_vision_heal
from ..vision.graft import is_vlm

log = logging.getLogger(__name__)

PARENT = "parent"


class HealParams(LoopSpec):
    model_config = ConfigDict(extra="forbid")

    teacher: str = PARENT
    data: HealData
    train: TrainSpec


@register
class Heal(Operation):
    name = "heal"
    Params = HealParams
    summary = "distil the parent back into the operated model (KL on logits; globs and/or LoRA)"
    accepts_vlm = True

    def plan(self, params: HealParams, state: ModelState, ctx: StepContext):
        if is_vlm(state):
            return plan_vision_heal(params, state, ctx)
        images = [i for i, s in enumerate(params.data.sources) if s.kind in IMAGE_KINDS]
        if images:
            raise ParamError(
                ("data", "sources", images[0]),
                "image questions need a vision tower: put a graft_vision step before this heal",
            )
        if params.teacher != PARENT:
            if params.teacher not in ctx.sources:
                known = ", ".join([PARENT, *ctx.sources])
                raise ParamError(("teacher",), f"unknown source '{params.teacher}' (known: {known})")
            if params.loss.hidden:
                raise ParamError(
                    ("loss", "hidden"), "the hidden-state loss maps layers to the parent's: use teacher: parent"
                )
        teacher_config = ctx.sources["base"].config if params.teacher == PARENT else ctx.sources[params.teacher].config
        if teacher_config.vocab_size != state.config.vocab_size:
            raise ParamError(
                ("teacher",), f"vocabularies differ ({teacher_config.vocab_size} vs {state.config.vocab_size})"
            )
        if params.teacher_cache is not None and params.loss.temperature != 1.0:
            raise ParamError(
                ("teacher_cache",), "the top-k teacher cache holds temperature-1 logits: use temperature 1"
            )
        if params.teacher_cache is not None and params.loss.kl == 0:
            raise ParamError(("teacher_cache",), "a teacher cache without a KL term would never be read")
        ctx.facts["files"] = files = check_sources(params.data.sources, ctx.recipe_dir)
        teacher_fingerprint = ctx.sources["base" if params.teacher == PARENT else params.teacher].fingerprint()
        generation = [
            describe_self_distill(source.self_distill, files.get(i, {}), teacher_fingerprint)
            for i, source in enumerate(params.data.sources)
            if source.kind == "self_distill"
        ]
        meta_model = architecture.meta_model(state.config)
        counts = check_trainable(_with_indexers(params.train, meta_model), meta_model, ("train",))
        ctx.facts["trainable"] = counts
        share = counts["trainable"] / counts["total"]
        tokens = params.steps * params.batch_size * params.grad_accum * params.data.window
        globs = params.train.params or []
        how = " + ".join(
            filter(
                None, [" ".join(f"`{g}`" for g in globs), f"LoRA r={params.train.lora.r}" if params.train.lora else ""]
            )
        )
        note = (
            f"train {counts['trainable'] / 1e6:.2f}M params ({share:.1%}, {how}); {params.steps} steps, "
            f"~{tokens / 1e3:.0f}K tokens; "
            + (f"teacher {params.teacher}" if params.loss.kl or params.loss.hidden else "cross-entropy, no teacher")
            + "".join(f"; {line}" for line in generation)
        )
        return state, note

    def apply(self, params: HealParams, patient: Patient, ctx: StepContext) -> Patient:
        if is_vlm(patient.model):
            return apply_vision_heal(self.name, params, patient, ctx)
        if params.teacher == PARENT:
            teacher, fingerprint = patient.parent, patient.base.fingerprint()
        else:
            source = ctx.sources[params.teacher]
            teacher, fingerprint = source.load_model(), source.fingerprint()
        for param in teacher.parameters():
            param.requires_grad_(False)
        files = ctx.facts.get("files") or check_sources(params.data.sources, ctx.recipe_dir)
        data = build_train_set(params.data, files, patient.tokenizer, teacher, fingerprint)
        before = patient.shape().as_dict()
        # A new module around the same tensors: training never touches the caller's model or the
        # parent (trained tensors are copied first, in prepare_student).
        current = patient.model
        student = architecture.assemble(current.config, current.state_dict(), current.generation_config)
        sparse = bool(sparse_modules(student))
        student, trainable = prepare_student(student, _with_indexers(params.train, student))
        digest = ctx.run_digest(data.digest(), sorted(trainable))
        # A sparse-attention student: selection on, and each indexer learns the attention over the
        # keys it picked (DeepSeek's second stage) while the LM is distilled.
        with ctx.checkpoint_dir("heal") as checkpoints, indexer_mode(student, dense=False, loss=sparse):
            result = train(
                student,
                trainable,
                teacher,
                data,
                params,
                teacher_fingerprint=fingerprint,
                teacher_is_parent=params.teacher == PARENT,
                layer_origin=patient.layer_origin(),
                checkpoint_dir=checkpoints,
                resume=ctx.resume,
                run_digest=digest,
            )
        model = finish_student(student)
        counts = ctx.facts.get("trainable") or {"trainable": sum(p.numel() for p in trainable.values()), "total": 0}
        evals = result.evals
        kl_text = f"; held-out KL {evals[0]['kl_mean']:.4f} -> {evals[-1]['kl_mean']:.4f}" if len(evals) >= 2 else ""
        made = iter(data.generated)
        named = [
            f"the teacher's answers to {next(made).prompts} prompts"
            if s.kind == "self_distill"
            else describe_files(files[i])
            for i, s in enumerate(params.data.sources)
        ]
        entry = Provenance(
            op=self.name,
            what=(
                f"healed for {result.steps_done} steps on {result.tokens:,} target tokens "
                f"({counts['trainable']:,} parameters trained{', LoRA merged' if params.train.lora else ''})"
            ),
            why=f"{_objective(params)} on {' + '.join(named)}{kl_text}",
            # The run digest (recipe, data, what trained) makes the patient's fingerprint unique to
            # this training, so caches keyed by it never mistake one healed model for another.
            params={"steps": result.steps_done, "trainable": counts, "teacher": params.teacher, "run": digest},
            before=before,
            after=shape_of(model.config, model.dtype).as_dict(),
            details={
                "training": result.summary(),
                "curve": result.curve,
                "heldout": evals,
                "data": {
                    "train_windows": data.train_ids.shape[0],
                    "window": params.data.window,
                    "heldout_windows": data.heldout_ids.shape[0],
                    "train_tokens": data.train_tokens,
                },
                "generation": [
                    {
                        "conversations": len(g.chats),
                        "prompts": g.prompts,
                        "tokens": g.tokens,
                        "seconds": g.seconds,
                        "cached": g.cached,
                    }
                    for g in data.generated
                ],
            },
        )
        return patient.with_model(model, entry)


def _with_indexers(train: TrainSpec, model) -> TrainSpec:
    """A sparse-attention model's indexers always train with it (on their own loss)."""
    if not sparse_modules(model):
        return train
    return train.model_copy(update={"params": [*(train.params or []), "model.layers.*.self_attn.indexer"]})


def _objective(params: HealParams) -> str:
    """What the step trained towards, in words: distillation, or plain fine-tuning (cross-entropy only)."""
    loss = params.loss
    if not loss.kl and not loss.hidden:
        return f"fine-tuning on the text (cross-entropy x{loss.ce}, no teacher)"
    return (
        f"distillation from the {params.teacher} (KL x{loss.kl} at T={loss.temperature}"
        f"{f', CE x{loss.ce}' if loss.ce else ''}{f', hidden x{loss.hidden}' if loss.hidden else ''})"
    )
