"""The object every operation receives and returns, with the log the model card is written from."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoints.sources import Source
from ..surgery.architecture import Shape, shape_of


@dataclass(frozen=True)
class Provenance:
    """One operation as the model card tells it: what was done, why, and the shapes around it."""

    op: str
    what: str
    why: str
    params: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """A measurement at one point of the recipe: KL to the parent (`kl`) or another `kind`."""

    name: str
    data: str
    metrics: dict[str, float]
    kind: str = "kl"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Quantization:
    """What a quantize step left: the format and, per Linear, its integers, scales and zeros (the
    model itself holds their dequantized values). The export writes these as compressed-tensors."""

    format: Any  # surgery.quantize.QuantFormat
    method: str
    weights: dict[str, Any]  # Linear name -> surgery.quantize.QuantizedWeight


@dataclass(frozen=True)
class Patient:
    """The model under surgery. Operations return a new Patient (dataclasses.replace), never edit one.

    `parent` is the unoperated base model; children share its tensors until something trains them,
    so keeping it costs no memory.
    """

    model: torch.nn.Module
    tokenizer: Any
    parent: torch.nn.Module
    base: Source
    provenance: tuple[Provenance, ...] = ()
    stages: tuple[Stage, ...] = ()
    origin: tuple[int | None, ...] | None = None  # per layer: the parent layer it came from (None: new)
    quantization: Quantization | None = None  # set by quantize; any later change of weights drops it

    @classmethod
    def from_source(cls, source: Source) -> Patient:
        model = source.load_model()
        for param in model.parameters():
            param.requires_grad_(False)  # surgery and evaluation need no gradients; healing opts in
        return cls(model=model, tokenizer=source.load_tokenizer(), parent=model, base=source)

    def fingerprint(self) -> str:
        """Identifies the current weights: the base's fingerprint plus what was done to it."""
        if not self.provenance:
            return self.base.fingerprint()
        done = json.dumps([(p.op, p.params) for p in self.provenance], sort_keys=True, default=str)
        return hashlib.sha256(f"{self.base.fingerprint()}|{done}".encode()).hexdigest()[:16]

    def shape(self) -> Shape:
        return shape_of(self.model.config, self.model.dtype)

    def layer_origin(self) -> list[int | None]:
        """For each current layer, the index of the parent layer it stands for."""
        if self.origin is None:
            return list(range(self.model.config.num_hidden_layers))
        return list(self.origin)

    def with_model(self, model: torch.nn.Module, entry: Provenance, origin: list[int | None] | None = None) -> Patient:
        return dataclasses.replace(
            self,
            model=model,
            provenance=self.provenance + (entry,),
            origin=tuple(origin) if origin is not None else self.origin,
            quantization=None,  # the new weights are no longer the quantized integers
        )

    def with_quantization(self, quantization: Quantization) -> Patient:
        return dataclasses.replace(self, quantization=quantization)

    def with_stage(self, stage: Stage) -> Patient:
        return dataclasses.replace(self, stages=self.stages + (stage,))
