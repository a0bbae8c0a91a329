"""Weight-only int8 for CPU decoding: a batch-1 decode step reads every weight once, so it is bound
by memory bandwidth; int8 weights read a quarter of fp32's bytes.

Per output channel symmetric scales (round to nearest, |q| <= 127). The matmul is PyTorch's own
int8-weight kernel (the one gpt-fast uses on CPU), which wants bf16 activations; outputs return
to the model's dtype. Embeddings stay as they are (a lookup reads one row); a tied LM head gets its
own int8 copy. Opt-in: outputs are close to the fp32 model's, not identical (the benchmark prints
how close).
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127
        self.register_buffer("weight", (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
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


def quantize_int8(model: nn.Module) -> nn.Module:
    """Swap the engine model's projections and LM head for Int8Linear, in place."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise ValueError("this PyTorch build has no int8 weight-only matmul (aten._weight_int8pack_mm)")
    for layer in model.layers:
        attention, mlp = layer.attention, layer.mlp
        attention.qkv, attention.o = Int8Linear.from_linear(attention.qkv), Int8Linear.from_linear(attention.o)
        mlp.gate_up, mlp.down = Int8Linear.from_linear(mlp.gate_up), Int8Linear.from_linear(mlp.down)
    model.lm_head = Int8Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None))
    return model
