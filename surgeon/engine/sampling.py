"""What a request asks of the sampler and the stopping rules."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 turn those filters off; repetition_penalty 1
    is none (HF's rule: a seen token's positive logit is divided by it, a negative one multiplied).
    `seed` makes a sampled request reproducible whatever else is in its batch. `stop`: strings that
    end the output (not included in it). `loop_window`: tokens the loop detector looks back over
    (0 turns it off). `max_tokens=None`: until a stop or the end of the model's context.
    `refuse_overflow`: a max_tokens that cannot fit beside the prompt in the context is refused when
    the request is added (the server's rule, as OpenAI's and vLLM's); otherwise generation stops
    at the context's end with finish_reason "length". `speculate`: on an engine built with a
    speculative draft, whether this request proposes drafts (its output is the same either way)."""

    max_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    loop_window: int = 64
    refuse_overflow: bool = False
    speculate: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        checks = [
            (
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}"),
            (
                self.loop_window == 0 or self.loop_window >= 8,
                f"loop_window must be 0 (off) or >= 8, got {self.loop_window}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
