"""Training data for healing: text, jsonl (text or chat), local datasets, and self-distillation,
packed into fixed windows with a loss mask, shuffled with a seed, with a held-out split.

Every document becomes (token ids, mask) where mask[i] says whether token i is a training
target; documents are joined with EOS and cut into windows that start with BOS (as evaluation
windows do). The result is a pure function of the sources, the tokenizer and the seed, which is
what lets an interrupted run resume with exactly the same batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..chat import Document, render_chat
from ..checkpoints.atomic import atomic_folder
from ..checkpoints.cache import cache_dir
from ..errors import DataError
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
    windows, masks = [], []
    for index, source in enumerate(data.sources):
        docs = _documents(source, files.get(index, []), tokenizer, data.assistant_only, teacher, teacher_fingerprint)
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
    return TrainSet(train_ids, train_mask, ids[:held], mask[:held])


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


def _documents(
    source: DataSource, files: list[Path], tokenizer, assistant_only: bool, teacher, fingerprint: str
) -> list[Document]:
    if source.kind == "text":
        return [_plain(tokenizer, path.read_text(encoding="utf-8", errors="replace")) for path in files]
    if source.kind == "jsonl":
        return [_record(tokenizer, record, assistant_only, where) for record, where, _ in read_jsonl(files)]
    if source.kind == "dataset":
        return [
            _record(tokenizer, record, assistant_only, f"{source.dataset} row {i}", source.field)
            for i, record in enumerate(_dataset_records(source, files))
        ]
    chats = self_distill_chats(source.self_distill, tokenizer, teacher, fingerprint)
    return [render_chat(tokenizer, messages, assistant_only) for messages in chats]


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


def self_distill_chats(spec: SelfDistill, tokenizer, teacher, fingerprint: str) -> list[list[dict]]:
    """Conversations whose assistant turns the teacher wrote; cached on disk by teacher and settings."""
    key = hashlib.sha256(json.dumps([fingerprint, spec.model_dump()], sort_keys=True).encode()).hexdigest()[:20]
    target = cache_dir("self_distill") / key
    if (target / "chats.json").is_file():
        return json.loads((target / "chats.json").read_text())
    if teacher is None:
        raise DataError("self_distill needs the teacher model")
    chats = _generate(spec, tokenizer, teacher)
    with atomic_folder(target, existing="keep") as tmp:
        (tmp / "chats.json").write_text(json.dumps(chats))
    return chats


@torch.inference_mode()
def _generate(spec: SelfDistill, tokenizer, teacher) -> list[list[dict]]:
    from tqdm.auto import tqdm

    prompts = [p for p in spec.prompts for _ in range(spec.samples)]
    generator = torch.Generator().manual_seed(0)
    chats, batch = [], 16
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in tqdm(range(0, len(prompts), batch), desc="self-distill", unit="batch", leave=False):
            group = prompts[start : start + batch]
            conversations = [
                ([{"role": "system", "content": spec.system}] if spec.system else []) + [{"role": "user", "content": p}]
                for p in group
            ]
            texts = [
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = (
                {"do_sample": True, "temperature": spec.temperature} if spec.temperature > 0 else {"do_sample": False}
            )
            if spec.temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
            out = teacher.generate(
                **inputs, max_new_tokens=spec.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
            for conversation, row in zip(conversations, out[:, inputs["input_ids"].shape[1] :], strict=True):
                reply = tokenizer.decode(row, skip_special_tokens=True).strip()
                chats.append(conversation + [{"role": "assistant", "content": reply}])
    finally:
        tokenizer.padding_side = old_side
    return chats
