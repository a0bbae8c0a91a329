"""quantize: weight-only int8 / int4 for the decoder's linear layers, by round-to-nearest or GPTQ.

The patient keeps float weights holding exactly the quantized values (so every later step, the
engine and the KL evaluations see what the integers say), and remembers the integers, scales and
zero points, which the export writes as compressed-tensors (the format llm-compressor writes and
transformers and vLLM load). With `compare` text, each listed format is measured against the
parent first, a stage each in the model card, so the card shows what each grid costs.

A trap worth knowing: a model that came from a GGUF file is already on that file's grid (the
embedded SmolLM2 is a dequantized Q4_1: blocks of 32, a scale and a minimum each). A 4-bit format
with the same blocks lands back on the same values and looks almost free; per-channel int8,
groups of 64/128 and symmetric blocks measure what quantizing really costs.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import families
from ..errors import ParamError
from ..measure.metrics import compare_to_parent, parent_reference
from ..recipe.patient import Patient, Provenance, Quantization, Stage
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery import architecture
from ..surgery.quantize import (
    QuantFormat,
    input_hessians,
    linear_inputs,
    output_error,
    quantize_gptq,
    quantize_rtn,
)
from ..surgery.selection import select, unmatched_patterns
from ..text import TextData, describe_files

log = logging.getLogger(__name__)

DEFAULT_MODULES = ["model.layers.*"]


class FormatSpec(BaseModel):
    """`bits` 8 or 4; `group_size` null for one scale per output channel; `method` rtn (round to
    nearest) or gptq (needs the step's `calibration` text); `search`: each group's range shrunk to
    what rounds its weights with the least squared error (false: plain min-max)."""

    model_config = ConfigDict(extra="forbid")

    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128] | None = 64
    symmetric: bool = True
    method: Literal["rtn", "gptq"] = "gptq"
    search: bool = True

    def format(self) -> QuantFormat:
        return QuantFormat(self.bits, self.group_size, self.symmetric)

    @property
    def label(self) -> str:
        return f"{self.format().label} {self.method}{'' if self.search else ' minmax'}"


class CompareSpec(BaseModel):
    """Measure each of `formats` against the parent on `data` before quantizing (a stage each)."""

    model_config = ConfigDict(extra="forbid")

    data: TextData
    formats: list[FormatSpec] = Field(min_length=1)


class QuantizeParams(FormatSpec):
    """The format the model is exported in (symmetric: see the validator). `modules`: globs over the
    Linear layers' names (default every decoder layer's); `lm_head`:
    quantize the output head too (a tied head gets its own copy, the embeddings stay as they are);
    `calibration`: text whose activations GPTQ fits to; `damp`: GPTQ's dampening, a fraction of the
    Hessian's mean diagonal."""

    modules: list[str] = Field(default_factory=lambda: list(DEFAULT_MODULES), min_length=1)
    lm_head: bool = False
    calibration: TextData | None = None
    damp: float = Field(0.01, gt=0, le=1)
    compare: CompareSpec | None = None

    @model_validator(mode="after")
    def _needs_calibration(self):
        uses_gptq = self.method == "gptq" or any(
            f.method == "gptq" for f in (self.compare.formats if self.compare else [])
        )
        if uses_gptq and self.calibration is None:
            raise ValueError("gptq fits the rounding to activations: give `calibration` text (or method: rtn)")
        if not self.symmetric:
            # transformers 5 loads compressed-tensors' packed zero points into unpacked parameters
            # and refuses the checkpoint; asymmetric formats can still be measured under `compare`.
            raise ValueError(
                "the export (compressed-tensors) loads in transformers only for symmetric formats: "
                "set symmetric: true (asymmetric formats may be measured under `compare`)"
            )
        return self


def _targets(names: list[str], params: QuantizeParams) -> list[str]:
    chosen = [name for name in select(names, params.modules) if name != "lm_head"]
    return chosen + (["lm_head"] if params.lm_head and "lm_head" in names else [])


