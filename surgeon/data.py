"""Text for calibration and evaluation: files or globs, tokenised and cut into fixed windows."""

from __future__ import annotations

import glob
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from .errors import DataError, ParamError

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


def resolve_text_files(data: TextData, base_dir: Path) -> list[Path]:
    """The files `data` names, in a stable order; ParamError (pointing at `text`) when one is missing."""
    files: list[Path] = []
    for index, pattern in enumerate(data.patterns()):
        node = ("text",) if isinstance(data.text, str) else ("text", index)
        path = Path(pattern).expanduser()
        full = path if path.is_absolute() else base_dir / path
        if any(ch in pattern for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if Path(p).is_file())
            if not found:
                raise ParamError(("text",), f"no file matches {pattern!r} (looked in {full.parent})", node=node)
            files.extend(found)
        elif full.is_file():
            files.append(full)
        else:
            raise ParamError(("text",), f"no such file: {pattern} (resolved to {full.resolve()})", node=node)
    return files


def token_windows(tokenizer, files: list[Path], data: TextData) -> torch.Tensor:
    """LongTensor [n_windows, window] of consecutive text, each window starting with BOS if asked.

    `tokens` is a budget: n_windows = tokens // window (at least one). Files are read only as far
    as the budget needs, so a 16K-token calibration set does not tokenise a whole novel.
    """
    bos_id = tokenizer.bos_token_id
    use_bos = data.bos if data.bos is not None else bos_id is not None
    if use_bos and bos_id is None:
        raise DataError("bos: true, but the tokenizer defines no BOS token")
    n_windows = max(1, data.tokens // data.window)
    per_window = data.window - (1 if use_bos else 0)
    needed = n_windows * per_window
    stream: list[int] = []
    for path in files:
        stream.extend(_tokenize_prefix(tokenizer, path, needed - len(stream)))
        if len(stream) >= needed:
            break
    available = len(stream) // per_window
    if available == 0:
        names = ", ".join(p.name for p in files)
        raise DataError(f"{names}: only {len(stream)} tokens, fewer than one window of {data.window}")
    if available < n_windows:
        log.warning("text has %d windows of %d tokens, fewer than the %d asked for", available, data.window, n_windows)
        n_windows = available
    body = torch.tensor(stream[: n_windows * per_window], dtype=torch.long).view(n_windows, per_window)
    if use_bos:
        body = torch.cat([torch.full((n_windows, 1), bos_id, dtype=torch.long), body], dim=1)
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
    """"emma.txt, persuasion.txt (+3 more)": short enough for a log line or a model card."""
    return ", ".join(f.name for f in files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
