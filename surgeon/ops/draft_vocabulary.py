"""draft_vocabulary: make the patient a speculative-decoding draft for its parent, with a reduced
output vocabulary: the N tokens the parent writes most often (cf. FR-Spec, Zhao et al. 2025).

A shallow draft of a 135M model spends most of a step in its LM head (49,152 x 576 = 28M of the
weights it reads); scoring only the tokens the parent actually writes cuts that by the vocabulary's
ratio. The kept ids go into the config (`surgeon_draft.token_ids`); the checkpoint keeps its full
head, so it stays a standard model that transformers loads, and surgeon's engine, given it as a
draft, scores only those rows. Frequencies come from the parent's own answers to the step's prompts
(generated through the engine and cached, like self_distill's); coverage is measured on a held-out
tenth of them.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter

from pydantic import ConfigDict, Field

from ..answers import AnswerSettings, answer
from ..errors import ParamError
from ..prompts import PromptSources, conversations, follow_ups
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, Operation, StepContext, register

log = logging.getLogger(__name__)


class DraftVocabularyParams(PromptSources, AnswerSettings):
    """`vocabulary`: how many output ids the draft scores; the prompts (and answer settings) whose
    answers by the parent are counted."""

    model_config = ConfigDict(extra="forbid")

    vocabulary: int = Field(8192, ge=16)


@register
class DraftVocabulary(Operation):
    name = "draft_vocabulary"
    Params = DraftVocabularyParams
    summary = "a speculative draft for the parent: the output vocabulary cut to the parent's most frequent tokens"

    def plan(self, params: DraftVocabularyParams, state: ModelState, ctx: StepContext):
        vocab = state.config.vocab_size
        if params.vocabulary >= vocab:
            raise ParamError(("vocabulary",), f"{params.vocabulary} is not fewer than the vocabulary's {vocab} tokens")
        ctx.facts["files"] = params.check_files(ctx.recipe_dir)
        prompts = conversations(params, ctx.facts["files"])
        return state, (
            f"output vocabulary {vocab} -> {params.vocabulary} for speculative decoding (the parent's commonest "
            f"tokens in its answers to {len(prompts)} prompts)"
        )

    def apply(self, params: DraftVocabularyParams, patient: Patient, ctx: StepContext) -> Patient:
        files = ctx.facts.get("files") or params.check_files(ctx.recipe_dir)
        chats = conversations(params, files)
        settings = AnswerSettings(**params.model_dump(include=set(AnswerSettings.model_fields)))
        # The same follow-ups as a self_distill source with these prompts, so its cached answers serve.
        asked = follow_ups(len(chats), params.follow_up, settings.seed)
        answered = answer(patient.parent, patient.tokenizer, chats, settings, patient.base.fingerprint(), asked)
        held = max(1, len(answered.answer_ids) // 10)
        counts = Counter(token for ids in answered.answer_ids[held:] for token in ids)
        always = _end_tokens(patient.tokenizer, patient.parent)
        kept = [token for token in always if token < patient.model.config.vocab_size]
        for token, _ in counts.most_common():
            if len(kept) >= params.vocabulary:
                break
            if token not in always:
                kept.append(token)
        kept = sorted(kept)
        chosen = set(kept)
        heldout = [token for ids in answered.answer_ids[:held] for token in ids]
        coverage = sum(token in chosen for token in heldout) / max(len(heldout), 1)
        counted = sum(counts.values())
        train_coverage = sum(counts[token] for token in chosen) / max(counted, 1)
        # A new model object with its own config; the tensors are shared, nothing is copied.
        model = copy.copy(patient.model)
        model.config = config = copy.deepcopy(patient.model.config)
        config.surgeon_draft = {
            "draft_for": patient.base.label,
            "draft_for_fingerprint": patient.base.fingerprint(),
            "tokens": len(kept),
            "coverage_heldout": round(coverage, 4),
            "token_ids": kept,
        }
        log.info(
            "draft vocabulary: %d of %d tokens cover %.1f%% of the parent's held-out answer tokens",
            len(kept),
            config.vocab_size,
            100 * coverage,
        )
        entry = Provenance(
            op=self.name,
            what=f"output vocabulary cut to {len(kept)} of {config.vocab_size} tokens for speculative decoding",
            why=(
                f"a draft for {patient.base.label}: the parent's commonest tokens in its answers to "
                f"{len(chats) - held} prompts cover {100 * train_coverage:.1f}% of those answers and "
                f"{100 * coverage:.1f}% of its answers to {held} held-out prompts"
            ),
            params={"vocabulary": params.vocabulary},
            before={"vocab_size": config.vocab_size},
            after={"draft_tokens": len(kept)},
            details={
                "coverage_heldout": coverage,
                "coverage_counted": train_coverage,
                "answer_tokens": answered.tokens,
                "generation_seconds": answered.seconds,
            },
        )
        return patient.with_model(model, entry, patient.layer_origin())


def _end_tokens(tokenizer, model) -> list[int]:
    """Ids that end an answer, which a draft must be able to propose."""
    ids = set()
    for holder in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(holder, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return sorted(ids)