@register
class Quantize(Operation):
    name = "quantize"
    Params = QuantizeParams
    summary = (
        "weight-only int8 / int4 (per channel or in groups; round-to-nearest or GPTQ), exported as compressed-tensors"
    )

    def plan(self, params: QuantizeParams, state: ModelState, ctx: StepContext):
        config = state.config
        row = families.family(config.model_type)
        if row is None or row.role != "lm" or not row.surgery:
            raise ParamError(
                (),
                f"quantize writes compressed-tensors, which needs a standard transformers decoder; "
                f"'{config.model_type}' is not one (quantize before sparse_attention or graft_vision)",
            )
        widths = linear_inputs(architecture.meta_model(config))
        names = list(widths)
        missing = unmatched_patterns([n for n in names if n != "lm_head"], params.modules)
        if missing:
            raise ParamError(("modules",), f"{', '.join(missing)} match no Linear layer (e.g. {names[0]})")
        targets = _targets(names, params)
        specs = [((), params)] + [
            (("compare", "formats", i), f) for i, f in enumerate(params.compare.formats if params.compare else [])
        ]
        for path, spec in specs:
            for name in targets:
                if spec.group_size and widths[name] % spec.group_size:
                    raise ParamError(
                        (*path, "group_size"), f"{name} has {widths[name]} inputs, not a multiple of {spec.group_size}"
                    )
        if params.calibration is not None:
            ctx.resolve_text("calibration", params.calibration, ("calibration",))
        if params.compare is not None:
            ctx.resolve_text("compare", params.compare.data, ("compare", "data"))
        note = f"{params.label} on {len(targets)} Linear layers"
        if params.compare:
            note += f"; {len(params.compare.formats)} formats compared first"
        return state, note

    def apply(self, params: QuantizeParams, patient: Patient, ctx: StepContext) -> Patient:
        model = patient.model
        targets = _targets(list(linear_inputs(model)), params)
        hessians = calibration_files = None
        started = time.perf_counter()
        if params.calibration is not None:
            calibration_files, windows = ctx.text_windows("calibration", params.calibration, patient.tokenizer)
            hessians = input_hessians(model, targets, windows)
        calibration_s = time.perf_counter() - started
        stages, measured = self._compare(params, patient, ctx, targets, hessians)
        started = time.perf_counter()
        quantized, errors = quantize_linears(model, targets, params, hessians, params.damp)
        quantize_s = time.perf_counter() - started
        child = fake_quantized(model, quantized)
        mean_error = sum(errors.values()) / len(errors) if errors else None
        stored = sum(q.q.numel() * params.bits / 8 + q.scale.numel() * 2 + q.zero.numel() for q in quantized.values())
        original = sum(model.get_submodule(name).weight.numel() * 4 for name in targets)
        log.info(
            "quantized %d Linear layers to %s in %.1f s (calibration %.1f s)%s",
            len(targets),
            params.label,
            quantize_s,
            calibration_s,
            f"; relative output error {mean_error:.4f}" if mean_error is not None else "",
        )
        why = f"{params.label}: the quantized layers read {original / stored:.1f}x fewer bytes than fp32"
        if mean_error is not None:
            why += (
                f"; relative error of the layers' outputs on {describe_files(calibration_files)}: "
                f"{mean_error:.4f} (mean over layers)"
            )
        if measured:
            why += "; kl_mean to the parent by format: " + ", ".join(
                f"{k} {v['kl_mean']:.4f}" for k, v in measured.items()
            )
        entry = Provenance(
            op=self.name,
            what=f"{len(targets)} Linear layers quantized to {params.label}",
            why=why,
            params=params.model_dump(mode="json", exclude={"compare", "calibration"}),
            before=patient.shape().as_dict(),
            after=patient.shape().as_dict(),
            details={
                "format": params.label,
                "modules": targets,
                "output_error": errors,
                "compare": measured,
                "seconds": {"calibration": round(calibration_s, 1), "quantize": round(quantize_s, 1)},
                "weight_bytes": {"fp32": original, "quantized": int(stored)},
            },
        )
        result = patient.with_model(child, entry, patient.layer_origin())
        result = result.with_quantization(Quantization(params.format(), params.method, quantized))
        for stage in stages:
            result = result.with_stage(stage)
        return result

    def _compare(self, params: QuantizeParams, patient: Patient, ctx: StepContext, targets, hessians):
        if params.compare is None:
            return [], {}
        files, windows = ctx.text_windows("compare", params.compare.data, patient.tokenizer)
        reference = parent_reference(lambda: patient.parent, windows, patient.base.fingerprint())
        stages, measured = [], {}
        for spec in params.compare.formats:
            quantized, _ = quantize_linears(patient.model, targets, spec, hessians, params.damp)
            candidate = fake_quantized(patient.model, quantized)
            measured[spec.label] = metrics = compare_to_parent(candidate, windows, reference)
            stages.append(Stage(name=f"{self.name} {spec.label}", data=describe_files(files), metrics=metrics))
            log.info(
                "%s: kl_mean %.5f, top-1 %.4f, ppl %.3f",
                spec.label,
                metrics["kl_mean"],
                metrics["top1_agreement"],
                metrics["ppl"],
            )
            del candidate, quantized
        return stages, measured


def quantize_linears(model, targets: list[str], spec: FormatSpec, hessians, damp: float):
    """{name: QuantizedWeight} for `targets`, and GPTQ's relative output error per layer (when it
    has Hessians)."""
    fmt = spec.format()
    quantized, errors = {}, {}
    for name in targets:
        weight = model.get_submodule(name).weight.detach().float()
        if spec.method == "gptq":
            quantized[name] = quantize_gptq(weight, hessians[name], fmt, damp, search=spec.search)
        else:
            quantized[name] = quantize_rtn(weight, fmt, spec.search)
        if hessians is not None:
            errors[name] = output_error(weight, quantized[name].dequantize(), hessians[name])
    return quantized, errors


def fake_quantized(model, quantized: dict) -> torch.nn.Module:
    """A copy of `model` whose quantized Linears hold the dequantized values (other tensors are
    shared, not copied). A quantized head tied to the embeddings is untied: the embeddings stay."""
    child = copy.copy(model)
    child.config = copy.deepcopy(model.config)
    replaced = {}
    for name, module in model.named_modules():
        if name in quantized:
            clone = copy.copy(module)
            clone._parameters = dict(module._parameters)
            clone.weight = torch.nn.Parameter(quantized[name].dequantize(module.weight.dtype), requires_grad=False)
            replaced[name] = clone
    _rebuild(child, model, replaced)
    if "lm_head" in quantized:
        child.config.tie_word_embeddings = False
        if hasattr(child.config, "get_text_config"):
            child.config.get_text_config().tie_word_embeddings = False
    return child


def _rebuild(child: torch.nn.Module, original: torch.nn.Module, replaced: dict, prefix: str = "") -> None:
    """Shallow-copy the module tree down to each replaced module, so `original` is left untouched."""
    child._modules = dict(original._modules)
    for name, sub in original._modules.items():
        full = f"{prefix}{name}"
        if full in replaced:
            child._modules[name] = replaced[full]
        elif any(key.startswith(full + ".") for key in replaced):
            copied = copy.copy(sub)
            _rebuild(copied, sub, replaced, full + ".")
            child._modules[name] = copied
