"""The one place a path a user wrote (in a recipe, a data file, on the command line) meets the OS.

`user_path` makes it absolute and asks the OS about it once, turning every refusal (a NUL byte,
a name too long, a folder it may not read, an unknown ~user) into a PathRefused with a plain
reason, which callers re-raise as their located error (recipe file:line, data file:line). The path
is returned as written, not resolved: a symlink keeps its own name and folder (a Hugging Face cache
links model.gguf to an extensionless blob), and a glob keeps its meaning.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import SurgeonError


class PathRefused(SurgeonError):
    """A path the OS cannot look up; the message says why, without where (callers add that)."""


def user_path(raw: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> Path:
    """`raw` (with ~ expanded; relative to `base_dir`, else the current folder) as an absolute
    path the OS has looked at: it may not exist, but is_file() / is_dir() / open() on it can only
    fail for the ordinary reasons after this returns."""
    text = os.fspath(raw)
    if "\x00" in text:
        raise PathRefused(f"{text!r} contains a NUL byte, which no file name can hold")
    try:
        path = Path(text).expanduser()
        if not path.is_absolute():
            path = Path(os.path.abspath(base_dir if base_dir is not None else os.curdir)) / path
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass  # missing (or a file used as a folder on the way) is an answer the caller words
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise PathRefused(f"{text!r}: {exc.strerror or exc}") from None
    except (ValueError, RuntimeError) as exc:  # RuntimeError: ~user with no home folder
        raise PathRefused(f"{text!r}: {exc}") from None
    return path
