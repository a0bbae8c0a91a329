"""Runs a scheduled step: owns the paged KV cache, packs the step's tokens, calls the model."""

from __future__ import annotations

import torch

from ..kernels.paged_attention import key_slots
from .batch import StepBatch
from .compiled import compile_decode
from .models.llama import LlamaEngineModel
from .scheduler import Scheduled
from .vision import VisionEncoder

# Keys a row-invariant step pads to a multiple of: a whole AVX-512 vector of fp32 (two of AVX2), so
# that a key's place among a reduction's vector lanes does not depend on where the keys end.
KEY_PADDING = 16


class ModelRunner:
    def __init__(
        self,
        model: LlamaEngineModel,
        vision: VisionEncoder | None,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        compile: bool = False,
        quantized: bool = False,
        row_invariant: bool = False,
    ):
        self.model, self.vision = model, vision
        # Decode steps are many and alike: compiled, their small ops fuse and the per-op overhead
        # goes, and on a CPU the weights are read by a packed GEMM (compiled.py). Prefill steps
        # vary in shape and stay eager.
        self.decode_forward = compile_decode(model, device, quantized) if compile else model.forward
        self.compiled = compile
        # `row_invariant` (compiled, CPU): a decode step's rows computed alike whatever its width,
        # so a verification's logits are bit for bit those of one-token steps (compiled.py).
        self.row_invariant = row_invariant
        self.block_size, self.device = block_size, device
        config = model.config
        for layer in model.layers:
            attention = layer.attention
            shape = (num_blocks, block_size, attention.kv_heads, attention.head_dim)
            attention.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attention.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            if attention.indexer is not None:
                attention.index_cache = torch.zeros(
                    num_blocks, block_size, attention.indexer.dim, dtype=torch.float32, device=device
                )
        self.vocab_size = config.vocab_size

    @staticmethod
    def cache_bytes_per_token(model: LlamaEngineModel, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in model.layers:
            attention = layer.attention
            total += 2 * attention.kv_heads * attention.head_dim * size
            if attention.indexer is not None:
                total += attention.indexer.dim * 4
        return total

    def _slot(self, seq, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def run(self, step: Scheduled) -> torch.Tensor:
        """Logits [R, vocab] fp32 for the sequences whose step reaches their last token, in order
        (for a verification: after every token of every chunk)."""
        if step.verify:
            return self._verify(step)
        if self.row_invariant and not step.prefill and len(step.seqs) == 1:
            # dynamo gives a width of 1 a graph of its own, whose GEMMs round apart: the same token
            # twice writes the same key to the same slot, and one row of logits is read
            return self._decode_or_prefill(Scheduled(False, step.seqs * 2, step.chunks * 2))[:1]
        return self._decode_or_prefill(step)

    def _decode_or_prefill(self, step: Scheduled) -> torch.Tensor:
        ids, positions, slots, token_rows, logit_rows = [], [], [], [], []
        context_slots, cu_q, cu_k = [], [0], [0]
        for row, (seq, chunk) in enumerate(zip(step.seqs, step.chunks)):
            start, end = seq.computed, seq.computed + chunk
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            token_rows.extend([row] * chunk)
            if end == len(seq):
                logit_rows.append(len(ids) - 1)
            if step.prefill:
                context_slots.extend(self._slot(seq, p) for p in range(end))
                cu_q.append(cu_q[-1] + chunk)
                cu_k.append(cu_k[-1] + end)
        widest = max(len(seq.block_table) for seq in step.seqs)
        tables = [seq.block_table + [-1] * (widest - len(seq.block_table)) for seq in step.seqs]
        context_lens = [seq.computed + chunk for seq, chunk in zip(step.seqs, step.chunks)]
        batch = self._batch(step.prefill, positions, slots, tables, context_lens, token_rows, logit_rows)
        if step.prefill:
            batch.cu_seqlens_q, batch.cu_seqlens_k = self._tensor(cu_q, torch.int32), self._tensor(cu_k, torch.int32)
            batch.context_slots = self._tensor(context_slots)
        forward = self.model if step.prefill else self.decode_forward
        return forward(self._embed(step, ids), batch)

    def _verify(self, step: Scheduled) -> torch.Tensor:
        """A speculative verification as a decode step in which every token of a chunk is a query
        row of its own, seeing its sequence's keys up to its own position: the chunk's keys are
        written before attention reads them, so the draft tokens see each other causally, through
        the same attention code (and compiled graph) as plain decoding. On CUDA each row is a row
        of the paged kernels; elsewhere a sequence's keys are gathered once for all its rows."""
        ids, positions, slots, rows_of = [], [], [], []
        for index, (seq, chunk) in enumerate(zip(step.seqs, step.chunks)):
            for p in range(seq.computed, seq.computed + chunk):
                ids.append(seq.token_ids[p])
                positions.append(p)
                slots.append(self._slot(seq, p))
                rows_of.append(index)
        widest = max(len(seq.block_table) for seq in step.seqs)
        tables = [seq.block_table + [-1] * (widest - len(seq.block_table)) for seq in step.seqs]
        every = list(range(len(ids)))
        if self.device.type == "cuda":
            per_token = [tables[i] for i in rows_of]
            batch = self._batch(False, positions, slots, per_token, [p + 1 for p in positions], every, every)
            return self.decode_forward(self._embed(step, ids), batch)
        ends = [seq.computed + chunk for seq, chunk in zip(step.seqs, step.chunks)]
        batch = self._batch(False, positions, slots, tables, ends, rows_of, every)
        widest_chunk = max(step.chunks)
        grid, limits = [], []
        for index, (seq, chunk) in enumerate(zip(step.seqs, step.chunks)):
            grid.extend(index * widest_chunk + j for j in range(chunk))
            # Row j sees keys up to its own position; rows past the chunk see one key (never read).
            limits.append([seq.computed + j + 1 if j < chunk else 1 for j in range(widest_chunk)])
        keys = torch.arange(batch.key_slots.shape[1], device=self.device)
        batch.key_mask = (keys[None, None, :] < self._tensor(limits)[:, :, None])[:, None]
        batch.query_rows = self._tensor(grid)
        return self.decode_forward(self._embed(step, ids), batch)

    def compile_shapes(self, blocks, rows: int, widths) -> None:
        """Run the decode step once for `rows` placeholder sequences at each width in `widths`
        (1: a plain step; more: a verification), so that torch.compile compiles those graphs now
        and not inside a request (seconds each on a CPU, against a step's milliseconds). The
        placeholders' keys go to fresh blocks, released without a prefix-cache hash."""
        from .sampling import SamplingParams
        from .sequence import Sequence

        seqs = [Sequence([0] * (2 * self.block_size + max(widths)), SamplingParams()) for _ in range(rows)]
        if blocks.blocks_needed(len(seqs[0])) * rows > blocks.num_free:
            return  # a cache this small holds no requests either; they compile as they come
        for seq in seqs:
            blocks.allocate(seq, reuse=False)
        try:
            for width in widths:
                for seq in seqs:
                    seq.computed = len(seq) - width
                self.run(Scheduled(prefill=False, seqs=seqs, chunks=[width] * rows, verify=width > 1))
        finally:
            for seq in seqs:
                blocks.release(seq)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _batch(self, prefill, positions, slots, tables, context_lens, token_rows, logit_rows) -> StepBatch:
        batch = StepBatch(
            prefill=prefill,
            positions=self._tensor(positions),
            slots=self._tensor(slots),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            token_rows=self._tensor(token_rows),
            logit_rows=self._tensor(logit_rows),
        )
        if not prefill and self.device.type != "cuda":
            multiple = KEY_PADDING if self.row_invariant else 1
            batch.key_slots, batch.key_mask = key_slots(
                batch.block_tables, batch.context_lens, self.block_size, multiple
            )
            batch.row_invariant = self.row_invariant
        return batch

    def _embed(self, step: Scheduled, ids: list[int]) -> torch.Tensor:
        token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.vision is None:
            return self.model.embed(token_ids)
        placeholder = token_ids == self.vision.image_token_id
        embeds = self.model.embed(token_ids.masked_fill(placeholder, 0))
        offset = 0
        for seq, chunk in zip(step.seqs, step.chunks):
            start, end = seq.computed, seq.computed + chunk
            for span in seq.images:
                if span.overlaps(start, end):
                    lo, hi = max(start, span.start), min(end, span.start + span.length)
                    features = self.vision.features(span)[lo - span.start : hi - span.start]
                    embeds[offset + lo - start : offset + hi - start] = features.to(embeds.dtype)
            offset += chunk
        return embeds
