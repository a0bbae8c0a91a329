"""sparse_attention: dense attention -> DeepSeek-style sparse attention (lightning indexer + top-k).

Adds a freshly initialised indexer to each chosen layer (the parent's weights are untouched), then,
with `warmup`, trains the indexers alone to predict where the dense layers attend (DeepSeek-V3.2's
first stage). With `recall` text it reports, per layer, how much of the dense attention mass the
top-k selection keeps, before and after the warm-up. The second stage is a `heal` step after this
one: the LM distilled from the dense parent with selection on, the indexers still learning.
The result is surgeon's sparse Llama class (surgeon/modeling/sparse_llama.py), exported with its code.
"""

from __future__ import annotations

import logging

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import families
from ..errors import ParamError
from ..measure.metrics import windows_digest
from ..modeling.sparse_attention import SparseSettings, attention_flops
from ..modeling.sparse_llama import SurgeonSparseLlamaConfig
from ..recipe.layer_spec import LayerList, expand_layers, format_ranges
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery import architecture
from ..text import TextData, describe_files
from ..training.indexer import WarmupSpec, cache_bytes, measure_recall, warm_up

log = logging.getLogger(__name__)

FLOP_LENGTHS = (512, 2048, 8192)


class SparseAttentionParams(BaseModel):
    """`top_k` keys per query, of which the first `sinks` tokens and the last `window` (the query
    itself included) are always kept; an indexer of `index_heads` x `index_dim` with rotary on
    `rope_dim` of them; `layers` (default all)."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(64, gt=0)
    layers: LayerList | None = None
    index_heads: int = Field(4, gt=0)
    index_dim: int = Field(32, gt=0)
    rope_dim: int = Field(16, ge=0)
    sinks: int = Field(4, ge=0)
    window: int = Field(16, ge=1)
    seed: int = 0
    warmup: WarmupSpec | None = None
    recall: TextData | None = None

    @model_validator(mode="after")
    def _shapes(self):
        if self.rope_dim % 2 or self.rope_dim > self.index_dim:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and at most index_dim {self.index_dim}")
        if self.sinks + self.window > self.top_k:
            raise ValueError(
                f"sinks {self.sinks} + window {self.window} exceed top_k {self.top_k}: "
                "the always-kept keys count inside the k"
            )
        return self


@register
class SparsifyAttention(Operation):
    name = "sparse_attention"
    Params = SparseAttentionParams
    summary = "DeepSeek-style sparse attention: a lightning indexer picks each query's top-k keys"

    def plan(self, params: SparseAttentionParams, state: ModelState, ctx: StepContext):
        config = state.config
        if config.model_type == SurgeonSparseLlamaConfig.model_type:
            raise ParamError((), "the model already has sparse attention")
        if not families.is_sparse_base(config.model_type):
            raise ParamError(
                (),
                f"sparse attention is built for Llama-architecture models "
                f"({', '.join(families.sparse_base_types())}: SmolLM2, Llama); "
                f"this model is {config.model_type!r}",
            )
        layers = expand_layers(params.layers, config.num_hidden_layers, ("layers",)) if params.layers else None
        if params.recall is not None:
            ctx.resolve_text("recall", params.recall, ("recall",))
        new = sparse_config(config, params, layers)
        n_layers = len(new.sparse_layers())
        if params.warmup is not None:
            ctx.resolve_text("warmup", params.warmup.data, ("warmup", "data"))
            cache = _check_cache(params.warmup, n_layers, config.hidden_size)
        saved = ", ".join(
            f"{n // 1024}K {1 - ratio:.0%}" if n >= 1024 else f"{n} {1 - ratio:.0%}"
            for n, ratio in flop_ratios(new).items()
        )
        note = (
            f"top-{params.top_k} keys on {n_layers} layers (sinks {params.sinks}, window {params.window}); "
            f"indexer {params.index_heads}x{params.index_dim}; attention FLOPs saved: {saved}"
        )
        if params.warmup is not None:
            note += f"; indexer warm-up {params.warmup.steps} steps on {cache / 2**30:.3g} GB of cached dense states"
        return ModelState(new, state.dtype), note

    def apply(self, params: SparseAttentionParams, patient: Patient, ctx: StepContext) -> Patient:
        model = patient.model
        layers = expand_layers(params.layers, model.config.num_hidden_layers, ("layers",)) if params.layers else None
        config = sparse_config(model.config, params, layers)
        tensors = dict(model.state_dict())
        generator = torch.Generator().manual_seed(params.seed)
        for index in config.sparse_layers():
            for name, tensor in indexer_init(config, generator).items():
                tensors[f"model.layers.{index}.self_attn.indexer.{name}"] = tensor.to(model.dtype)
        sparse = architecture.assemble(config, tensors, model.generation_config)

        details: dict = {"flops": {str(n): {"dense": d, "sparse": s} for n, (d, s) in flop_counts(config).items()}}
        recall_windows = None
        if params.recall is not None:
            files, recall_windows = ctx.text_windows("recall", params.recall, patient.tokenizer)
            details["recall_data"] = describe_files(files)
            details["recall_at_init"] = _rounded(measure_recall(sparse, recall_windows))
        if params.warmup is not None:
            spec = params.warmup
            files, windows = ctx.text_windows("warmup", spec.data, patient.tokenizer)
            held = min(spec.heldout_windows, max(0, windows.shape[0] - 1))
            train_ids, heldout_ids = windows[: windows.shape[0] - held], windows[windows.shape[0] - held :]
            digest = ctx.run_digest(windows_digest(windows), "warmup")
            with ctx.checkpoint_dir("indexer") as checkpoints:
                result = warm_up(
                    sparse,
                    train_ids,
                    heldout_ids,
                    spec,
                    checkpoint_dir=checkpoints,
                    resume=ctx.resume,
                    run_digest=digest,
                )
            details["warmup"] = {
                "training": result.summary(),
                "curve": result.curve,
                "heldout": result.evals,
                "data": describe_files(files),
            }
        if recall_windows is not None and params.warmup is not None:
            details["recall"] = _rounded(measure_recall(sparse, recall_windows))

        saved = ", ".join(f"{n}: {1 - ratio:.0%}" for n, ratio in flop_ratios(config).items())
        why = f"attention reads at most {params.top_k} keys per query; attention FLOPs saved at {saved} tokens"
        if recall_windows is not None:
            final = _mean(details.get("recall", details["recall_at_init"]))
            why += (
                f"; the top-{params.top_k} selection keeps {final:.1%} of the dense attention mass"
                f" on {details['recall_data']}"
            )
            if "recall" in details:
                why += f" (mean over layers; {_mean(details['recall_at_init']):.1%} with the untrained indexers)"
        entry = Provenance(
            op=self.name,
            what=(
                f"sparse attention on layers {format_ranges(config.sparse_layers())}: top-{params.top_k} keys "
                f"(sinks {params.sinks}, window {params.window}) chosen by a {params.index_heads}x{params.index_dim} "
                f"lightning indexer{', warmed up' if params.warmup else ''}"
            ),
            why=why,
            params=params.model_dump(mode="json", exclude={"warmup", "recall"}),
            before=patient.shape().as_dict(),
            after=architecture.shape_of(config, model.dtype).as_dict(),
            details=details,
        )
        return patient.with_model(sparse, entry)


def _check_cache(spec: WarmupSpec, layers: int, hidden: int) -> int:
    """The warm-up cache's size in bytes (at most: the text may hold fewer windows), refused over budget."""
    data = spec.data
    windows = data.n_windows()
    needed = cache_bytes(layers, windows, data.window, hidden)
    if needed > spec.cache_gb * 2**30:
        raise ParamError(
            ("warmup", "cache_gb"),
            f"the warm-up caches the dense states of {windows} windows of {data.window} tokens on {layers} "
            f"layers: {needed / 2**30:.3g} GB, over cache_gb {spec.cache_gb:g}; lower data.tokens or raise cache_gb",
        )
    return needed


