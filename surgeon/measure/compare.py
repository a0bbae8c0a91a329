"""`surgeon eval`: compare any two checkpoints on text, outside a recipe."""

from __future__ import annotations

from pathlib import Path

from ..checkpoints.sources import resolve_source
from ..errors import DataError, ParamError, SourceError
from ..text import TextData, resolve_text_files, token_windows
from .metrics import compare_to_parent, parent_reference


def evaluate_checkpoints(child: str, parent: str, data: list[str], tokens: int = 8192, window: int = 512) -> dict:
    """Metrics of `child` against `parent` (aliases, folders or .gguf files) on the text files `data`."""
    cwd = Path.cwd()
    child_source, parent_source = resolve_source(child, cwd), resolve_source(parent, cwd)
    if child_source.config.vocab_size != parent_source.config.vocab_size:
        raise SourceError(
            f"'{child}' and '{parent}' have different vocabularies "
            f"({child_source.config.vocab_size} vs {parent_source.config.vocab_size}): KL needs the same tokens"
        )
    spec = TextData(text=data, tokens=tokens, window=window)
    try:
        files = resolve_text_files(spec, cwd)
    except ParamError as exc:
        raise DataError(f"--data: {exc.message}") from None
    windows = token_windows(child_source.load_tokenizer(), files, spec)
    reference = parent_reference(parent_source.load_model, windows, parent_source.fingerprint())
    metrics = compare_to_parent(child_source.load_model(), windows, reference)
    return {"child": child, "parent": parent, "data": [str(f) for f in files], **metrics}
