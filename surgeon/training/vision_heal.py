"""The heal step on a grafted VLM: train on image questions (no teacher; CE on the answers).

`train: {params: [projector]}` is LLaVA's stage 1; adding tower blocks (`vision_tower.model.blocks.6`)
or `lora` on the language model is stage 2. A loss section, if given, must be CE only: the parent
LM has no view of the images to distil from.
"""

from __future__ import annotations

import copy

import torch

from ..errors import ParamError
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, StepContext
from ..surgery.architecture import shape_of
from ..vision.graft import processor_for
from ..vision.image_set import build_vision_set, describe_source
from .heal_data import IMAGE_KINDS, check_sources
from .trainable import check_trainable, finish_student, prepare_student
from .vision_loop import train_vision


def plan_vision_heal(params, state: ModelState, ctx: StepContext):
    from ..modeling import SurgeonVLMForConditionalGeneration

    if params.teacher != "parent":
        raise ParamError(("teacher",), "a grafted VLM trains on image answers; there is no teacher to name")
    if "loss" in params.model_fields_set:
        if params.loss.kl or params.loss.hidden:
            raise ParamError(
                ("loss",),
                "a grafted VLM trains on the answers (ce); the parent LM cannot see "
                "the images, so kl and hidden must be 0",
            )
        if not params.loss.ce:
            raise ParamError(("loss", "ce"), "nothing to train on: set ce > 0")
    if params.teacher_cache is not None:
        raise ParamError(("teacher_cache",), "a grafted VLM has no teacher to cache")
    for index, source in enumerate(params.data.sources):
        if source.kind not in (*IMAGE_KINDS, "jsonl"):
            raise ParamError(
                ("data", "sources", index),
                f"a {source.kind} source holds no images: a grafted VLM "
                "trains on synthetic, mnist or jsonl image records",
            )
        if source.kind == "synthetic" and source.synthetic.style == "second":
            raise ParamError(
                ("data", "sources", index, "synthetic", "style"),
                "the second renderer is for measurement only (training never sees it): train on plain or varied",
            )
    ctx.facts["files"] = check_sources(params.data.sources, ctx.recipe_dir)
    with torch.device("meta"):
        meta_model = SurgeonVLMForConditionalGeneration(state.config)
    counts = check_trainable(params.train, meta_model, ("train",))
    ctx.facts["trainable"] = counts
    share = counts["trainable"] / counts["total"]
    examples = params.steps * params.batch_size * params.grad_accum
    how = " + ".join(
        filter(
            None,
            [
                " ".join(f"`{g}`" for g in params.train.params),
                f"LoRA r={params.train.lora.r}" if params.train.lora else "",
            ],
        )
    )
    note = (
        f"train {counts['trainable'] / 1e6:.2f}M params ({share:.2%}, {how}); {params.steps} steps, "
        f"{examples:,} image questions; CE on the answers, {state.config.image_seq_length} image tokens each"
    )
    return state, note


def apply_vision_heal(op_name: str, params, patient: Patient, ctx: StepContext) -> Patient:
    files = ctx.facts.get("files") or check_sources(params.data.sources, ctx.recipe_dir)
    processor = processor_for(patient.model, patient.tokenizer)
    data = build_vision_set(params.data, files, processor)
    before = patient.shape().as_dict()
    student = _training_copy(patient.model)
    student, trainable = prepare_student(student, params.train)
    digest = ctx.run_digest(data.digest(), sorted(trainable))
    with ctx.checkpoint_dir("heal") as checkpoints:
        result = train_vision(
            student,
            trainable,
            data,
            processor,
            params,
            checkpoint_dir=checkpoints,
            resume=ctx.resume,
            run_digest=digest,
        )
    model = finish_student(student)
    counts = ctx.facts.get("trainable") or {"trainable": sum(p.numel() for p in trainable.values()), "total": 0}
    evals = result.evals
    held = f"; held-out answers exact {evals[0]['exact']:.1%} -> {evals[-1]['exact']:.1%}" if len(evals) >= 2 else ""
    named = [describe_source(s) for s in params.data.sources]
    entry = Provenance(
        op=op_name,
        what=(
            f"trained for {result.steps_done} steps on image questions ({counts['trainable']:,} parameters: "
            f"{', '.join(params.train.params) or 'LoRA'}{', LoRA merged' if params.train.lora else ''})"
        ),
        why=f"cross-entropy on the answers to {len(data.train):,} image questions from {' + '.join(named)}{held}",
        params={"steps": result.steps_done, "trainable": counts, "run": digest},
        before=before,
        after=shape_of(model.config, model.dtype).as_dict(),
        details={
            "training": result.summary(),
            "curve": result.curve,
            "heldout": evals,
            "data": {"train_examples": len(data.train), "heldout_examples": len(data.heldout)},
        },
    )
    return patient.with_model(model, entry)


def _training_copy(module: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
    """New module objects around the same tensors (tied parameters stay tied). What trains is
    copied in prepare_student, which then never writes into the patient before this step, nor into
    the parent LM inside it."""
    memo = {} if memo is None else memo
    clone = copy.copy(module)
    clone._parameters = {}
    for name, param in module._parameters.items():
        if param is not None and id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(param.data, requires_grad=False)
        clone._parameters[name] = None if param is None else memo[id(param)]
    clone._buffers = dict(module._buffers)
    clone._modules = {
        name: None if child is None else _training_copy(child, memo) for name, child in module._modules.items()
    }
    return clone
