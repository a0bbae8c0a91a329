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
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..cache import atomic_directory, cache_dir
from ..data import resolve_files
from ..errors import DataError, ParamError

log = logging.getLogger(__name__)


class SelfDistill(BaseModel):
    """Prompts completed by the teacher itself (greedy unless `temperature` > 0), so healing needs
    no data files. Completions are cached per teacher and settings."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(min_length=1)
    max_new_tokens: int = Field(128, gt=0, le=4096)
    samples: int = Field(1, gt=0, le=64)
    temperature: float = Field(0.0, ge=0.0)
    system: str | None = None


class SyntheticImages(BaseModel):
    """Rendered image questions (surgeon.vision.synthetic): `examples` of the train stream."""

    model_config = ConfigDict(extra="forbid")

    examples: int = Field(gt=0, le=1_000_000)
    kinds: list[Literal["colour", "shape", "count", "position", "word"]] = ["colour", "shape", "count", "position", "word"]
    seed: int = 0
    split: Literal["train", "heldout"] = "train"


class MnistDigits(BaseModel):
    """"Which digit is this?" on a CSV of MNIST rows (784 pixels, then the label). `split`: `train`
    (per digit, the first 80% of its rows), `heldout` (the last 20%), or `rows` ("0-3999")."""

    model_config = ConfigDict(extra="forbid")

    path: str
    split: Literal["train", "heldout", "all"] = "train"
    rows: str | None = Field(None, pattern=r"^\d+-\d+$")
    examples: int | None = Field(None, gt=0)


class Source(BaseModel):
    """Exactly one of: `text` (files/globs), `jsonl` (records with `text` or chat `messages`; with
    `image`/`images` paths for a grafted VLM), `dataset` (a local file read by the `datasets`
    library: json, csv, parquet or text), `self_distill`, or for a VLM `synthetic` / `mnist`
    image questions. `tokens` caps what a text source contributes."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    jsonl: str | list[str] | None = None
    dataset: str | None = None
    data_files: str | list[str] | None = None
    split: str = "train"
    field: str = "text"
    self_distill: SelfDistill | None = None
    synthetic: SyntheticImages | None = None
    mnist: MnistDigits | None = None
    tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"each source needs exactly one of {', '.join(SOURCE_KINDS)}")
        if self.dataset is not None and self.data_files is None:
            raise ValueError("`dataset` needs `data_files` (local files; nothing is downloaded)")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in SOURCE_KINDS if getattr(self, k) is not None)


SOURCE_KINDS = ("text", "jsonl", "dataset", "self_distill", "synthetic", "mnist")
IMAGE_KINDS = ("synthetic", "mnist")  # jsonl may hold image records too


class HealData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[Source] = Field(min_length=1)
    window: int = Field(256, ge=16, le=32768)
    tokens: int | None = Field(None, gt=0)  # training-token budget over all sources
    heldout_windows: int = Field(8, ge=0)
    assistant_only: bool = False  # chat records train on assistant turns only (plain text: on everything)
    heldout_examples: int = Field(64, ge=0)  # image data: records kept out of training for held-out loss
    seed: int = 0


@dataclass
class Document:
    ids: list[int]
    mask: list[bool]


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


def check_sources(sources: list[Source], base_dir: Path, at: tuple = ("data", "sources")) -> dict[int, list[Path]]:
    """Files each source names, checked now (ParamError pointing at the source, under `at`)."""
    files: dict[int, list[Path]] = {}
    for index, source in enumerate(sources):
        where = (*at, index)
        patterns = {"text": source.text, "jsonl": source.jsonl, "dataset": source.data_files,
                    "mnist": source.mnist.path if source.mnist else None}.get(source.kind)
        if patterns is None:
            continue
        field = {"text": "text", "jsonl": "jsonl", "dataset": "data_files", "mnist": "mnist"}[source.kind]
        try:
            files[index] = resolve_files(patterns, base_dir, field)
        except ParamError as exc:
            raise exc.under(where) from None
    return files


def build_train_set(data: HealData, files: dict[int, list[Path]], tokenizer, teacher=None, teacher_fingerprint="") -> TrainSet:
    windows, masks = [], []
    for index, source in enumerate(data.sources):
        docs = _documents(source, files.get(index, []), tokenizer, data.assistant_only, teacher, teacher_fingerprint)
        ids, mask = _pack(docs, tokenizer, data.window, source.tokens)
        if ids.shape[0] == 0:
            raise DataError(f"data.sources[{index}] ({source.kind}) gives fewer tokens than one window of {data.window}")
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
    log.info("heal data: %d training windows of %d (%d target tokens), %d held out",
             train_ids.shape[0], data.window, int(train_mask.sum()), held)
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


def _documents(source: Source, files: list[Path], tokenizer, assistant_only: bool, teacher, fingerprint: str) -> list[Document]:
    if source.kind == "text":
        return [_plain(tokenizer, path.read_text(encoding="utf-8", errors="replace")) for path in files]
    if source.kind == "jsonl":
        return [_record(tokenizer, record, assistant_only, where) for record, where in _jsonl_records(files)]
    if source.kind == "dataset":
        return [_record(tokenizer, record, assistant_only, f"{source.dataset} row {i}", source.field)
                for i, record in enumerate(_dataset_records(source, files))]
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


def render_chat(tokenizer, messages: list[dict], assistant_only: bool, where: str = "chat") -> Document:
    """Render with the chat template; with assistant_only, only assistant turns are targets.

    Assistant spans are found by rendering each prefix of the conversation, which works for any
    template that renders a prefix as a prefix (ChatML, Llama, Gemma).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}}")
    if tokenizer.chat_template is None:
        raise DataError(f"{where}: chat data needs a tokenizer with a chat template")
    ids = chat_ids(tokenizer, messages, generation_prompt=False)
    mask = [not assistant_only] * len(ids)
    if assistant_only:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(chat_ids(tokenizer, messages[:i], generation_prompt=True))
            end = len(chat_ids(tokenizer, messages[: i + 1], generation_prompt=False))
            for t in range(start, min(end, len(ids))):
                mask[t] = True
    return Document(ids, mask)


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _jsonl_records(files: list[Path]):
    for path in files:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line), f"{path}:{number}"
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{number}: not JSON: {exc.msg}") from None


def _dataset_records(source: Source, files: list[Path]):
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
    with atomic_directory(target) as tmp:
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
            conversations = [([{"role": "system", "content": spec.system}] if spec.system else [])
                             + [{"role": "user", "content": p}] for p in group]
            texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = {"do_sample": True, "temperature": spec.temperature} if spec.temperature > 0 else {"do_sample": False}
            if spec.temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
            out = teacher.generate(**inputs, max_new_tokens=spec.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                   **sampling)
            for conversation, row in zip(conversations, out[:, inputs["input_ids"].shape[1]:], strict=True):
                reply = tokenizer.decode(row, skip_special_tokens=True).strip()
                chats.append(conversation + [{"role": "assistant", "content": reply}])
    finally:
        tokenizer.padding_side = old_side
    return chats

