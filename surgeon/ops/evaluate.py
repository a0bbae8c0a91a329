"""The `evaluate` step: measure the patient against its parent (or a named source) on held-out text."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..answers import AnswerSettings, answer
from ..errors import ParamError
from ..measure.chat_kl import FIRST_TOKENS, chat_compare
from ..measure.metrics import compare_to_parent, parent_reference
from ..prompts import PromptSources, conversations
from ..recipe.patient import Patient, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery.architecture import language_config
from ..text import TextData, describe_files
from ..vision.graft import language_model

log = logging.getLogger(__name__)

PARENT = "parent"


class ChatData(PromptSources):
    """Chat prompts the parent answers greedily once (cached; `max_new_tokens` bounds each
    answer); the model is teacher-forced on those answers. `limit`: the first N prompts only."""

    max_new_tokens: int = Field(128, gt=0, le=2048)
    limit: int | None = Field(None, gt=0)


class EvaluateParams(BaseModel):
    """Exactly one of `data` (held-out text: KL, top-1, perplexity) and `chat` (the parent's own
    answers to chat prompts: chat_kl, chat_top1, first-16-token agreement). `against`: `parent` (the
    recipe's base before any operation) or a named source; `name`: the stage's label in the report
    (default: after the previous operation)."""

    model_config = ConfigDict(extra="forbid")

    data: TextData | None = None
    chat: ChatData | None = None
    against: str = PARENT
    name: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.data is None) == (self.chat is None):
            raise ValueError("give exactly one of `data` (text) and `chat` (prompts)")
        return self


@register
class Evaluate(Operation):
    name = "evaluate"
    Params = EvaluateParams
    summary = "KL to the parent, top-1 agreement and perplexity on held-out text or on the parent's chat answers"
    measures = True
    accepts_vlm = True

    def plan(self, params: EvaluateParams, state: ModelState, ctx: StepContext):
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
        if params.chat is not None:
            try:
                ctx.facts["chat_files"] = files = params.chat.check_files(ctx.recipe_dir)
            except ParamError as exc:
                raise exc.under(("chat",)) from None
            count = len(_chat_prompts(params.chat, files))
            return state, f"{ctx.stage_name(params.name)}: the parent's answers to {count} chat prompts"
        files = ctx.resolve_text("files", params.data, ("data",))
        return (
            state,
            f"{ctx.stage_name(params.name)}: {params.data.tokens} tokens of {', '.join(f.name for f in files)}",
        )

    def apply(self, params: EvaluateParams, patient: Patient, ctx: StepContext) -> Patient:
        if params.chat is not None:
            return self._apply_chat(params, patient, ctx)
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

    def _apply_chat(self, params: EvaluateParams, patient: Patient, ctx: StepContext) -> Patient:
        spec = params.chat
        files = ctx.facts.get("chat_files") or spec.check_files(ctx.recipe_dir)
        if params.against == PARENT:
            reference, fingerprint = patient.parent, patient.base.fingerprint()
        else:
            source = ctx.sources[params.against]
            reference, fingerprint = source.load_model(), source.fingerprint()
        chats = _chat_prompts(spec, files)
        # fp32 for the reference: an evaluation should not inherit bf16's broken near-ties.
        settings = AnswerSettings(max_new_tokens=spec.max_new_tokens, dtype="float32")
        answered = answer(reference, patient.tokenizer, chats, settings, fingerprint)
        metrics = chat_compare(
            language_model(patient.model), reference, patient.tokenizer, answered.chats, answered.answer_ids
        )
        sources = [f"{len(spec.prompts)} inline"] if spec.prompts else []
        sources += [describe_files(found) for found in files.values()]
        stage = Stage(
            name=ctx.stage_name(params.name),
            data=f"the {params.against}'s answers to {metrics['prompts']} chat prompts ({', '.join(sources)})",
            kind="chat",
            metrics={**metrics, "max_new_tokens": spec.max_new_tokens},
        )
        log.info(
            "%s: chat_kl %.4f (median %.4f, p99 %.3f), top-1 %.3f, first %d tokens same on %.0f%% of %d prompts",
            stage.name,
            metrics["chat_kl_mean"],
            metrics["chat_kl_median"],
            metrics["chat_kl_p99"],
            metrics["chat_top1"],
            FIRST_TOKENS,
            100 * metrics["chat_first16"],
            metrics["prompts"],
        )
        return patient.with_stage(stage)


def _chat_prompts(spec: ChatData, files) -> list[list[dict]]:
    chats = conversations(spec, files)
    return chats[: spec.limit] if spec.limit else chats
