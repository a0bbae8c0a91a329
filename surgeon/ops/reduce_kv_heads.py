"""reduce_kv_heads: MHA -> GQA, GQA -> fewer groups, or -> MQA, as a (config, state dict) rewrite.

The result is the standard architecture with a smaller `num_key_value_heads` (the KV cache shrinks
by the same factor), loadable by plain transformers. The math is in surgeon/surgery/ (kv_heads.py per
group, kv_merge.py per model); with calibration text the step also reports how closely each init
reproduces the parent's keys and values there; with `compare` text it measures every init against
the parent (a stage each in the model card), and `init: best` keeps the one that starts closest.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import families
from ..errors import ParamError
from ..measure.metrics import compare_to_parent, parent_reference
from ..recipe.patient import Patient, Provenance, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery import architecture
from ..surgery.attention_fit import capture_attention, fit_attention
from ..surgery.kv_heads import INITS
from ..surgery.kv_merge import attention_input_covariance, kv_head_similarity, merge_kv_heads, svd_merge_loss
from ..text import TextData, describe_files

log = logging.getLogger(__name__)


class AttentionFit(BaseModel):
    """Layer-local fit after the init (surgeon/surgery/attention_fit.py): `steps` Adam steps per layer on
    batches of `batch` calibration windows."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(4, gt=0)


class ReduceKVHeadsParams(BaseModel):
    """`calibration`: text whose activations the svd init is fitted to; `compare`: text on which every
    init is measured against the parent before any healing; `init: best` keeps the lowest kl_mean there."""

    model_config = ConfigDict(extra="forbid")

    kv_heads: int = Field(gt=0)
    init: Literal["mean", "first", "svd", "best"] = "mean"
    calibration: TextData | None = None
    compare: TextData | None = None
    fit: AttentionFit | None = None

    @model_validator(mode="after")
    def _needs_data(self):
        if self.init in ("svd", "best") and self.calibration is None:
            raise ValueError(f"init {self.init} needs the svd fit to activations: give `calibration` text")
        if self.fit is not None and self.calibration is None:
            raise ValueError("fit trains each layer's attention on activations: give `calibration` text")
        if self.init == "best" and self.compare is None:
            raise ValueError("init best picks the init closest to the parent: give `compare` text to measure on")
        return self


