"""The one way surgeon selects parameters: glob patterns over state-dict names.

`*` matches within one dotted component, `**` across components, `?` one character and `[1-3]`
one of a set. A pattern naming a module
selects everything beneath it: `model.layers.*.mlp` picks every MLP weight, `model.layers.1?`
everything in layers 10-19, `lm_head.weight` exactly that tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += r"[^.]*"
            i += 1
        elif pattern[i] == "?":
            out += r"[^.]"
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            out += (
                "[" + ("^" + re.escape(body[1:]) if body.startswith("!") else re.escape(body).replace(r"\-", "-")) + "]"
            )
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"(\..*)?\Z")


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(_compile(p).match(name) for p in patterns)


def select(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Names matching any pattern, in their original order."""
    patterns = list(patterns)
    return [n for n in names if matches(n, patterns)]


def unmatched_patterns(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Patterns that match none of `names` (almost always a typo worth reporting)."""
    names = list(names)
    return [p for p in patterns if not any(_compile(p).match(n) for n in names)]
