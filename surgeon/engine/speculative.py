"""Speculative decoding: a draft proposes tokens, one target forward checks them all.

A decode step of a small model on a CPU (or at small batch on a GPU) is bound by reading the
weights, so scoring k+1 tokens costs little more than scoring one. The draft (drafts.py) proposes
up to k tokens per sequence; the target runs [last token, d1..dk] in one forward and
`accept` keeps the longest prefix the target agrees with, plus one token of the target's own:

- greedy: d_j is kept while it is the target's argmax; the target's argmax follows.
- sampled: d_j is kept with probability min(1, p(d_j) / q(d_j)); at the first rejection the
  token is drawn from max(0, p - q), normalised; if all are kept, one more is drawn from p
  (Leviathan et al. 2023; Chen et al. 2023). p and q are the distributions the request samples
  from (penalty, temperature, top-k, top-p applied), so the output distribution is the target's.
  A draft that proposes without probabilities (n-gram lookup) is a point mass: q(d) = 1.

How many tokens each sequence proposes is planned per step (`Planner`): a draft position j of a
sequence whose recent acceptance rate is a is expected to add a**j tokens, and costs the step's
marginal time per token; positions are added while they raise tokens per second, and the plan
stands only if, with a verification's fixed cost charged once, it beats a plain step. The cost model
is fitted online from the engine's own step times, so at batch 1 on a memory-bound CPU it
speculates eagerly and under a compute-bound batch it backs off.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .sampler import distribution, draw, penalised
from .sequence import Sequence, Speculation

METHODS = ("ngram", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup: the continuation of the longest recent n-gram match in
    the prompt and output) or "model" (`draft`: a checkpoint with the target's tokenizer, run by
    the engine with its own paged cache). `k`: the most tokens a sequence proposes per step.
    `adaptive`: plan k per sequence and step from acceptance and measured step costs (else always
    k). `ngram_max` / `ngram_min`: the n-gram sizes looked up, longest first."""

    method: str = "ngram"
    k: int = 4
    draft: str | None = None
    adaptive: bool = True
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"speculative k must be an integer in 1..16, got {self.k!r}")
        if self.method == "model" and not self.draft:
            raise ValueError("speculative method 'model' needs `draft`: a checkpoint path or alias")
        if self.method == "ngram" and self.draft:
            raise ValueError("speculative method 'ngram' takes no draft model")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= 16, got {self.ngram_min}, {self.ngram_max}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a config, a dict of its fields, "ngram", or a draft model's path."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown speculative settings: {', '.join(sorted(unknown))}")
            return cls(**value)
        if isinstance(value, str):
            return cls() if value == "ngram" else cls(method="model", draft=value)
        raise ValueError(f"speculative must be a dict, 'ngram' or a draft path, got {type(value).__name__}")


