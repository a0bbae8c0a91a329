"""Text for calibration and evaluation: files or globs, tokenised and cut into fixed windows; and
the two file readers every data source shares (patterns to files, jsonl to records)."""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field

from .errors import DataError, ParamError
from .paths import PathRefused, user_path

log = logging.getLogger(__name__)


class TextData(BaseModel):
    """`text`: a file, a glob or a list of them (relative to the recipe); `tokens`: how many tokens to
    use; `window`: tokens per window, BOS included; `bos`: start each window with BOS (default: when
    the tokenizer defines one)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str]
    tokens: int = Field(8192, gt=0)
    window: int = Field(512, ge=8, le=131072)
    bos: bool | None = None

    def patterns(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def n_windows(self) -> int:
        """How many windows the `tokens` budget asks for (at least one; the text may hold fewer)."""
        return max(1, self.tokens // self.window)


def resolve_text_files(data: TextData, base_dir: Path) -> list[Path]:
    return resolve_files(data.text, base_dir, "text")


def resolve_files(patterns: str | list[str], base_dir: Path, field: str) -> list[Path]:
    """The files named by a pattern or list of patterns (globs allowed), in a stable order.

    Relative paths are taken from `base_dir` (the recipe's folder). A missing file raises a
    ParamError pointing at `field` (and at the list item, for a list).
    """
    files: list[Path] = []
    single = isinstance(patterns, str)
    for index, pattern in enumerate([patterns] if single else patterns):
        node = (field,) if single else (field, index)
        try:
            full = user_path(pattern, base_dir)
        except PathRefused as exc:
            raise ParamError((field,), str(exc), node=node) from None
        if any(ch in pattern for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if Path(p).is_file())
            if not found:
                raise ParamError((field,), f"no file matches {pattern!r} (looked in {full.parent})", node=node)
            files.extend(found)
        elif full.is_file():
            files.append(full)
        else:
            raise ParamError((field,), f"no such file: {pattern} (resolved to {full})", node=node)
    return files


def token_windows(tokenizer, files: list[Path], data: TextData) -> torch.Tensor:
    """LongTensor [n_windows, window] of consecutive text, each window starting with BOS if asked.

    `tokens` is a budget: n_windows = tokens // window (at least one), shared evenly between the
    files (five plays give a fifth each, not five times the first). Each file is read only as far
    as its share needs, so a 16K-token calibration set does not tokenise a whole novel.
    """
    bos_id = tokenizer.bos_token_id
    use_bos = data.bos if data.bos is not None else bos_id is not None
    if use_bos and bos_id is None:
        raise DataError("bos: true, but the tokenizer defines no BOS token")
    n_windows = data.n_windows()
    per_window = data.window - (1 if use_bos else 0)
    shares = [n_windows // len(files) + (1 if i < n_windows % len(files) else 0) for i in range(len(files))]
    rows: list[torch.Tensor] = []
    for path, share in zip(files, shares, strict=True):
        if share == 0:
            continue
        ids = _tokenize_prefix(tokenizer, path, share * per_window)
        got = min(share, len(ids) // per_window)
        if got < share:
            log.warning(
                "%s has %d windows of %d tokens, fewer than the %d asked for", path.name, got, data.window, share
            )
        if got:
            rows.append(torch.tensor(ids[: got * per_window], dtype=torch.long).view(got, per_window))
    if not rows:
        names = ", ".join(p.name for p in files)
        raise DataError(f"{names}: fewer tokens than one window of {data.window}")
    body = torch.cat(rows)
    if use_bos:
        body = torch.cat([torch.full((body.shape[0], 1), bos_id, dtype=torch.long), body], dim=1)
    return body


def _tokenize_prefix(tokenizer, path: Path, needed: int) -> list[int]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    # ~4 characters per token in English prose; read more than enough, then everything if short.
    budget = max(4096, needed * 8)
    ids: list[int] = []
    while True:
        chunk = text[:budget]
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        if len(ids) >= needed + 1 or budget >= len(text):
            break
        budget *= 2
    # The last token of a cut chunk may be a fragment of a longer word: drop it.
    return ids[:needed] if budget < len(text) else ids


def describe_files(files: list[Path]) -> str:
    """ "emma.txt, persuasion.txt (+3 more)": short enough for a log line or a model card."""
    return ", ".join(f.name for f in files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")


class JsonLine(NamedTuple):
    value: Any  # the parsed record
    where: str  # "file:line", for messages
    text: str  # the line as written (a stable key for the record)


def read_jsonl(files: list[Path]) -> Iterator[JsonLine]:
    """Every non-blank line of each file, parsed; a line that is not JSON raises DataError at file:line."""
    for path in files:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield JsonLine(json.loads(line), f"{path}:{number}", line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{number}: not JSON: {exc.msg}") from None
