"""Training data for healing: text, jsonl (text or chat), local datasets, and self-distillation,
packed into fixed windows with a loss mask, shuffled with a seed, with a held-out split.

Every document becomes (token ids, mask) where mask[i] says whether token i is a training
target; documents are joined with EOS and cut into windows that start with BOS (as evaluation
windows do). The result is a pure function of the sources, the tokenizer and the seed, which is
what lets an interrupted run resume with exactly the same batches.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..answers import answer, answers_key, cached_entry, estimate_seconds
from ..chat import Document, render_chat
from ..errors import DataError
from ..prompts import conversations, follow_ups
from ..text import read_jsonl
from .heal_data import DataSource, HealData, SelfDistill

log = logging.getLogger(__name__)


@dataclass
class TrainSet:
    """[N, window] ids and targets mask (mask[:, t] says whether position t's prediction counts)."""

    train_ids: torch.Tensor
    train_mask: torch.Tensor
    heldout_ids: torch.Tensor
    heldout_mask: torch.Tensor
    generated: list[SelfDistilled] = field(default_factory=list)  # what self_distill sources generated

    @property
    def train_tokens(self) -> int:
        return int(self.train_mask.sum())

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in (self.train_ids, self.train_mask, self.heldout_ids, self.heldout_mask):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]


def build_train_set(
    data: HealData, files: dict[int, list[Path]], tokenizer, teacher=None, teacher_fingerprint=""
) -> TrainSet:
    windows, masks, generated = [], [], []
    for index, source in enumerate(data.sources):
        if source.kind == "self_distill":
            made = self_distill_chats(
                source.self_distill, files.get(index, {}), tokenizer, teacher, teacher_fingerprint
            )
            generated.append(made)
            docs = [render_chat(tokenizer, messages, data.assistant_only) for messages in made.chats]
        else:
            docs = _documents(source, files.get(index, []), tokenizer, data.assistant_only)
        ids, mask = _pack(docs, tokenizer, data.window, source.tokens)
        if ids.shape[0] == 0:
            raise DataError(
                f"data.sources[{index}] ({source.kind}) gives fewer tokens than one window of {data.window}"
            )
        windows.append(ids)
        masks.append(mask)
    ids, mask = torch.cat(windows), torch.cat(masks)
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(data.seed))
    ids, mask = ids[order], mask[order]
    held = min(data.heldout_windows, max(0, ids.shape[0] - 1))
    train_ids, train_mask = ids[held:], mask[held:]
    if data.tokens is not None:
        keep = max(1, data.tokens // data.window)
        train_ids, train_mask = train_ids[:keep], train_mask[:keep]
    log.info(
        "heal data: %d training windows of %d (%d target tokens), %d held out",
        train_ids.shape[0],
        data.window,
        int(train_mask.sum()),
        held,
    )
    return TrainSet(train_ids, train_mask, ids[:held], mask[:held], generated)


def _pack(docs: list[Document], tokenizer, window: int, cap: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Join documents with EOS and cut into windows that start with BOS (when the tokenizer has one)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    body = window - (1 if bos is not None else 0)
    stream: list[int] = []
    targets: list[bool] = []
    for doc in docs:
        stream.extend(doc.ids)
        targets.extend(doc.mask)
        if eos is not None:
            stream.append(eos)
            targets.append(bool(doc.mask[-1]) if doc.mask else False)
        if cap is not None and len(stream) >= cap + body:
            break
    n = len(stream) // body
    if cap is not None:
        n = min(n, max(1, cap // window))
    ids = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    # Position t predicts token t+1: a target token at t+1 makes position t count.
    is_target = torch.tensor(targets[: n * body], dtype=torch.bool).view(n, body)
    if bos is not None:
        ids = torch.cat([torch.full((n, 1), bos, dtype=torch.long), ids], dim=1)
        is_target = torch.cat([torch.zeros(n, 1, dtype=torch.bool), is_target], dim=1)
    mask = torch.zeros_like(is_target)
    mask[:, :-1] = is_target[:, 1:]
    return ids, mask


def _documents(source: DataSource, files: list[Path], tokenizer, assistant_only: bool) -> list[Document]:
    if source.kind == "text":
        return [_plain(tokenizer, path.read_text(encoding="utf-8", errors="replace")) for path in files]
    if source.kind == "jsonl":
        return [_record(tokenizer, record, assistant_only, where) for record, where, _ in read_jsonl(files)]
    if source.kind == "dataset":
        return [
            _record(tokenizer, record, assistant_only, f"{source.dataset} row {i}", source.field)
            for i, record in enumerate(_dataset_records(source, files))
        ]
    raise DataError(f"{source.kind} is not a text source")


def _plain(tokenizer, text: str) -> Document:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Document(ids, [True] * len(ids))


def _record(tokenizer, record: Any, assistant_only: bool, where: str, field: str = "text") -> Document:
    if isinstance(record, dict) and "messages" in record:
        return render_chat(tokenizer, record["messages"], assistant_only, where)
    if isinstance(record, dict) and isinstance(record.get(field), str):
        return _plain(tokenizer, record[field])
    raise DataError(f"{where}: expected a '{field}' string or a 'messages' list")


def _dataset_records(source: DataSource, files: list[Path]):
    import datasets

    try:
        loaded = datasets.load_dataset(source.dataset, data_files=[str(f) for f in files], split=source.split)
    except Exception as exc:  # datasets raises many types; the message is what matters
        raise DataError(f"dataset {source.dataset!r} from {[f.name for f in files]}: {exc}") from None
    return iter(loaded)


def self_distill_chats(
    spec: SelfDistill, files: dict[str, list[Path]], tokenizer, teacher, fingerprint: str
) -> SelfDistilled:
    """Conversations whose assistant turns the teacher wrote (through the engine; cached on disk by
    teacher, prompts and settings)."""
    prompts, chats, asked = _requests(spec, files)
    key = answers_key(fingerprint, chats, asked, spec.settings())
    if teacher is None and cached_entry(key) is None:
        raise DataError("self_distill needs the teacher model")
    answered = answer(teacher, tokenizer, chats, spec.settings(), fingerprint, asked)
    return SelfDistilled(answered.chats, len(prompts), answered.seconds, answered.tokens, answered.cached)


def _requests(spec: SelfDistill, files: dict[str, list[Path]]) -> tuple[list, list, list]:
    """(distinct prompts, the conversations the teacher answers: `samples` of each, their follow-ups)."""
    prompts = conversations(spec, files)
    chats = [chat for chat in prompts for _ in range(spec.samples)]
    return prompts, chats, follow_ups(len(chats), spec.follow_up, spec.seed)


def describe_self_distill(spec: SelfDistill, files: dict[str, list[Path]], fingerprint: str) -> str:
    """For `plan`: how many conversations, and whether they are cached or how long making them takes."""
    prompts, chats, asked = _requests(spec, files)
    follow = sum(q is not None for q in asked)
    what = f"{len(chats)} teacher answers to {len(prompts)} prompts" + (
        f", {follow} with a follow-up" if follow else ""
    )
    entry = cached_entry(answers_key(fingerprint, chats, asked, spec.settings()))
    if entry is not None:
        return f"{what} (cached; generating them took {entry['seconds'] / 60:.1f} min)"
    seconds, rate = estimate_seconds(len(chats), follow, spec.settings())
    return f"{what} (not cached: about {seconds / 60:.1f} min to generate at {rate})"


@dataclass
class SelfDistilled:
    chats: list[list[dict]]
    prompts: int  # distinct prompts before samples
    seconds: float  # generation time (0 when cached)
    tokens: int
    cached: bool
