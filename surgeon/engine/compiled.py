"""How `compile=True` compiles the decode step.

On a CPU at batch 1 a decode step is a few matrix-vector products per layer, and MKL's fp32
sgemm reads a [out, in] weight far below the memory bandwidth when a step has 1 to 4 rows
(SmolLM2-135M's 121 projections: ~53 ms for one row, ~110 ms for three, where streaming the same
540 MB takes ~21 ms). Inductor's packed C++ GEMM reads each weight once for all of a step's rows,
but only for weights it may treat as constants: so on a CPU the weights are frozen into the
compiled graph (inductor's `freezing`; the graph keeps its own packed copy, so the engine's
model must not be trained afterwards) and its matmuls autotuned (`max_autotune`). One row then
costs ~19 ms and a verification of five barely more, which is what speculative decoding needs.
Quantized weights keep the plain compile: their matmuls are PyTorch's int8/int4 kernels.

Exactness: a one-token step and a verification's several rows are separate graphs, and SDPA's
matmuls round a row differently by how many query rows it has; greedy speculation under this
compile could then pick another token where the top two logits are within rounding (measured: 1 of
8 grounded answers, at a 2.5e-5 margin). `LLM(batch_invariant=True)` removes that: each row of a
step is then computed bit for bit alike whatever the step's width, so a verification's logits are
exactly those of one-token steps (and a request's do not depend on its batch). Inductor's packed
GEMM sums each row in one order for any number of rows within a graph, and graphs tuned for
different widths agreed in every check; dynamo gives a width of 1 a graph of its own, so a one-row
step runs its row twice; attention sums by reduction over keys padded to a vector width (runner.py,
kernels/paged_attention.py), slower than SDPA for a verification's rows. Eager steps cannot be made
so cheaply: MKL's sgemm rounds a row differently for 1, 2, 3 or 5 rows.

On CUDA the step compiles as it is (the paged Triton kernels do the attention).

Every engine model shares one code object (`forward`), and dynamo's limit of 8 graphs is per code
object: a compiled target (one-row step, batched step, verification) beside a compiled draft (its
steps and catch-ups), or a few compiled engines in one process, passed it, and past it dynamo runs
the new shapes eagerly without a word beyond one warning (measured: the speculative benchmark's
compiled draft row). Each engine's graphs are guarded on its own model, so the limit is raised
around the call rather than shared graphs being forced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

GRAPHS_PER_CODE = 64  # dynamo's recompile limit while an engine step runs (its default: 8)


def compile_decode(model: nn.Module, device: torch.device, quantized: bool) -> Callable:
    """The decode step `model(embeds, batch)`, compiled for `device`."""
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config

    frozen = device.type == "cpu" and not quantized
    if frozen:
        compiled = torch.compile(model, dynamic=True, options={"max_autotune": True})
    else:
        compiled = torch.compile(model.forward, dynamic=True)
    limit = max(GRAPHS_PER_CODE, dynamo_config.recompile_limit)
    inductor_settings = {"freezing": True} if frozen else {}

    def forward(embeds: torch.Tensor, batch) -> torch.Tensor:
        # Both settings are read when a graph compiles (each new shape). Freezing passed in
        # `options` does not take effect in this PyTorch, so it is set around the call too.
        with dynamo_config.patch(recompile_limit=limit), inductor_config.patch(**inductor_settings):
            return compiled(embeds, batch)

    return forward
