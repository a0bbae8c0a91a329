"""Nothing half-written: every folder or file surgeon produces (exports, cache entries, training
checkpoints, analysis reports) is written under a temporary name beside its target and renamed into
place only once complete; a failure removes the temporary and leaves the target as it was."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal


def temporary_sibling(target: Path) -> Path:
    """A fresh hidden path beside `target`, on the same filesystem so a rename is atomic."""
    return target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def atomic_folder(target: Path, existing: Literal["replace", "keep"] = "replace") -> Iterator[Path]:
    """Yield an empty temporary folder; when the block succeeds it becomes `target`, else it is removed.

    A folder already at `target` is replaced (`replace`: a rerun's output, put back if the swap
    fails), or kept (`keep`: a cache entry another process finished first is as good as ours).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    tmp.mkdir()
    try:
        yield tmp
        if existing == "keep":
            _rename_unless_present(tmp, target)
        else:
            _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path for one file; on success it replaces `target`, else it is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _rename_unless_present(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    old = temporary_sibling(target)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)  # put the previous folder back
        raise
    shutil.rmtree(old, ignore_errors=True)
