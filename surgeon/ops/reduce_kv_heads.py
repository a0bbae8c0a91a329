"""reduce_kv_heads: MHA -> GQA, GQA -> fewer groups, or -> MQA, as a (config, state dict) rewrite.

The result is the standard architecture with a smaller `num_key_value_heads` (the KV cache shrinks
by the same factor), loadable by plain transformers. The math is in surgeon/kv_heads.py; with
calibration text the step also reports how closely each init reproduces the parent's keys and
values there; with `compare` text it measures every init against the parent (a stage each in the
model card), and `init: best` keeps the one that starts closest.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm.auto import tqdm

from .. import architecture
from ..attention_fit import capture_attention, fit_attention
from ..data import TextData, describe_files
from ..errors import ParamError
from ..kv_heads import INITS, fold_into_output, fold_into_queries, merge_keys, merge_values, relative_error
from ..metrics import compare_to_parent, parent_reference
from ..patient import Patient, Provenance, Stage
from . import ModelState, Operation, StepContext, register

log = logging.getLogger(__name__)

# Families that normalise queries and keys per head: the key map cannot pass through the norm.
NORMED_KEYS = ("qwen3", "gemma3_text")


class AttentionFit(BaseModel):
    """Layer-local fit after the init (surgeon/attention_fit.py): `steps` Adam steps per layer on
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
            raise ParamError(("kv_heads",), f"{params.kv_heads} KV heads: must divide the current {kv} "
                             f"(each new head merges a whole group of old ones)")
        for field in ("calibration", "compare"):
            if (data := getattr(params, field)) is not None:
                ctx.resolve_text(field, data, (field,))
        new = config.__class__.from_dict({**config.to_dict(), "num_key_value_heads": params.kv_heads})
        keys = "mean keys (q/k norm)" if params.init == "svd" and config.model_type in NORMED_KEYS else ""
        note = (f"{kv} -> {params.kv_heads} KV heads ({heads} query heads; KV cache x{params.kv_heads / kv:.2f}), "
                f"init {params.init}{', ' + keys if keys else ''}")
        return ModelState(new, state.dtype), note

    def apply(self, params: ReduceKVHeadsParams, patient: Patient, ctx: StepContext) -> Patient:
        model = patient.model
        config = model.config
        sigmas = None
        files = None
        if params.calibration is not None:
            files, windows = ctx.text_windows("calibration", params.calibration, patient.tokenizer)
            sigmas = attention_input_covariance(model, windows)
        new_config = config.__class__.from_dict({**config.to_dict(), "num_key_value_heads": params.kv_heads})

        def build(init: str):
            state, errors = reduce_kv_heads(model, params.kv_heads, init, sigmas)
            return architecture.assemble(new_config, state, model.generation_config), errors

        stages, measured = [], {}
        if params.compare is not None:
            compare_files, compare_windows = ctx.text_windows("compare", params.compare, patient.tokenizer)
            reference = parent_reference(lambda: patient.parent, compare_windows, patient.base.fingerprint())
            candidates = [name for name in INITS if name != "svd" or sigmas is not None]
            for name in candidates:
                candidate, _ = build(name)
                measured[name] = compare_to_parent(candidate, compare_windows, reference)
                stages.append(Stage(name=f"{self.name} init {name}", data=describe_files(compare_files),
                                    metrics=measured[name]))
                log.info("init %s: kl_mean %.4f, top-1 %.3f, ppl %.2f", name, measured[name]["kl_mean"],
                         measured[name]["top1_agreement"], measured[name]["ppl"])
                del candidate
        init = min(measured, key=lambda n: measured[n]["kl_mean"]) if params.init == "best" else params.init
        reduced, errors = build(init)
        fitted = None
        if params.fit is not None:
            captured = capture_attention(model, windows)
            fitted = fit_attention(reduced, captured, params.fit.steps, params.fit.lr, params.fit.batch)
            del captured
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        hd = architecture.head_dim(config)
        per_token = 2 * config.num_hidden_layers * hd * model.dtype.itemsize
        why = f"a KV cache {kv // params.kv_heads}x smaller ({per_token * kv:,} -> {per_token * params.kv_heads:,} bytes per token)"
        if errors:
            summary = ", ".join(f"{name} K {e['k']:.3f} V {e['v']:.3f}" for name, e in errors.items())
            why += f"; relative error of the merged keys/values on {describe_files(files)}: {summary}"
        if fitted:
            before, after = (sum(f[key] for f in fitted) / len(fitted) for key in ("before", "after"))
            why += (f"; then each layer's attention fitted to the parent's ({params.fit.steps} steps): relative error of "
                    f"its output {before:.3f} -> {after:.3f} (mean over layers)")
        if measured:
            summary = ", ".join(f"{name} {m['kl_mean']:.3f}" for name, m in measured.items())
            why += f"; kl_mean to the parent before healing: {summary}"
            if params.init == "best":
                why += f" (kept {init})"
        entry = Provenance(
            op=self.name,
            what=f"merged {kv} KV heads into {params.kv_heads} per layer (init {init}{', fitted' if fitted else ''})",
            why=why,
            params={"kv_heads": params.kv_heads, "init": params.init,
                    "fit": params.fit.model_dump() if params.fit else None},
            before=patient.shape().as_dict(),
            after=architecture.shape_of(new_config, model.dtype).as_dict(),
            details={"relative_error": errors, "init": init, "compare": measured, "fit": fitted,
                     "kv_cache_bytes_per_token": {"before": per_token * kv, "after": per_token * params.kv_heads}},
        )
        result = patient.with_model(reduced, entry)
        for stage in stages:
            result = result.with_stage(stage)
        return result


