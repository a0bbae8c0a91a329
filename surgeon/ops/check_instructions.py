"""check_instructions: does generation survive the surgery? Scored for the patient and the parent."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from ..measure.instructions import ITEMS, instruction_check
from ..recipe.patient import Patient, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..vision.graft import language_model

log = logging.getLogger(__name__)
_PARENT_RESULTS: dict[str, dict] = {}  # the parent is scored once per process


class CheckInstructionsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    max_new_tokens: int = Field(40, gt=0, le=512)


@register
class CheckInstructions(Operation):
    name = "check_instructions"
    Params = CheckInstructionsParams
    summary = f"{len(ITEMS)} prompts with checkable answers, greedy; patient and parent"
    accepts_vlm = True
    measures = True

    def plan(self, params, state: ModelState, ctx: StepContext):
        return state, f"{ctx.stage_name(params.name)}: {len(ITEMS)} instruction prompts"

    def apply(self, params: CheckInstructionsParams, patient: Patient, ctx: StepContext) -> Patient:
        key = f"{patient.base.fingerprint()}|{params.max_new_tokens}"
        if key not in _PARENT_RESULTS:
            _PARENT_RESULTS[key] = instruction_check(patient.parent, patient.tokenizer, params.max_new_tokens)
        parent = _PARENT_RESULTS[key]
        mine = instruction_check(language_model(patient.model), patient.tokenizer, params.max_new_tokens)
        name = ctx.stage_name(params.name)
        log.info(
            "%s: %d/%d instructions right (parent %d/%d)",
            name,
            mine["correct"],
            mine["total"],
            parent["correct"],
            parent["total"],
        )
        stage = Stage(
            name=name,
            data="instruction check",
            kind="instructions",
            metrics={
                "score": mine["score"],
                "correct": mine["correct"],
                "total": mine["total"],
                "parent_score": parent["score"],
                "parent_correct": parent["correct"],
            },
            details={"answers": mine["answers"], "parent_answers": parent["answers"]},
        )
        return patient.with_stage(stage)
