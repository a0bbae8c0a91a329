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
    that gave it tokens, and its recent per-token acceptance (the planner's estimate).

    The estimate is counted, not averaged per proposal: tokens accepted and tokens tested, each
    count fading by `memory` per token of new evidence, with the prior worth PSEUDO tokens. An
    average moving 0.3 of the way per proposal swung by ~0.2 on one-token proposals, so a draft
    kept 54% of the time against a bar of 0.49 dipped below it after one rejection, was declined,
    and was not tested again for tens of steps: in a simulation with this machine's compiled costs
    (planner, draft and acceptance draws only) it made 1.03 tokens a target step at p = 0.54 and
    1.13 at p = 0.7; counted, 1.32 and 2.46."""

    PRIOR: ClassVar[float] = 0.6  # the estimate before any evidence
    PSEUDO: ClassVar[float] = 4.0  # tokens of evidence the prior is worth
    IDLE_FADE: ClassVar[float] = 0.95  # per step without a proposal: evidence fades, the prior returns

    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # proposals that ended in a rejection (the rest were accepted whole)
    target_steps: int = 0
    rate: float = PRIOR
    prior: float = PRIOR
    memory: float = 0.95  # per token tested: a sequence's estimate follows its last ~20 tokens tested
    successes: float = 0.0  # faded counts of tokens accepted ...
    tested: float = 0.0  # ... and of tokens tested (the accepted ones and the rejection, if any)

    def observe(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            # Tokens after the first rejection were never tested: the evidence is `accepted`
            # successes and at most one failure (a truncated geometric sample).
            failures = 1 if accepted < proposed else 0
            self.rejected += failures
            fade = self.memory ** (accepted + failures)
            self.successes = self.successes * fade + accepted
            self.tested = self.tested * fade + accepted + failures
            self._estimate()

    def start_from(self, prior: float) -> None:
        """A new sequence's estimate: the prior alone."""
        self.prior = prior
        self._estimate()

    def drift(self, prior: float) -> None:
        """A step without a proposal: the evidence fades and the estimate returns to the prior, so a
        sequence that backed off tries again later (text that was unpredictable may stop being so)."""
        self.prior = prior
        self.successes *= self.IDLE_FADE
        self.tested *= self.IDLE_FADE
        self._estimate()

    def _estimate(self) -> None:
        self.rate = (self.successes + self.PSEUDO * self.prior) / (self.tested + self.PSEUDO)

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
