"""Checkpoints named by a Hugging Face Hub id ("org/name"): fetched once into the Hub's own cache
(safetensors, configs and tokenizer files only, never pickles) and read from there afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import SourceError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Code files come too: they only run for a source whose recipe sets trust_remote_code.
WANTED_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja", "*.py"]


def looks_like_hub_id(spec: str) -> bool:
    return bool(HUB_ID.match(spec)) and not spec.startswith((".", "~"))


def hub_snapshot(repo_id: str, download: bool) -> Path | None:
    """The local snapshot folder of `repo_id`; None when it is not cached and `download` is false."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=WANTED_FILES, local_files_only=not download))
    except LocalEntryNotFoundError:
        if not download:
            return None
        raise SourceError(_unreachable(repo_id, "not in the local Hub cache, and the Hub cannot be reached")) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise SourceError(_unreachable(repo_id, str(exc).splitlines()[0])) from None
    if not (folder / "config.json").is_file():
        if not download:
            return None
        raise SourceError(f"Hub model '{repo_id}' has no config.json (fetched to {folder}): not a transformers model")
    if not _complete(folder):  # only the config was fetched so far (plan reads it alone)
        if not download:
            return None
        raise SourceError(_unreachable(repo_id, "the local copy has no weights and the Hub did not send them"))
    return folder


def _complete(folder: Path) -> bool:
    """Every weight file is there: all shards an index names, else at least one safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors"))


def hub_config_folder(repo_id: str) -> Path:
    """A folder holding at least the repository's config.json (downloads that one file if needed)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "config.json")).parent
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise SourceError(_unreachable(repo_id, str(exc).splitlines()[0])) from None


def _unreachable(repo_id: str, why: str) -> str:
    return (
        f"'{repo_id}' is neither a surgeon alias nor a local folder, and as a Hugging Face Hub id it could not "
        f"be fetched ({why}); download it first (huggingface-cli download {repo_id}) or name a local folder"
    )
