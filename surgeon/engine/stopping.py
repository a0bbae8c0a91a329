"""When a sequence ends, and the text it may hand out so far.

Text is decoded from all output ids each time (tokenizers are fast; a token's text can depend on
its neighbours), held back while it ends in a partial UTF-8 character or could be the start of a
stop string, so a stream never shows text that a stop string later removes.
"""

from __future__ import annotations

from .sequence import Sequence


def repeating_period(tokens: list[int], window: int) -> int | None:
    """The shortest period p <= window / 4 with which the last `window` tokens repeat exactly (so
    at least four repeats), else None: degenerate looping, not a repeated phrase or two."""
    if window == 0 or len(tokens) < window:
        return None
    tail = tokens[-window:]
    for period in range(1, window // 4 + 1):
        if tail[period:] == tail[:-period]:
            return period
    return None


class Stopper:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> tuple[str, str | None]:
        """(new text to hand out, finish reason or None) after a token was appended."""
        params, completion = seq.params, seq.completion_ids
        reason = None
        if completion[-1] in self.eos_ids and not params.ignore_eos:
            reason, completion = "stop", completion[:-1]
        elif repeating_period(completion, params.loop_window) is not None:
            reason = "loop"
        elif len(seq) >= self.max_model_len or (params.max_tokens is not None and len(completion) >= params.max_tokens):
            reason = "length"
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        for stop in params.stop:
            at = text.find(stop, max(0, len(seq.text) - len(stop) + 1))
            if at >= 0:
                text, reason = text[:at], "stop"
        if reason is None:
            text = text[: len(text) - self._holdback(text, params.stop)]
        new = text[len(seq.text) :] if text.startswith(seq.text) else ""
        seq.text += new
        return new, reason

    @staticmethod
    def _holdback(text: str, stops: tuple[str, ...]) -> int:
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        longest = 0
        for stop in stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
