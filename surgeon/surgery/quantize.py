"""Weight-only integer quantization: the formats, round-to-nearest, and GPTQ.

A format is `bits` (8 or 4), a `group_size` (None: one scale per output channel) and `symmetric`.
Values are stored signed, q in [-2^(b-1), 2^(b-1) - 1], and read back as (q - zero) * scale, with
one scale and zero per (output row, group of input columns): the convention compressed-tensors
(llm-compressor's format, which transformers and vLLM load) uses, so an export writes these
tensors as they are.

GPTQ (Frantar et al. 2022, arXiv 2210.17323) quantizes one input column at a time and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs (H = 2 X^T X over calibration tokens), so that the layer's output on those inputs,
not its weights, stays close. Group scales are fixed when the group's first column comes up, from
the weights as the updates so far have left them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    group_size: int | None = None  # None: per output channel
    symmetric: bool = True

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def label(self) -> str:
        grouping = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits} {grouping} {'sym' if self.symmetric else 'asym'}"

    def groups(self, columns: int) -> int:
        return 1 if self.group_size is None else columns // self.group_size

    def check(self, columns: int, where: str) -> None:
        if self.group_size is not None and columns % self.group_size:
            raise ValueError(f"{where}: {columns} input columns do not divide into groups of {self.group_size}")


@dataclass
class QuantizedWeight:
    """q [out, in] int8 holding b-bit values; scale and zero [out, groups] (zero is an integer)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    format: QuantFormat

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        columns = self.q.shape[1]
        width = columns // self.scale.shape[1]
        scale = self.scale.float().repeat_interleave(width, dim=1)
        zero = self.zero.float().repeat_interleave(width, dim=1)
        return ((self.q.float() - zero) * scale).to(dtype)


# Range shrink factors tried per group: a slightly smaller scale clips the one largest weight but
# rounds all the others more finely, which on 4 bits usually wins (the search llama.cpp's k-quants
# and AWQ's clipping do in their own ways). 1.0 is plain min-max.
SHRINK = torch.linspace(1.0, 0.7, 31)


