"""Training progress for whoever watches (the Gradio studio's loss plot); the terminal has tqdm.

    with watch_training(lambda event: print(event["step"], event["loss"])):
        run_recipe(recipe)

Listeners live in a context variable, so a run on one thread reports only to the listeners that
thread registered: two studio runs in one process do not see each other's steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Listener = Callable[[dict], None]
_listeners: ContextVar[tuple[Listener, ...]] = ContextVar("surgeon_training_listeners", default=())


@contextmanager
def watch_training(listener: Listener) -> Iterator[None]:
    """Call `listener(event)` after every optimizer step run inside this block. An event holds
    `desc` (which loop), `step`, `steps` (the total) and the step's measures (loss, kl, ...)."""
    token = _listeners.set(_listeners.get() + (listener,))
    try:
        yield
    finally:
        _listeners.reset(token)


def report_step(event: dict) -> None:
    for listener in _listeners.get():
        listener(event)
