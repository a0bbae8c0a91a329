"""Drafts for speculative decoding: who proposes the tokens the target then checks (speculative.py).

- `NgramDraft` (prompt lookup, cf. Saxena 2023): the tokens that followed the most recent earlier
  occurrence of the sequence's last n tokens, longest n first. Costs no model; pays off where the
  output quotes its input (summaries, rewrites, code edits, answers about a passage).
- `ModelDraft`: a smaller checkpoint with the target's tokenizer (a surgeon export of the same
  parent, say), run by the engine's own model code with its own paged cache. Each target sequence
  has a mirror sequence in the draft's cache; after a verification the mirror is rolled back to
  the tokens the target kept, so the draft recomputes only what changed. A draft whose config
  names a reduced output vocabulary (`surgeon_draft.token_ids`, written by the `draft_vocabulary`
  step) scores only those N tokens, its head's rows for them (at 135M parameters the full head is
  a fifth of the model), and maps its proposals back to the target's ids. The checkpoint itself
  keeps its full head, so transformers loads it as it is.
"""

from __future__ import annotations

import torch

from ..errors import SourceError
from .sampler import distribution, draw, penalised
from .sampling import SamplingParams
from .scheduler import Scheduled
from .sequence import Sequence, Status
from .speculative import Proposal, SpeculativeConfig, Timer