def sparse_config(config, params: SparseAttentionParams, layers: list[int] | None) -> SurgeonSparseLlamaConfig:
    spec = {
        "layers": layers,
        "top_k": params.top_k,
        "sinks": params.sinks,
        "window": params.window,
        "index_heads": params.index_heads,
        "index_dim": params.index_dim,
        "rope_dim": params.rope_dim,
    }
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "auto_map")}
    return SurgeonSparseLlamaConfig(sparse_attention=spec, **fields)


def indexer_init(config: SurgeonSparseLlamaConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One seeded indexer's tensors (LightningIndexer's names): small normal projections, identity norm."""
    spec, hidden = config.sparse_attention, config.hidden_size
    heads, dim = spec["index_heads"], spec["index_dim"]

    def normal(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, generator=generator) * hidden**-0.5

    return {
        "wq.weight": normal(heads * dim),
        "wk.weight": normal(dim),
        "weights_proj.weight": normal(heads),
        "k_norm.weight": torch.ones(dim),
        "k_norm.bias": torch.zeros(dim),
    }


def flop_counts(config: SurgeonSparseLlamaConfig) -> dict[int, tuple[int, int]]:
    """{length: (dense, sparse)} attention FLOPs of one sequence over all layers (dense ones count
    the same on both sides), indexers included."""
    spec = config.sparse_attention
    settings = SparseSettings(top_k=spec["top_k"], sinks=spec["sinks"], window=spec["window"])
    head_dim, heads, layers = architecture.head_dim(config), config.num_attention_heads, config.num_hidden_layers
    sparse = len(config.sparse_layers())
    return {
        n: (
            attention_flops(n, layers, heads, head_dim),
            attention_flops(n, layers - sparse, heads, head_dim)
            + attention_flops(n, sparse, heads, head_dim, settings, spec["index_heads"], spec["index_dim"]),
        )
        for n in FLOP_LENGTHS
    }


def flop_ratios(config) -> dict[int, float]:
    return {n: sparse / dense for n, (dense, sparse) in flop_counts(config).items()}


def _mean(recall: dict[int, float]) -> float:
    return sum(recall.values()) / len(recall)


def _rounded(recall: dict[int, float]) -> dict[int, float]:
    return {layer: round(value, 4) for layer, value in recall.items()}
