"""Where surgeon keeps converted checkpoints and parent logits between runs."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
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


def temporary_sibling(target: Path) -> Path:
    """A fresh hidden path beside `target`, on the same filesystem so a rename is atomic."""
    return target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def atomic_directory(target: Path):
    """Yield a temporary folder; on success it becomes `target` (first writer wins), else it is removed.

    Used for cache entries, where another process may have produced the same entry meanwhile.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # someone else finished first: theirs is as good
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
