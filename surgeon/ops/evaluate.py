"""The `evaluate` step: measure the patient against its parent (or a named source) on held-out text."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict

from ..errors import ParamError
from ..measure.metrics import compare_to_parent, parent_reference
from ..recipe.patient import Patient, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery.architecture import language_config
from ..text import TextData

log = logging.getLogger(__name__)

PARENT = "parent"


class EvaluateParams(BaseModel):
    """`against`: `parent` (the recipe's base before any operation) or a named source; `name`: the
    stage's label in the report (default: after the previous operation)."""

    model_config = ConfigDict(extra="forbid")

    data: TextData
    against: str = PARENT
    name: str | None = None


@register
class Evaluate(Operation):
    name = "evaluate"
    Params = EvaluateParams
    summary = "KL to the parent, top-1 agreement and perplexity on held-out text"
    measures = True
    accepts_vlm = True

    def plan(self, params: EvaluateParams, state: ModelState, ctx: StepContext):
        files = ctx.resolve_text("files", params.data, ("data",))
        if params.against != PARENT:
            if params.against not in ctx.sources:
                known = ", ".join([PARENT, *ctx.sources])
                raise ParamError(("against",), f"unknown source '{params.against}' (known: {known})")
            reference_vocab = ctx.sources[params.against].config.vocab_size
        else:
            reference_vocab = ctx.sources["base"].config.vocab_size
        vocab = language_config(state.config).vocab_size
        if reference_vocab != vocab:
            raise ParamError(
                ("against",),
                f"vocabularies differ ({reference_vocab} vs {vocab}): KL needs the same tokens",
            )
        return (
            state,
            f"{ctx.stage_name(params.name)}: {params.data.tokens} tokens of {', '.join(f.name for f in files)}",
        )

    def apply(self, params: EvaluateParams, patient: Patient, ctx: StepContext) -> Patient:
        files, windows = ctx.text_windows("files", params.data, patient.tokenizer)
        if params.against == PARENT:
            reference = parent_reference(lambda: patient.parent, windows, patient.base.fingerprint())
        else:
            source = ctx.sources[params.against]
            reference = parent_reference(source.load_model, windows, source.fingerprint())
        metrics = compare_to_parent(patient.model, windows, reference)
        stage = Stage(
            name=ctx.stage_name(params.name),
            data=", ".join(f.name for f in files),
            metrics=metrics,
        )
        log.info(
            "%s: kl_mean %.4f, top-1 %.3f, ppl %.2f (parent %.2f) over %d tokens",
            stage.name,
            metrics["kl_mean"],
            metrics["top1_agreement"],
            metrics["ppl"],
            metrics["ppl_parent"],
            metrics["tokens"],
        )
        return patient.with_stage(stage)
