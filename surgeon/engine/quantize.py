"""Weight-only int8 and int4 for CPU decoding: a batch-1 decode step reads every weight once, so it
is bound by memory bandwidth; int8 weights read a quarter of fp32's bytes, int4 an eighth.

int8: per output channel symmetric scales (|q| <= 127), PyTorch's own int8-weight kernel (the one
gpt-fast uses on CPU), which wants bf16 activations. int4: symmetric scales per group of input
columns, PyTorch's int4 packed-weight kernel for CPU, also with bf16 activations and scales (with
fp32 ones it takes a slow reference path: benchmarks/llamacpp.py measured 7.6 against 40.2 tokens/s).
Outputs return to the model's dtype. Embeddings stay as they are
(a lookup reads one row); a tied LM head gets its own copy (int8 unless the export quantized it).

Scales come from the weights (round to nearest: `LLM(quantize="int8"|"int4")`) or, for a quantize
step's compressed-tensors export, from the file, so the engine runs the exported integers as they are.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUPS = (256, 128, 64, 32)  # what the int4 CPU kernel takes


def int8_codes(weight: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales [out]): symmetric per output channel; scales from the weights'
    row maxima unless given."""
    if scales is None:
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127
    scales = scales.float().reshape(-1)
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def int4_codes(
    weight: torch.Tensor, group: int, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(q int32 in [-8, 7], scales [out, in / group], group) in a group size the kernel takes;
    `scales` [out, in / g] as exported (their g wins over `group`), else from the group maxima."""
    out_features, in_features = weight.shape
    if scales is not None:
        group = in_features // scales.shape[1]
    else:
        scales = weight.reshape(out_features, -1, group).abs().amax(dim=-1).clamp_min(1e-10) / 7.5
    scales = scales.float()
    if group not in INT4_GROUPS:  # per channel: the same scale repeated over the kernel's groups
        coarse = group
        group = next(g for g in INT4_GROUPS if coarse % g == 0)
        scales = scales.repeat_interleave(coarse // group, dim=1)
    q = (weight / scales.repeat_interleave(group, dim=1)).round().clamp(-8, 7).to(torch.int32)
    return q, scales, group


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float()
        q, scales = int8_codes(weight, scales)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """`scales` [out, in / group] (symmetric, q in [-8, 7]); None: from the weights' group maxima."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int, scales: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        q, scales, group = int4_codes(weight, group, scales)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q + 8, 2))
        # The kernel computes (q - 8) * scale + zero per group; symmetric: zero = 0.
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scales.T, torch.zeros_like(scales.T)], dim=-1).to(torch.bfloat16).contiguous(),
        )
        self.bias, self.group = bias, group
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def _engine_linears(model: nn.Module):
    """(owner, attribute, the transformers Linears it fuses) for every projection and the head."""
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}"
        attention, mlp = layer.attention, layer.mlp
        yield attention, "qkv", [f"{prefix}.self_attn.{p}_proj" for p in "qkv"]
        yield attention, "o", [f"{prefix}.self_attn.o_proj"]
        yield mlp, "gate_up", [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"]
        yield mlp, "down", [f"{prefix}.mlp.down_proj"]
    yield model, "lm_head", ["lm_head"]


def quantize_weights(model: nn.Module, bits: int, group: int = 32, exported: dict | None = None) -> nn.Module:
    """Swap the engine model's projections and LM head for int8 or int4 Linears, in place.
    `exported`: {transformers Linear name: scale [out, groups]} of a compressed-tensors export (the
    weights already hold those integers times those scales); Linears it lacks are rounded to
    nearest here (groups of `group`), the head to int8."""
    kernel = "_weight_int8pack_mm" if bits == 8 else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, kernel):
        raise ValueError(f"this PyTorch build has no int{bits} weight-only matmul (aten.{kernel})")
    exported = exported or {}
    for owner, attribute, names in _engine_linears(model):
        linear = getattr(owner, attribute)
        scales = torch.cat([exported[n] for n in names]) if all(n in exported for n in names) else None
        # The head: int8 unless an export gives its int4 scales (4-bit logits cost more than they save).
        head_in_int8 = attribute == "lm_head" and scales is None
        if bits == 8 or head_in_int8:
            setattr(owner, attribute, Int8Linear(linear.weight, getattr(linear, "bias", None), _int8_scales(scales)))
        else:
            setattr(owner, attribute, Int4Linear(linear.weight, getattr(linear, "bias", None), group, scales))
    return model


def _int8_scales(scales: torch.Tensor | None) -> torch.Tensor | None:
    """Exported int8 scales are per channel ([out, 1]); anything else is recomputed from the weights."""
    return scales if scales is not None and scales.shape[1] == 1 else None


def dequantized_parent(causal_lm: nn.Module, mode: str) -> nn.Module:
    """A copy of a transformers model holding the values `quantize_weights(..., int8|int4)` rounds
    its Linears to (without an export's scales), for measuring what the engine's own rounding costs."""
    import copy

    bits = {"int8": 8, "int4": 4}[mode]
    model = copy.deepcopy(causal_lm)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            weight = module.weight.float()
            if bits == 8 or name == "lm_head":
                q, scales = int8_codes(weight)
                values = q.float() * scales[:, None]
            else:
                q, scales, group = int4_codes(weight, 32)
                values = q.float() * scales.repeat_interleave(group, dim=1)
            module.weight = nn.Parameter(values.to(module.weight.dtype), requires_grad=False)
    return model
