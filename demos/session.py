"""The model the chat talks to, on an engine thread of its own (surgeon.engine.loop.EngineLoop).

Gradio runs handlers concurrently and LLM is not thread-safe; the engine loop is the one thread that
touches it, and it batches concurrent chats together. The studio swaps the model with `open`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

from surgeon.engine import LLM, SamplingParams
from surgeon.engine.loop import EngineLoop

from .model_choice import ModelChoice


class ChatSession:
    def __init__(self, choice: ModelChoice, engine_options: dict | None = None):
        self.engine_options = dict(engine_options or {})
        self._swap = threading.Lock()
        self.choice: ModelChoice
        self.name = ""
        self.is_vlm = False
        self._engine: EngineLoop | None = None
        self.open(choice)

    def open(self, choice: ModelChoice) -> None:
        """Load `choice` and serve it from now on; chats already streaming from the old engine end."""
        llm = LLM(choice.path, **self.engine_options)  # loads before the swap: a bad path changes nothing
        engine = EngineLoop(llm).start()
        with self._swap:
            old, self._engine = self._engine, engine
            self.choice, self.name, self.is_vlm = choice, llm.model_name, llm.is_vlm
            self.speculation = llm.speculator.config if llm.speculator is not None else None
        if old is not None:
            old.stop()

    async def stream(self, messages: list[dict], images: list, params: SamplingParams) -> AsyncIterator[str]:
        """The reply's new text as it comes. ValueError: the engine refused the request."""
        handle = await self._engine.submit(messages, params, images or None)
        try:
            async for out in handle:
                if out.text:
                    yield out.text
        finally:
            handle.abort()  # the user pressed stop or left: free the request's KV blocks

    @property
    def speculative(self) -> bool:
        return self.speculation is not None

    @property
    def speculation_label(self) -> str:
        if self.speculation is None:
            return "off: no draft"
        what = "n-gram lookup" if self.speculation.method == "ngram" else f"draft {self.speculation.draft}"
        return f"{what}, k up to {self.speculation.k}"

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