@dataclass
class Proposal:
    """Draft tokens for one sequence, and the draft's distribution for each (None: a point mass)."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(tokens), vocab]

    def cut(self, size: int) -> Proposal:
        return Proposal(self.tokens[:size], None if self.probs is None else self.probs[:size])


class StepCosts:
    """Seconds per target step as a + b * tokens + c * [a verification], fitted over recent steps
    (least squares with the verification as a second intercept), and the draft's seconds per
    proposing round (the median of recent rounds). c is what turning a plain step into a
    verification costs beyond its extra tokens (every row's logits, the padded query grid, the
    per-sequence accept); a single line through both kinds of step hid it, and at 16 sequences
    it priced a plain step above its cost, so speculation at acceptance ~0.4 looked like a gain
    and lost 15%. A target step far longer than is usual (torch.compile compiling a new shape:
    seconds, against milliseconds) is left out of the fit, and the median keeps such a draft round
    from setting the round's cost; otherwise one compile would price speculation out for a long
    while. c outlives the window: once a declined draft's verifications have left it, the last
    measured c stands (reading 0 there priced verifications as free and took the draft up again)."""

    OUTLIER = 5.0  # times the median step

    def __init__(self, window: int = 64):
        self.samples: deque[tuple[int, bool, float]] = deque(maxlen=window)
        self.draft_rounds: deque[float] = deque(maxlen=16)
        self.measured_c: float | None = None  # the last c fitted with both kinds of step in the window

    def observe(self, tokens: int, seconds: float, verify: bool = False) -> None:
        self.samples.append((tokens, verify, seconds))

    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds:
            self.draft_rounds.append(seconds / rounds)

    @property
    def draft_round(self) -> float | None:
        return statistics.median(self.draft_rounds) if self.draft_rounds else None

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None before there is anything to fit. b comes from the spread of step
        sizes within each kind of step; c is 0 until both kinds have been seen together (until
        then a verification's cost is whatever its own steps say a is), and the last such c
        while the window holds one kind only."""
        if not self.samples:
            return None
        usual = self.OUTLIER * statistics.median(s for _, _, s in self.samples)
        groups = {kind: [(t, s) for t, v, s in self.samples if v == kind and s <= usual] for kind in (False, True)}
        groups = {kind: kept for kind, kept in groups.items() if kept}
        means = {
            kind: (statistics.fmean(t for t, _ in kept), statistics.fmean(s for _, s in kept))
            for kind, kept in groups.items()
        }
        spread = sum((t - means[kind][0]) ** 2 for kind, kept in groups.items() for t, _ in kept)
        if spread == 0:
            # One step size per kind seen so far: assume a marginal token costs 5% of such a
            # step, the figure for a memory-bound decode; the fit takes over once sizes differ.
            mean_x, mean_y = means[min(groups)]
            b = 0.05 * mean_y / max(mean_x, 1)
        else:
            covariance = sum(
                (t - means[kind][0]) * (s - means[kind][1]) for kind, kept in groups.items() for t, s in kept
            )
            b = max(0.0, covariance / spread)
        intercepts = {kind: mean_y - b * mean_x for kind, (mean_x, mean_y) in means.items()}
        if len(groups) == 2:
            a = max(intercepts[False], 1e-6)
            self.measured_c = c = max(0.0, intercepts[True] - a)
        else:
            c = self.measured_c or 0.0
            only = next(iter(intercepts))
            a = max(intercepts[only] - (c if only else 0.0), 1e-6)  # verifications alone: a is theirs less c
        return a, max(b, 0.002 * a), c  # a token is never free: noise must not make speculation unbounded

    @property
    def prices_c(self) -> bool:
        """Whether c has been measured (both kinds of step seen in one window), not assumed 0."""
        self.fit()  # c is taken whenever the window holds both kinds: look at it now
        return self.measured_c is not None


