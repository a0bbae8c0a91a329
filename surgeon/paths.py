"""The one place a path a user wrote (in a recipe, a data file, on the command line) meets the OS.

`user_path` makes it absolute and asks the OS about it once, turning every refusal (a NUL byte,
a name too long, a folder it may not read) into a PathRefused with a plain reason, which callers
re-raise as their located error (recipe file:line, data file:line). Nothing else in surgeon
calls Path.resolve or os.stat on a user's string directly.
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
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else Path.cwd()) / path
    try:
        path = path.resolve()
        path.stat()
    except FileNotFoundError:
        pass  # missing is an answer, not a refusal: the caller says what it expected there
    except NotADirectoryError:
        pass  # a file used as a folder along the way: missing too, for every caller
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise PathRefused(f"{text!r}: {exc.strerror or exc}") from None
    except (ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop, on older Pythons
        raise PathRefused(f"{text!r}: {exc}") from None
    return path
