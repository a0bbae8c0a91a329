"""Continuous batching: which sequences run in the next step, and how many of their tokens.

A step is either a prefill (chunks of prompts, at most `max_batched_tokens` tokens in all) or a
decode (one token for every sequence past its prompt). When both kinds are waiting they alternate,
so a long prompt arriving never stalls the others' decoding for more than one chunk. When a decode
step finds no free block, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (mostly from the prefix cache) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    prefill: bool
    seqs: list[Sequence]
    chunks: list[int]  # tokens each sequence runs this step
    verify: bool = False  # logits after every token of the chunk, not only after the last (speculation)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._last_prefill = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Scheduled | None:
        self._admit()
        prefills = [seq for seq in self.running if seq.pending > 1]
        decodes = [seq for seq in self.running if seq.pending == 1]
        if prefills and not (decodes and self._last_prefill):
            self._last_prefill = True
            return self._prefill(prefills)
        self._last_prefill = False
        if decodes:
            return self._decode(decodes)
        return None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _prefill(self, seqs: list[Sequence]) -> Scheduled:
        budget, chosen, chunks = self.max_batched_tokens, [], []
        for seq in seqs:
            if budget == 0:
                break
            chunk = min(seq.pending, budget)
            chosen.append(seq)
            chunks.append(chunk)
            budget -= chunk
        return Scheduled(True, chosen, chunks)

    def _decode(self, seqs: list[Sequence]) -> Scheduled | None:
        ready = []
        for seq in seqs:
            while seq.status is Status.RUNNING and not self.blocks.can_append(seq):
                self._preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                self.blocks.append(seq)
                ready.append(seq)
        # A sequence made ready early may have been preempted for a later one.
        ready = [seq for seq in ready if seq.status is Status.RUNNING]
        return Scheduled(False, ready, [1] * len(ready)) if ready else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.release(seq)