@torch.inference_mode()
def attention_input_covariance(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, E[x x^T] (float64) of the input to the K/V projections, with a 1 appended to x
    (the bias column)."""
    layers = model.base_model.layers
    hidden = model.config.hidden_size
    sums = [torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for _ in layers]
    count = 0
    hooks = []
    for index, layer in enumerate(layers):
        def take(_module, args, index=index):
            x = args[0].reshape(-1, hidden).double()
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
            sums[index] += x.T @ x
        hooks.append(layer.self_attn.k_proj.register_forward_pre_hook(take))
    try:
        for row in tqdm(windows, desc="kv calibration", unit="window", leave=False):
            model.base_model(input_ids=row[None], use_cache=False)
            count += row.numel()
    finally:
        for hook in hooks:
            hook.remove()
    return [s / count for s in sums]


def reduce_kv_heads(model, target: int, init: str, sigmas: list[torch.Tensor] | None):
    """(new state dict, {init: {"k": error, "v": error}} when sigmas are given)."""
    config = model.config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = architecture.head_dim(config)
    r = kv // target
    per_kv = heads // kv  # query heads reading each old KV head
    normed = config.model_type in NORMED_KEYS
    state = dict(model.state_dict())
    totals = {name: {"k": [0.0, 0.0], "v": [0.0, 0.0]} for name in INITS} if sigmas is not None else {}
    for index, layer in enumerate(model.base_model.layers):
        attn = layer.self_attn
        sigma = sigmas[index] if sigmas is not None else None
        prefix = f"model.layers.{index}.self_attn"
        parts = {}
        for kind in ("k", "v"):
            proj = getattr(attn, f"{kind}_proj")
            weight = _with_bias(proj).double()  # [kv*hd, in+1]
            parts[kind] = (weight.split(hd), proj.bias is not None)
        q, o = _with_bias(attn.q_proj).double(), attn.o_proj.weight.double()
        new = {"k": [], "v": []}
        q_rows, o_cols = list(q.split(hd)), list(o.split(hd, dim=1))
        for group in range(target):
            members = list(range(group * r, (group + 1) * r))
            for kind in ("k", "v"):
                weights = [parts[kind][0][i] for i in members]
                sig = sigma if sigma is not None else torch.eye(weights[0].shape[1], dtype=torch.float64)
                merge_init = "mean" if init == "svd" and kind == "k" and normed else init
                merger = merge_keys if kind == "k" else merge_values
                merged = merger(weights, sig, merge_init)
                new[kind].append(merged.shared)
                for position, old in enumerate(members):
                    for h in range(old * per_kv, (old + 1) * per_kv):
                        if kind == "k":
                            q_rows[h] = fold_into_queries(q_rows[h], merged.maps[position])
                        else:
                            o_cols[h] = fold_into_output(o_cols[h], merged.maps[position])
                if sigma is not None:
                    for name in INITS:
                        name_for_kind = "mean" if name == "svd" and kind == "k" and normed else name
                        err, tot = relative_error(weights, merger(weights, sigma, name_for_kind), sigma)
                        totals[name][kind][0] += err
                        totals[name][kind][1] += tot
        dtype = attn.k_proj.weight.dtype
        for kind in ("k", "v"):
            rows = torch.cat(new[kind])
            state[f"{prefix}.{kind}_proj.weight"] = rows[:, :-1].to(dtype).contiguous()
            if parts[kind][1]:
                state[f"{prefix}.{kind}_proj.bias"] = rows[:, -1].to(dtype).contiguous()
        q_new = torch.cat(q_rows)
        state[f"{prefix}.q_proj.weight"] = q_new[:, :-1].to(dtype).contiguous()
        if attn.q_proj.bias is not None:
            state[f"{prefix}.q_proj.bias"] = q_new[:, -1].to(dtype).contiguous()
        state[f"{prefix}.o_proj.weight"] = torch.cat(o_cols, dim=1).to(dtype).contiguous()
    errors = {name: {kind: (e / t if t else 0.0) for kind, (e, t) in kinds.items()} for name, kinds in totals.items()}
    return state, errors


def _with_bias(linear: torch.nn.Linear) -> torch.Tensor:
    """[out, in + 1]: the weight with the bias (or zeros) as its last column."""
    bias = linear.bias if linear.bias is not None else torch.zeros(linear.out_features, dtype=linear.weight.dtype)
    return torch.cat([linear.weight, bias[:, None]], dim=1)
