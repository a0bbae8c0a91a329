"""evaluate_vision: ask a grafted VLM held-out image questions; exact-match accuracy per kind.

With `shuffled_control` the same questions are asked again about other examples' images: if the
answers come from the pixels, accuracy falls to the chance level (the commonest answer of each
kind), which the stage reports beside it.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ParamError
from ..recipe.patient import Patient, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..training.heal_data import IMAGE_KINDS, DataSource, check_sources
from ..vision.image_set import describe_source

log = logging.getLogger(__name__)


class EvaluateVisionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: list[DataSource] = Field(min_length=1)
    shuffled_control: bool = True
    max_new_tokens: int = Field(8, gt=0, le=256)
    batch_size: int = Field(16, gt=0)
    name: str | None = None


@register
class EvaluateVision(Operation):
    name = "evaluate_vision"
    Params = EvaluateVisionParams
    summary = "exact-match accuracy on held-out image questions, with a shuffled-image control"
    measures = True
    accepts_vlm = True

    def plan(self, params: EvaluateVisionParams, state: ModelState, ctx: StepContext):
        from ..vision.graft import is_vlm

        if not is_vlm(state):
            raise ParamError((), "the patient has no vision tower: put a graft_vision step before this one")
        for index, source in enumerate(params.data):
            if source.kind not in (*IMAGE_KINDS, "jsonl"):
                raise ParamError(("data", index), f"a {source.kind} source holds no image questions")
        ctx.facts["files"] = check_sources(params.data, ctx.recipe_dir, at=("data",))
        kinds = ", ".join(describe_source(s) for s in params.data)
        return state, f"{ctx.stage_name(params.name)}: {kinds}" + (
            " (+ shuffled images)" if params.shuffled_control else ""
        )

    def apply(self, params: EvaluateVisionParams, patient: Patient, ctx: StepContext) -> Patient:
        from ..vision.answers import greedy_answers, score, tower_outputs
        from ..vision.graft import processor_for
        from ..vision.image_set import encode_records, source_records

        files = ctx.facts.get("files", {})
        processor = processor_for(patient.model, patient.tokenizer)
        vlm = patient.model.eval()
        metrics, details = {}, {}
        for index, source in enumerate(params.data):
            records = source_records(source, files.get(index, []))
            examples = encode_records(records, processor)
            tower = tower_outputs(vlm, processor, examples)
            answers = greedy_answers(
                vlm, patient.tokenizer, examples, tower, batch=params.batch_size, max_new_tokens=params.max_new_tokens
            )
            label = _label(source)
            result = score(examples, answers)
            if params.shuffled_control:
                pairing = _same_image_count_derangement(examples)
                shuffled = greedy_answers(
                    vlm, patient.tokenizer, examples, tower, pairing, params.batch_size, params.max_new_tokens
                )
                control = score(examples, shuffled)
                result.update({f"shuffled_{k}": v for k, v in control.items() if k.startswith("accuracy")})
            metrics.update({f"{label}_{k}": v for k, v in result.items()})
            details[label] = [
                {"key": e.key, "kind": e.kind, "answer": e.answer, "said": a}
                for e, a in list(zip(examples, answers))[:50]
            ]
            log.info("%s: %s", label, ", ".join(f"{k} {v:.3f}" for k, v in result.items() if isinstance(v, float)))
        stage = Stage(
            name=ctx.stage_name(params.name),
            data=", ".join(describe_source(s) for s in params.data),
            metrics=metrics,
            kind="vision",
            details={"samples": details},
        )
        return patient.with_stage(stage)


def _same_image_count_derangement(examples) -> list[int]:
    """A derangement within each group of examples with the same number of images."""
    from collections import defaultdict

    from ..vision.answers import derangement

    groups = defaultdict(list)
    for i, e in enumerate(examples):
        groups[len(e.images)].append(i)
    pairing = list(range(len(examples)))
    for members in groups.values():
        for position, target in enumerate(derangement(len(members))):
            pairing[members[position]] = members[target]
    return pairing


def _label(source) -> str:
    """A source's name in the metrics: its kind, with the drawing style where scenes are not plain."""
    if source.kind == "synthetic" and source.synthetic.style != "plain":
        return f"synthetic_{source.synthetic.style}"
    return source.kind