@register
class ReduceKVHeads(Operation):
    name = "reduce_kv_heads"
    Params = ReduceKVHeadsParams
    summary = "fewer KV heads (GQA / MQA): merge each group of KV heads into one (mean, first, svd)"

    def plan(self, params: ReduceKVHeadsParams, state: ModelState, ctx: StepContext):
        config = state.config
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if params.kv_heads > kv or kv % params.kv_heads:
            raise ParamError(
                ("kv_heads",),
                f"{params.kv_heads} KV heads: must divide the current {kv} "
                f"(each new head merges a whole group of old ones)",
            )
        for field in ("calibration", "compare"):
            if (data := getattr(params, field)) is not None:
                ctx.resolve_text(field, data, (field,))
        new = config.__class__.from_dict({**config.to_dict(), "num_key_value_heads": params.kv_heads})
        keys = "mean keys (q/k norm)" if params.init == "svd" and families.has_qk_norm(config.model_type) else ""
        note = (
            f"{kv} -> {params.kv_heads} KV heads ({heads} query heads; KV cache x{params.kv_heads / kv:.2f}), "
            f"init {params.init}{', ' + keys if keys else ''}"
        )
        return ModelState(new, state.dtype), note

    def apply(self, params: ReduceKVHeadsParams, patient: Patient, ctx: StepContext) -> Patient:
        model = patient.model
        config = model.config
        sigmas = files = windows = None
        if params.calibration is not None:
            files, windows = ctx.text_windows("calibration", params.calibration, patient.tokenizer)
            sigmas = attention_input_covariance(model, windows)
        new_config = config.__class__.from_dict({**config.to_dict(), "num_key_value_heads": params.kv_heads})

        def build(init: str):
            state, errors = merge_kv_heads(model, params.kv_heads, init, sigmas)
            return architecture.assemble(new_config, state, model.generation_config), errors

        # What the card's KV plot shows (as surgeon analyze draws it): how alike each layer's heads
        # are, and the energy the svd merge to this many heads loses, on the calibration text.
        similarity = merge_loss = None
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if sigmas is not None and kv > 1:
            similarity = kv_head_similarity(model, sigmas)
            merge_loss = {str(params.kv_heads): svd_merge_loss(model, sigmas, params.kv_heads)}
        stages, measured = self._compare_inits(params, patient, ctx, build, with_svd=sigmas is not None)
        init = min(measured, key=lambda n: measured[n]["kl_mean"]) if params.init == "best" else params.init
        reduced, errors = build(init)
        fitted = None
        if params.fit is not None:
            captured = capture_attention(model, windows)
            fitted = fit_attention(reduced, captured, params.fit.steps, params.fit.lr, params.fit.batch)
            del captured
        per_token = 2 * config.num_hidden_layers * architecture.head_dim(config) * model.dtype.itemsize
        entry = Provenance(
            op=self.name,
            what=f"merged {kv} KV heads into {params.kv_heads} per layer (init {init}{', fitted' if fitted else ''})",
            why=_why(params, kv, per_token, errors, files, fitted, measured, init),
            params={
                "kv_heads": params.kv_heads,
                "init": params.init,
                "fit": params.fit.model_dump() if params.fit else None,
            },
            before=patient.shape().as_dict(),
            after=architecture.shape_of(new_config, model.dtype).as_dict(),
            details={
                "relative_error": errors,
                "init": init,
                "compare": measured,
                "fit": fitted,
                "kv_cache_bytes_per_token": {"before": per_token * kv, "after": per_token * params.kv_heads},
                "kv_head_similarity": similarity,
                "kv_merge_energy_lost": merge_loss,
            },
        )
        result = patient.with_model(reduced, entry)
        for stage in stages:
            result = result.with_stage(stage)
        return result

    def _compare_inits(self, params, patient: Patient, ctx: StepContext, build, with_svd: bool):
        """With `compare` text: every init measured against the parent (a stage each), else nothing."""
        if params.compare is None:
            return [], {}
        stages, measured = [], {}
        compare_files, compare_windows = ctx.text_windows("compare", params.compare, patient.tokenizer)
        reference = parent_reference(lambda: patient.parent, compare_windows, patient.base.fingerprint())
        for name in [name for name in INITS if name != "svd" or with_svd]:
            candidate, _ = build(name)
            measured[name] = compare_to_parent(candidate, compare_windows, reference)
            stages.append(
                Stage(name=f"{self.name} init {name}", data=describe_files(compare_files), metrics=measured[name])
            )
            log.info(
                "init %s: kl_mean %.4f, top-1 %.3f, ppl %.2f",
                name,
                measured[name]["kl_mean"],
                measured[name]["top1_agreement"],
                measured[name]["ppl"],
            )
            del candidate
        return stages, measured


def _why(
    params: ReduceKVHeadsParams, kv: int, per_token: int, errors: dict, files, fitted, measured: dict, init: str
) -> str:
    """The provenance entry's reason: the cache saving, then what each measurement said."""
    smaller = f"{per_token * kv:,} -> {per_token * params.kv_heads:,} bytes per token"
    why = f"a KV cache {kv // params.kv_heads}x smaller ({smaller})"
    if errors:
        summary = ", ".join(f"{name} K {e['k']:.3f} V {e['v']:.3f}" for name, e in errors.items())
        why += f"; relative error of the merged keys/values on {describe_files(files)}: {summary}"
    if fitted:
        before, after = (sum(f[key] for f in fitted) / len(fitted) for key in ("before", "after"))
        why += (
            f"; then each layer's attention fitted to the parent's ({params.fit.steps} steps): relative error of "
            f"its output {before:.3f} -> {after:.3f} (mean over layers)"
        )
    if measured:
        summary = ", ".join(f"{name} {m['kl_mean']:.3f}" for name, m in measured.items())
        why += f"; kl_mean to the parent before healing: {summary}"
        if params.init == "best":
            why += f" (kept {init})"
    return why
