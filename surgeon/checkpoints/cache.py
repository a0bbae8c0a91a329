"""Where surgeon keeps converted checkpoints and parent logits between runs (entries are written
through atomic.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_root() -> Path:
    """`$SURGEON_CACHE`, else `$XDG_CACHE_HOME/surgeon`, else `~/.cache/surgeon`."""
    if os.environ.get("SURGEON_CACHE"):
        return Path(os.environ["SURGEON_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "surgeon"


def cache_dir(kind: str) -> Path:
    path = cache_root() / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def prune_entries(root: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Delete the least recently used entry folders under `root` until they hold at most `max_bytes`."""
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in entries}
    total = sum(sizes.values())
    for entry in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= max_bytes:
            break
        if entry == keep:
            continue
        total -= sizes[entry]
        shutil.rmtree(entry, ignore_errors=True)
