"""One request as the engine tracks it: its tokens, where their keys live, how far it has got."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ImageSpan:
    """An image's placeholder run in the prompt. `digest` (its pixels' hash) enters the prefix
    cache's hash chain, so a repeated image reuses its cached keys; `pixels` stay until the request
    ends (a preempted request prefills its images again, usually from the encoder's feature cache)."""

    start: int
    length: int
    digest: str
    pixels: torch.Tensor | None

    def overlaps(self, begin: int, end: int) -> bool:
        return self.start < end and begin < self.start + self.length


@dataclass
class Speculation:
    """What speculative decoding did for one sequence: tokens proposed and kept, target forwards
    that gave it tokens, and its recent per-token acceptance (the planner's estimate)."""

    PRIOR: ClassVar[float] = 0.6  # the estimate before any evidence

    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # proposals that ended in a rejection (the rest were accepted whole)
    target_steps: int = 0
    rate: float = PRIOR

    def observe(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            # Tokens after the first rejection were never tested: the evidence is `accepted`
            # successes and at most one failure (a truncated geometric sample).
            failures = 1 if accepted < proposed else 0
            self.rejected += failures
            self.rate += 0.3 * (accepted / (accepted + failures) - self.rate)

    def drift(self, prior: float) -> None:
        """A step without a proposal: the estimate slowly returns to the prior, so a sequence that
        backed off tries again later (text that was unpredictable may stop being so)."""
        self.rate += 0.05 * (prior - self.rate)

    def summary(self) -> dict:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "rejected": self.rejected,
            "target_steps": self.target_steps,
        }


_counter = itertools.count()


@dataclass
class Sequence:
    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    images: list[ImageSpan] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks committed so far
    computed: int = 0  # tokens whose keys/values are in the cache
    finish_reason: str | None = None
    text: str = ""  # output text handed out so far
    generator: torch.Generator | None = None
    spec: Speculation = field(default_factory=Speculation)
    arrival: int = field(default_factory=lambda: next(_counter))

    def __post_init__(self):
        self.prompt_len = len(self.token_ids)
        if not self.request_id:
            self.request_id = f"req-{self.arrival}"
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.computed

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def image_key(self, begin: int, end: int) -> tuple:
        """What, besides token ids, identifies the contents of positions [begin, end)."""
        return tuple((image.digest, image.start - begin) for image in self.images if image.overlaps(begin, end))