class NgramDraft:
    costs_rounds = False

    def __init__(self, config: SpeculativeConfig, never: set[int]):
        self.config = config
        self.never = never  # token ids never proposed (image placeholders)
        # Per request: how many of its tokens are indexed, and each n-gram's latest end position.
        self.index: dict[str, tuple[int, dict[tuple, int]]] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._lookup(seq, k) if k else Proposal() for seq, k in zip(seqs, ks)]

    def _lookup(self, seq: Sequence, k: int) -> Proposal:
        """The tokens after the latest earlier occurrence of the sequence's last n tokens, longest n
        first. The index holds every n-gram ending before the last token, kept up to date as tokens
        arrive (a sequence only grows between steps), so a lookup is a few dictionary reads."""
        tokens = seq.token_ids
        done, ends = self.index.get(seq.request_id, (0, {}))
        low, high = self.config.ngram_min, self.config.ngram_max
        for end in range(max(done, 0), len(tokens) - 1):  # n-grams ending at `end`, the last token excluded
            for n in range(low, min(high, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.index[seq.request_id] = (len(tokens) - 1, ends)
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            end = ends.get(tuple(tokens[len(tokens) - n :]))
            if end is None:
                continue
            follow = tokens[end + 1 : end + 1 + k]
            cut = next((i for i, t in enumerate(follow) if t in self.never), len(follow))
            if cut:
                return Proposal(follow[:cut])
        return Proposal()

    def forget(self, seq: Sequence) -> None:
        self.index.pop(seq.request_id, None)


class ModelDraft:
    costs_rounds = True  # every proposing round is one forward of the draft over the batch

    def __init__(self, config: SpeculativeConfig, target, **engine_args):
        """`target`: the engine this drafts for; the draft runs in an engine of the same class."""
        self.config = config
        self.engine = type(target)(config.draft, **engine_args)
        if self.engine.is_vlm:
            raise SourceError(f"draft {config.draft}: a draft is a text model; a VLM target takes a text draft")
        self.target_vocab = target.model.config.vocab_size
        self.token_map = None
        token_ids = draft_token_ids(self.engine.model.config)
        if token_ids is not None:
            self.engine.model.lm_head, self.token_map = reduced_head(self.engine.model.lm_head, token_ids, config.draft)
        _check_tokenizers(target.tokenizer, self.engine.tokenizer, self.token_map, config.draft)
        self.filler = self.engine.tokenizer.eos_token_id or 0  # stands in for ids the draft cannot read
        self.mirrors: dict[str, Sequence] = {}
        self.round_seconds: list[float] = []  # the last propose's decode-like rounds, for the planner

    def forget(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(seq.request_id, None)
        if mirror is not None:
            self.engine.blocks.release(mirror)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal() for _ in seqs]
        work = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k and (mirror := self._sync(seq, k)) is not None:
                work.append((i, seq, mirror, k))
        rounds = max((k for *_, k in work), default=0)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in work}
        self.round_seconds = []
        for r in range(rounds):
            active = [(i, seq, mirror) for i, seq, mirror, k in work if k > r]
            chunks = [mirror.pending for _, _, mirror in active]
            with Timer(self.engine.device) as timer:
                logits = self._run([m for *_, m in active], chunks)
            if max(chunks) <= 2:  # what a round costs once caught up (a first prefill is paid once)
                self.round_seconds.append(timer.seconds)
            for (i, seq, mirror), chunk, row in zip(active, chunks, logits, strict=True):
                mirror.computed += chunk
                token, q = self._pick(row, seq, proposals[i].tokens)
                proposals[i].tokens.append(token)
                if q is not None:
                    probs[i].append(q)
                mirror.token_ids.append(self._readable(token))
        for i, rows in probs.items():
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals

    def _run(self, mirrors: list[Sequence], chunks: list[int]) -> torch.Tensor:
        """Logits after each mirror's last token. Catching up on the few tokens a verification
        kept runs as a verification-shaped decode step (the decode path, compiled when the engine
        is) and keeps each chunk's last row. A mirror's first, prompt-long chunk, or one that fell
        more than k + 1 tokens behind (its sequence proposed nothing for a while), is a prefill."""
        if max(chunks) == 1:
            return self.engine.runner.run(Scheduled(prefill=False, seqs=mirrors, chunks=chunks))
        if any(m.computed == 0 for m in mirrors) or max(chunks) > self.config.k + 1:
            return self.engine.runner.run(Scheduled(prefill=True, seqs=mirrors, chunks=chunks))
        rows = self.engine.runner.run(Scheduled(prefill=False, seqs=mirrors, chunks=chunks, verify=True))
        last = torch.tensor(chunks, device=rows.device).cumsum(0) - 1
        return rows[last]

    def _sync(self, seq: Sequence, k: int) -> Sequence | None:
        """The mirror of `seq`, rolled back to the tokens the two share and given blocks for k
        more; None when the draft's cache has no room (the sequence then proposes nothing)."""
        tokens = [self._readable(t) for t in seq.token_ids]
        mirror = self.mirrors.get(seq.request_id)
        if mirror is None:
            mirror = Sequence(tokens, SamplingParams(temperature=0), request_id=seq.request_id)
            if not self.engine.blocks.can_allocate(mirror):
                return None
            self.engine.blocks.allocate(mirror)
            mirror.status = Status.RUNNING
            self.mirrors[seq.request_id] = mirror
        else:
            shared = 0
            for mine, theirs in zip(mirror.token_ids, tokens):
                if mine != theirs:
                    break
                shared += 1
            mirror.computed = min(mirror.computed, shared)
            mirror.token_ids = tokens
        if mirror.computed == len(tokens):
            mirror.computed -= 1  # the last token's logits are needed: run it again
        # The last of k proposals is never fed back, so k - 1 new positions beyond the tokens.
        needed = self.engine.blocks.blocks_needed(len(tokens) + k - 1) - len(mirror.block_table)
        if needed > self.engine.blocks.num_free:
            return None
        mirror.token_ids = tokens + [0] * (k - 1)
        self.engine.blocks.append(mirror)
        mirror.token_ids = tokens
        return mirror

    def _readable(self, token: int) -> int:
        """The id the draft reads for a target token (image placeholders lie past its vocabulary)."""
        limit = self.engine.model.embed_tokens.num_embeddings
        return token if 0 <= token < limit else self.filler

    def _pick(self, row: torch.Tensor, seq: Sequence, so_far: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft's next token in the target's ids, and its distribution when sampling."""
        full = row if self.token_map is None else _widen(row, self.token_map, self.target_vocab)
        if seq.params.greedy:
            return int(penalised(full, seq.params, seq.token_ids + so_far).argmax()), None
        q = distribution(full, seq.params, seq.token_ids + so_far)
        return draw(q, seq.generator), q


def _widen(row: torch.Tensor, token_map: torch.Tensor, vocab: int) -> torch.Tensor:
    """Reduced-vocabulary logits placed at their target ids; every other id scores -inf."""
    full = torch.full((vocab,), -torch.inf, dtype=row.dtype, device=row.device)
    full[token_map] = row
    return full


def draft_token_ids(config) -> list[int] | None:
    """The reduced output vocabulary a draft's config names (None: the full one)."""
    draft = getattr(config, "surgeon_draft", None) or {}
    return draft.get("token_ids")


def reduced_head(head: torch.nn.Linear, token_ids: list[int], where: str) -> tuple[torch.nn.Linear, torch.Tensor]:
    """The head's rows for `token_ids` as a head of its own, and those ids as a tensor."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=head.weight.device)
    if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= head.weight.shape[0]:
        raise SourceError(f"draft {where}: surgeon_draft.token_ids must be ids of its vocabulary")
    reduced = torch.nn.Linear(head.weight.shape[1], len(ids), bias=False, device="meta")
    reduced.weight = torch.nn.Parameter(head.weight[ids].clone(), requires_grad=False)
    return reduced, ids


def _check_tokenizers(target, draft, token_map, where: str) -> None:
    """The draft must read and write the target's token ids."""
    mine, theirs = draft.get_vocab(), target.get_vocab()
    if mine != theirs:
        different = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise SourceError(
            f"draft {where}: its tokenizer differs from the target's (first differences: {different}); "
            "a draft must share the target's vocabulary"
        )
    if token_map is not None and int(token_map.max()) >= len(theirs):
        raise SourceError(f"draft {where}: surgeon_draft.token_ids names ids past the target's vocabulary")
