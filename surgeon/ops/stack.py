"""stack: assemble the decoder from layer ranges of one or more same-shaped checkpoints.

Depth up-scaling and frankenmerges (mergekit's passthrough). Layers from named sources are read
tensor by tensor from their safetensors; every layer is cloned so a layer used twice shares no
storage in the export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from ..checkpoints.sources import Source
from ..errors import ParamError
from ..recipe.layer_spec import LayerList, expand_layers, format_ranges
from ..recipe.patient import Patient, Provenance
from ..recipe.step import BASE, PATIENT, ModelState, Operation, StepContext, register
from ..surgery import architecture


class Slice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = PATIENT
    layers: LayerList = Field(min_length=1)


class StackParams(BaseModel):
    """Build the decoder from layer ranges of one or more same-shaped models (depth up-scaling,
    frankenmerges). Embeddings, final norm and LM head (and the tokenizer) come from `embeddings`."""

    model_config = ConfigDict(extra="forbid")

    slices: list[Slice] = Field(min_length=1)
    embeddings: str = PATIENT


@register
class Stack(Operation):
    name = "stack"
    Params = StackParams
    summary = "assemble the decoder from layer ranges of one or more sources (passthrough)"

    def plan(self, params: StackParams, state: ModelState, ctx: StepContext):
        base_config = _planned_config(params.embeddings, state, ctx, ("embeddings",))
        picks = []
        for index, piece in enumerate(params.slices):
            path = ("slices", index)
            config = _planned_config(piece.source, state, ctx, path + ("source",))
            for field in architecture.LAYER_SHAPE_FIELDS:
                mine, theirs = getattr(config, field, None), getattr(base_config, field, None)
                if mine != theirs:
                    raise ParamError(
                        path + ("source",),
                        f"layers of '{piece.source}' cannot be combined with '{params.embeddings}': "
                        f"{field} is {mine} there and {theirs} here",
                    )
            layers = expand_layers(piece.layers, config.num_hidden_layers, path + ("layers",))
            _check_subset(ctx.sources.get(piece.source), layers, path + ("layers",))
            picks.extend((config, i) for i in layers)
        config = architecture.config_with_layers(base_config, picks)
        return ModelState(config, state.dtype), "stack " + " + ".join(_describe_slice(p) for p in params.slices)

    def apply(self, params: StackParams, patient: Patient, ctx: StepContext) -> Patient:
        donors: dict[str, _Donor] = {}

        def donor(name: str) -> _Donor:
            if name not in donors:
                donors[name] = _Donor.of(name, patient, ctx)
            return donors[name]

        picks, origin, tensors, parent_layer = [], [], {}, []
        patient_origin = patient.layer_origin()
        for piece in params.slices:
            source = donor(piece.source)
            for layer in expand_layers(piece.layers, source.config.num_hidden_layers, ()):
                new_index = len(picks)
                picks.append((source.config, layer))
                origin.append(f"{piece.source}:{layer}")
                if piece.source == PATIENT:
                    parent_layer.append(patient_origin[layer])
                else:  # the base's own layer index, or None for another checkpoint's layer
                    parent_layer.append(layer if piece.source == BASE else None)
                for suffix, tensor in source.layer_tensors(layer).items():
                    # Cloned: a layer used twice must not share storage in the export.
                    tensors[architecture.layer_tensor_name(new_index, suffix)] = tensor.clone()
        outer = donor(params.embeddings)
        tensors.update(outer.outer_tensors())
        config = architecture.config_with_layers(outer.config, picks)
        child = architecture.assemble(config, tensors, outer.generation_config)
        entry = Provenance(
            op=self.name,
            what=f"stacked {len(picks)} layers: " + " + ".join(_describe_slice(p) for p in params.slices),
            why="layer ranges named in the recipe (passthrough)",
            params={"layers": origin, "embeddings": params.embeddings},
            before=patient.shape().as_dict(),
            after=architecture.shape_of(child.config, child.dtype).as_dict(),
        )
        return dataclasses.replace(patient.with_model(child, entry, origin=parent_layer), tokenizer=outer.tokenizer())


@dataclass
class _Donor:
    """Layers and outer tensors (embeddings, final norm, head) of the patient, the base or a named
    source; a named source is read tensor by tensor from its safetensors, never built as a model."""

    config: object
    state: dict | None  # the live state dict, for in-memory models
    source: Source | None
    tokenizer: Callable
    generation_config: object

    @classmethod
    def of(cls, name: str, patient: Patient, ctx: StepContext) -> _Donor:
        if name in (PATIENT, BASE):
            model = patient.model if name == PATIENT else patient.parent
            return cls(model.config, model.state_dict(), None, lambda: patient.tokenizer, model.generation_config)
        source = ctx.sources[name]
        return cls(source.config, None, source, source.load_tokenizer, source.generation_config())

    def _read(self, names: list[str]) -> dict:
        if self.state is not None:
            return {n: self.state[n] for n in names}
        return self.source.load_tensors(names)

    def _names(self) -> list[str]:
        return list(self.state) if self.state is not None else list(self.source.tensor_shapes())

    def layer_tensors(self, layer: int) -> dict:
        prefix = architecture.layer_tensor_name(layer, "")
        names = [n for n in self._names() if n.startswith(prefix)]
        return {n[len(prefix) :]: t for n, t in self._read(names).items()}

    def outer_tensors(self) -> dict:
        return self._read([n for n in self._names() if architecture.split_layer_name(n) is None])


def _planned_config(name: str, state: ModelState, ctx: StepContext, path: tuple):
    if name == PATIENT:
        return state.config
    if name not in ctx.sources:
        raise ParamError(path, f"unknown source '{name}' (known: {', '.join([PATIENT, *ctx.sources])})")
    return ctx.sources[name].config


def _check_subset(source: Source | None, layers: list[int], path: tuple) -> None:
    """A subset source (modules: [...]) must contain every layer a slice takes from it."""
    if source is None or not source.modules or source.kind != "folder":
        return
    present = {split[0] for split in map(architecture.split_layer_name, source.tensor_shapes()) if split}
    missing = [i for i in layers if i not in present]
    if missing:
        raise ParamError(
            path,
            f"source '{source.label}' is limited to {list(source.modules)}, "
            f"which excludes layers {format_ranges(missing)}",
        )


def _describe_slice(piece: Slice) -> str:
    return f"{piece.source}[{', '.join(str(x) for x in piece.layers)}]"