class Planner:
    """Draft tokens per sequence for one step: positions are added, best expected gain first,
    while they raise expected tokens per second."""

    PROBE_EVERY = 32  # steps a model draft may sit idle before one position is tried again
    PROBE_MOST = 512  # ... doubling after each probe the plan did not take up, to this

    def __init__(self, config: SpeculativeConfig, draft_costs_rounds: bool):
        self.config = config
        self.costs = StepCosts()
        self.draft_costs_rounds = draft_costs_rounds  # a model draft pays per round, an n-gram nothing
        self.idle = 0  # steps since a model draft last ran
        self.probe_every = self.PROBE_EVERY

    def limits(self, room: list[int]) -> list[int]:
        """The most draft tokens each sequence may propose: k, within its room."""
        return [max(0, min(self.config.k, r)) for r in room]

    def plan(self, seqs: list[Sequence], room: list[int]) -> list[int]:
        """k per sequence, each at most `room[i]` (tokens it may still emit, minus the one the
        target adds)."""
        limits = self.limits(room)
        if not self.config.adaptive:
            return limits
        fitted = self.costs.fit()
        if fitted is None:
            return limits  # no step measured yet: speculate fully once, then plan
        return self._probe(self._choose([seq.spec.rate for seq in seqs], limits, fitted), limits, seqs)

    def _choose(self, rates: list[float], limits: list[int], fitted: tuple[float, float, float]) -> list[int]:
        """k per sequence for these per-token acceptance estimates, priced with the fitted costs."""
        a, b, c = fitted
        draft_round = self.costs.draft_round or 0.0
        plain_rate = len(rates) / (a + b * len(rates))
        # Price the step as a verification, add positions while they raise its tokens per
        # second, then keep the plan only if it beats the plain step it replaces.
        seconds = a + b * len(rates) + c
        tokens = float(len(rates))
        ks = [0] * len(rates)
        candidates = sorted(
            ((rate**j, i, j) for i, rate in enumerate(rates) for j in range(1, limits[i] + 1)),
            reverse=True,
        )
        rounds = 0
        for gain, i, j in candidates:
            if j != ks[i] + 1:
                continue  # positions of one sequence come in order
            cost = b + (draft_round if self.draft_costs_rounds and j > rounds else 0.0)
            if gain / cost <= tokens / seconds:
                continue
            ks[i] = j
            rounds = max(rounds, j)
            tokens += gain
            seconds += cost
        if tokens / seconds <= plain_rate:
            ks = [0] * len(rates)
        return ks

    def break_even(self, sequences: int = 1) -> float | None:
        """The lowest per-token acceptance at which the plan speculates for `sequences` sequences
        at that acceptance, priced with the step and draft costs measured so far: what a draft
        must reach to pay on this machine (None before a step is measured, with a fixed k, which
        always speculates, or when even a draft that is always right would not pay)."""
        fitted = self.costs.fit()
        if fitted is None or not self.config.adaptive:
            return None
        limits = [self.config.k] * sequences
        speculates = lambda rate: any(self._choose([rate] * sequences, limits, fitted))
        if not speculates(1.0):
            return None
        low, high = 0.0, 1.0  # more acceptance never makes the plan propose less: bisect
        while high - low > 1e-3:
            middle = (low + high) / 2
            low, high = (low, middle) if speculates(middle) else (middle, high)
        return high

    def _probe(self, ks: list[int], limits: list[int], seqs: list[Sequence]) -> list[int]:
        """A declined draft is never timed or checked again, so an estimate made on a bad step
        (a compile, a busy machine) would stand for good, c included now that it outlives the
        window: after PROBE_EVERY idle steps the likeliest sequence proposes one token, which
        re-measures both. A model draft's probe costs it a catch-up prefill over the tokens it
        missed (about a target step on a CPU), so while the plan keeps declining, its wait
        doubles, up to PROBE_MOST; an n-gram's costs one two-row verification, and its wait stays."""
        if not any(limits):
            self.idle = 0
            return ks
        if any(ks):
            self.idle, self.probe_every = 0, self.PROBE_EVERY
            return ks
        self.idle += 1
        if self.idle >= self.probe_every:
            grown = 2 * self.probe_every if self.draft_costs_rounds else self.probe_every
            self.idle, self.probe_every = 0, min(grown, self.PROBE_MOST)
            best = max((i for i, limit in enumerate(limits) if limit), key=lambda i: seqs[i].spec.rate)
            ks[best] = 1
        return ks


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def accept(logits: torch.Tensor, seq: Sequence, proposal: Proposal) -> list[int]:
    """The tokens `seq` gains from one verification: the kept draft tokens, then one of the
    target's. `logits` [len(proposal.tokens) + 1, vocab]: the target's scores after the last
    token and after each draft token."""
    params, history = seq.params, list(seq.token_ids)
    if params.greedy:
        if params.repetition_penalty == 1.0:
            choices = logits.argmax(-1).tolist()  # one batched argmax
        else:
            choices = None
        out = []
        for j, token in enumerate(proposal.tokens):
            best = choices[j] if choices is not None else int(penalised(logits[j], params, history).argmax())
            if best != token:
                return [*out, best]
            out.append(token)
            history.append(token)
        last = len(proposal.tokens)
        return [*out, choices[last] if choices is not None else int(penalised(logits[last], params, history).argmax())]
    out = []
    for j, token in enumerate(proposal.tokens):
        p = distribution(logits[j], params, history)
        q_token = 1.0 if proposal.probs is None else float(proposal.probs[j, token])
        u = float(torch.rand((), generator=seq.generator))
        if u * q_token < float(p[token]):  # accept with probability min(1, p/q)
            out.append(token)
            history.append(token)
            continue
        if proposal.probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - proposal.probs[j].to(p.device)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection had probability 0; guard rounding
            residual = p
        return [*out, draw(residual, seq.generator)]
    return [*out, draw(distribution(logits[len(proposal.tokens)], params, history), seq.generator)]


