"""ifeval: instruction following on IFEval's prompts (Zhou et al. 2023; data CC BY 4.0), for the
patient and its parent, greedy through the engine, scored by Google's checks (if-verifiable)."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ParamError
from ..measure.ifeval import HUB_DATASET, IfevalPrompt, load_prompts, run_ifeval
from ..recipe.patient import Patient, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..text import resolve_files
from ..vision.graft import language_model

log = logging.getLogger(__name__)


class IfevalParams(BaseModel):
    """`data`: IFEval's input_data.jsonl (relative to the recipe; default: google/IFEval through
    `datasets`); `limit`: its first N prompts (a fixed subset, stated in the card); `max_tokens`:
    the longest answer."""

    model_config = ConfigDict(extra="forbid")

    data: str | None = None
    limit: int | None = Field(None, gt=0)
    max_tokens: int = Field(512, gt=0, le=4096)
    dtype: Literal["float32", "bfloat16"] = "float32"
    name: str | None = None


@register
class Ifeval(Operation):
    name = "ifeval"
    Params = IfevalParams
    summary = "IFEval: prompt- and instruction-level accuracy, strict and loose; patient and parent"
    measures = True
    accepts_vlm = True  # it answers through the language model

    def plan(self, params: IfevalParams, state: ModelState, ctx: StepContext):
        name = ctx.stage_name(params.name)
        if params.data is None:  # plan reads no network: the Hub's copy is fetched when the step runs
            count = f"the first {params.limit}" if params.limit else "all"
            return state, f"{name}: {count} IFEval prompts from {HUB_DATASET} (fetched by `datasets` at run time)"
        prompts = _prompts(params, ctx)
        ctx.facts["prompts"] = prompts
        return state, f"{name}: {len(prompts)} IFEval prompts from {params.data}"

    def apply(self, params: IfevalParams, patient: Patient, ctx: StepContext) -> Patient:
        prompts = ctx.facts.get("prompts") or _prompts(params, ctx)
        args = (prompts, params.max_tokens, params.dtype)
        parent = run_ifeval(patient.parent, patient.tokenizer, patient.base.fingerprint(), *args)
        mine = run_ifeval(language_model(patient.model), patient.tokenizer, patient.fingerprint(), *args)
        name = ctx.stage_name(params.name)
        m, p = mine["metrics"], parent["metrics"]
        log.info("%s: IFEval %.3f (parent %.3f) over %d prompts", name, m["ifeval"], p["ifeval"], m["prompts"])
        stage = Stage(
            name=name,
            data=f"IFEval, {'the first' if params.limit else 'all'} {len(prompts)} prompts",
            kind="ifeval",
            metrics={
                **m,
                **{f"parent_{k}": v for k, v in p.items() if k in ("ifeval", "prompt_strict", "inst_strict")},
                "max_tokens": params.max_tokens,
                "generation_seconds": mine["generation"]["seconds"],
            },
            details={"sentence_splitter": mine["punkt"], "dtype": params.dtype},
        )
        return patient.with_stage(stage)


def _prompts(params: IfevalParams, ctx: StepContext) -> list[IfevalPrompt]:
    if params.data is None:
        return load_prompts(None, params.limit)
    paths = resolve_files(params.data, ctx.recipe_dir, "data")
    if len(paths) != 1:
        raise ParamError(("data",), f"{params.data!r} names {len(paths)} files; IFEval's data is one jsonl file")
    return load_prompts(paths[0], params.limit)