def group_parameters(weight: torch.Tensor, fmt: QuantFormat, search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [rows, 1] for a block of columns `weight` [rows, cols]: min-max, or with
    `search` the shrink of the range that minimises each row's squared rounding error."""
    weight = weight.float()
    best_scale = best_zero = best_error = None
    for shrink in SHRINK if search else SHRINK[:1]:
        scale, zero = _min_max(weight, fmt, float(shrink))
        error = ((_round(weight, scale, zero, fmt) - zero.float()) * scale - weight).square().sum(dim=1, keepdim=True)
        if best_error is None:
            best_scale, best_zero, best_error = scale, zero, error
            continue
        better = error < best_error
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_error = torch.minimum(error, best_error)
    return best_scale, best_zero


def _min_max(weight: torch.Tensor, fmt: QuantFormat, shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.symmetric:
        # Half-steps on both sides: the largest magnitude lands on +-(2^(b-1) - 1/2) (GPTQ's choice).
        scale = shrink * weight.abs().amax(dim=1, keepdim=True) / ((fmt.qmax - fmt.qmin) / 2)
        scale = scale.clamp_min(1e-10)
        return scale, torch.zeros_like(scale, dtype=torch.int8)
    low = shrink * weight.amin(dim=1, keepdim=True).clamp_max(0)
    high = shrink * weight.amax(dim=1, keepdim=True).clamp_min(0)
    scale = ((high - low) / (fmt.qmax - fmt.qmin)).clamp_min(1e-10)
    zero = (fmt.qmin - low / scale).round().clamp(fmt.qmin, fmt.qmax)
    return scale, zero.to(torch.int8)


def _round(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return (weight / scale + zero.float()).round().clamp(fmt.qmin, fmt.qmax)


def quantize_rtn(weight: torch.Tensor, fmt: QuantFormat, search: bool = True) -> QuantizedWeight:
    """Round to nearest, each group's scale from its own range (searched, unless `search` is off)."""
    rows, columns = weight.shape
    fmt.check(columns, "weight")
    width = columns if fmt.group_size is None else fmt.group_size
    grouped = weight.float().reshape(rows * (columns // width), width)
    scale, zero = group_parameters(grouped, fmt, search)
    q = _round(grouped, scale, zero, fmt).to(torch.int8).reshape(rows, columns)
    return QuantizedWeight(q, scale.reshape(rows, -1), zero.reshape(rows, -1), fmt)


def quantize_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: QuantFormat,
    damp: float = 0.01,
    block: int = 128,
    search: bool = True,
) -> QuantizedWeight:
    """GPTQ with static groups in natural column order. `hessian`: [in, in], X^T X of the inputs
    (any positive scale). `damp` adds that fraction of the mean diagonal for stability."""
    rows, columns = weight.shape
    fmt.check(columns, "weight")
    width = columns if fmt.group_size is None else fmt.group_size
    if width < columns and block % width:
        block = width * max(1, block // width)  # a group never straddles two blocks
    work = weight.detach().double().clone()
    h = hessian.detach().double().clone()
    dead = h.diagonal() == 0  # inputs never active: their weights cannot matter
    h[dead, dead] = 1
    work[:, dead] = 0
    h.diagonal().add_(damp * h.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to the columns after it.
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(rows, columns, dtype=torch.int8)
    scales, zeros = [], []
    scale = zero = None
    for start in range(0, columns, block):
        end = min(start + block, columns)
        part = work[:, start:end].clone()
        errors = torch.zeros_like(part)
        inverse_part = inverse[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % width == 0:
                scale, zero = group_parameters(part[:, i : i + width] if width < columns else work, fmt, search)
                scale, zero = scale.double(), zero
                scales.append(scale.float())
                zeros.append(zero)
            values = part[:, i : i + 1]
            rounded = _round(values, scale, zero, fmt)
            q[:, column] = rounded[:, 0].to(torch.int8)
            error = (values - (rounded - zero.double()) * scale) / inverse_part[i, i]
            part[:, i:] -= error * inverse_part[i : i + 1, i:]
            errors[:, i : i + 1] = error
        work[:, end:] -= errors @ inverse[start:end, end:]
    return QuantizedWeight(q, torch.cat(scales, dim=1), torch.cat(zeros, dim=1), fmt)


def output_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative squared error of the layer's output on the calibration inputs:
    tr(dW H dW^T) / tr(W H W^T)."""
    delta = quantized.double() - weight.double()
    h = hessian.double()
    return ((delta @ h) * delta).sum().item() / max(((weight.double() @ h) * weight.double()).sum().item(), 1e-30)


def linear_inputs(model: torch.nn.Module) -> dict[str, int]:
    """{name: in_features} of every Linear in `model` (on the meta device too), in module order."""
    return {name: m.in_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@torch.inference_mode()
def input_hessians(model: torch.nn.Module, names: list[str], windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """X^T X of each named Linear's inputs over `windows` (one forward per window). Linears that
    read the same tensor (q/k/v, gate/up) share one matrix."""
    from .capture import on_input

    modules = {name: model.get_submodule(name) for name in names}
    sums: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}  # a Linear -> the one called just before it with the very same tensor
    last: list = [None, None]  # (tensor, name); holding the tensor keeps its memory from being reused

    def take(name: str, hidden: torch.Tensor, _kwargs: dict) -> None:
        if name not in alias:
            alias[name] = alias[last[1]] if last[0] is hidden else name
        last[:] = [hidden, name]
        if alias[name] != name:
            return
        flat = hidden.reshape(-1, hidden.shape[-1]).double()
        if name not in sums:
            sums[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64)
        sums[name].addmm_(flat.T, flat)

    device = next(model.parameters()).device
    with on_input(modules, take):
        for index in range(windows.shape[0]):
            last[:] = [None, None]
            model(input_ids=windows[index : index + 1].to(device), use_cache=False, logits_to_keep=1)
    return {name: sums[alias[name]] for name in names}
