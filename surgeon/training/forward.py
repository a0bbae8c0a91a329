"""Teacher and student forward passes for distillation, sharing what the two have in common.

After a layer drop the student's first layers *are* the teacher's (same tensors, frozen), so
their activations are equal too: the teacher computes them once and the student starts at its
first trainable layer from the teacher's hidden state there. Below that layer nothing trains, so
nothing needs gradients: the saving is the whole forward of the frozen prefix, on every step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..surgery.capture import feeding, on_input, on_output


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers


def shared_prefix_length(student, teacher, first_trainable: int | None) -> int:
    """How many of the student's first layers (and its embeddings) are the teacher's own tensors."""
    if not first_trainable:
        return 0
    if student.get_input_embeddings().weight.data_ptr() != teacher.get_input_embeddings().weight.data_ptr():
        return 0
    s_layers, t_layers = decoder_layers(student), decoder_layers(teacher)
    s_types = getattr(student.config, "layer_types", None)
    t_types = getattr(teacher.config, "layer_types", None)
    shared = 0
    for index in range(min(first_trainable, len(t_layers))):
        s_params = [p.data_ptr() for p in s_layers[index].parameters()]
        t_params = [p.data_ptr() for p in t_layers[index].parameters()]
        same_type = s_types is None or t_types is None or s_types[index] == t_types[index]
        if s_params != t_params or not same_type:
            break
        shared = index + 1
    return shared


@dataclass
class TeacherOutput:
    final_hidden: torch.Tensor  # [B, T, H] after the final norm
    boundary: torch.Tensor | None  # hidden state entering layer `prefix` (what the student starts from)
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)


@torch.inference_mode()
def teacher_forward(teacher, ids: torch.Tensor, prefix: int, capture: list[int]) -> TeacherOutput:
    layers = decoder_layers(teacher)
    taken: dict = {}
    store = lambda key, hidden, *_: taken.__setitem__(key, hidden)
    entry = {"boundary": layers[prefix]} if prefix else {}
    with on_input(entry, store), on_output({index: layers[index] for index in capture}, store):
        final = teacher.base_model(input_ids=ids, use_cache=False).last_hidden_state
    # Inference tensors cannot be saved for backward; the student's graph starts from copies.
    boundary = taken["boundary"].clone() if prefix else None
    return TeacherOutput(final, boundary, {i: taken[i] for i in capture})


class StudentBody(torch.nn.Module):
    """The student up to its final norm (what the fused loss needs), as one module so that
    accelerate / DDP can wrap it; the LM head is applied inside the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, start_hidden=None, prefix: int = 0, capture: tuple[int, ...] = ()):
        layers = decoder_layers(self.model)
        outputs: dict[int, torch.Tensor] = {}
        with on_output({i: layers[i] for i in capture}, outputs.__setitem__), _start_at(layers, prefix, start_hidden):
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            hidden = base.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return hidden, outputs


@contextmanager
def _start_at(layers, prefix: int, start_hidden):
    """Skip layers[:prefix] and feed `start_hidden` into layers[prefix] (no-op when prefix is 0).

    The model still computes its embeddings, rotary tables and masks as usual (cheap, and always
    right for its family); only the skipped layers' work is replaced.
    """
    if not prefix:
        yield
        return
    for layer in layers[:prefix]:
        layer.forward = _identity
    try:
        with feeding(layers[prefix], start_hidden):
            yield
    finally:
        for layer in layers[:prefix]:
            del layer.forward


def _identity(hidden_states, *_args, **_kwargs):
    return hidden_states


def head_weight(model) -> torch.Tensor:
    return model.get_output_embeddings().weight


def logit_softcap(model) -> float | None:
    return getattr(model.config, "final_logit_softcapping", None)