class Speculator:
    """The speculative decode step: plan, propose, verify in one target forward, roll back."""

    def __init__(self, config: SpeculativeConfig, draft, runner, blocks, max_model_len: int, device: torch.device):
        self.config, self.draft = config, draft
        self.runner, self.blocks = runner, blocks
        self.max_model_len = max_model_len
        self.planner = Planner(config, draft.costs_rounds)
        self.device = device
        # The draft's acceptance over all sequences. For a model draft it is where a new or idle
        # sequence's estimate starts and returns to: trying a draft again costs it a catch-up
        # prefill, and an optimistic fixed prior re-engaged a weak draft every few steps. An
        # n-gram lookup costs nothing to retry and keeps the fixed prior.
        self.overall = Speculation(memory=0.99)  # across sequences: the last ~100 tokens tested

    @property
    def prior(self) -> float:
        """Where a new sequence's acceptance estimate starts, and an idle one's returns to."""
        return self.overall.rate if self.draft.costs_rounds else Speculation.PRIOR

    def step(self, scheduled) -> tuple[list[Sequence], list[list[int]]]:
        """Run a decode step speculatively: (its sequences, the tokens each gains). Each sequence
        is left with the keys of its kept tokens computed and no blocks past its tokens' needs
        beyond those the caller's stopping checks may still trim."""
        from .sampler import sample
        from .scheduler import Scheduled

        seqs = scheduled.seqs
        room = [self._room(seq) for seq in seqs]
        if self.draft.costs_rounds:
            ks = self.planner.plan(seqs, room)
            if any(ks):
                proposals = self.draft.propose(seqs, ks)
                for seconds in self.draft.round_seconds:  # decode-like rounds only: a catch-up prefill is paid once
                    self.planner.costs.observe_draft(1, seconds)
            else:
                proposals = [Proposal() for _ in seqs]
        else:
            # A free draft (n-gram lookup) looks first and the planner chooses among the tokens it
            # found: planned blind, a sequence with no match still counted as a likely gain, and
            # one found match then made the whole batch a verification.
            proposals = self.draft.propose(seqs, self.planner.limits(room))
            ks = self.planner.plan(seqs, [len(p.tokens) for p in proposals])
            proposals = [p.cut(k) for p, k in zip(proposals, ks)]
        chunks = []
        for i, seq in enumerate(seqs):
            proposals[i] = self._fit(seq, proposals[i])  # before extending: room and blocks as they are now
            seq.token_ids.extend(proposals[i].tokens)  # taken back after the forward
            self.blocks.append(seq)
            chunks.append(1 + len(proposals[i].tokens))
        verify = any(chunk > 1 for chunk in chunks)
        step = Scheduled(prefill=False, seqs=seqs, chunks=chunks, verify=True) if verify else scheduled
        with Timer(self.device) as forward:
            logits = self.runner.run(step)
            if verify:
                gained, row = [], 0
                for seq, proposal, chunk in zip(seqs, proposals, chunks):
                    del seq.token_ids[len(seq) - len(proposal.tokens) :]
                    gained.append(accept(logits[row : row + chunk], seq, proposal))
                    row += chunk
            else:
                gained = [[token] for token in sample(logits, seqs)]
        self.planner.costs.observe(sum(chunks), forward.seconds, verify)
        for seq, proposal, tokens in zip(seqs, proposals, gained):
            seq.computed = len(seq) + len(tokens) - 1  # the last token of the chunk kept, plus those accepted
            seq.spec.observe(len(proposal.tokens), len(tokens) - 1)
            self.overall.observe(len(proposal.tokens), len(tokens) - 1)
            if not proposal.tokens:
                seq.spec.drift(self.prior)
        return seqs, gained

    def _room(self, seq: Sequence) -> int:
        """Draft tokens worth proposing: the target adds one more, and the request ends at its
        max_tokens or the context's end (none for a request that asked not to speculate)."""
        if not seq.params.speculate:
            return 0
        left = self.max_model_len - len(seq) - 1
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.completion_ids) - 1)
        return max(0, left)

    def _fit(self, seq: Sequence, proposal: Proposal) -> Proposal:
        """The proposal cut to the request's room and to the free blocks (speculation never
        preempts anything)."""
        proposal = proposal.cut(self._room(seq))
        while proposal.tokens:
            wanted = self.blocks.blocks_needed(len(seq) + len(proposal.tokens)) - len(seq.block_table)
            if wanted <= self.blocks.num_free:
                break
            proposal = proposal.cut(len(proposal.tokens) - 1)
        return proposal
