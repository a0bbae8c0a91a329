"""Training progress for whoever watches (the Gradio studio's loss plot), and a switch that stops
the run; the terminal has tqdm and Ctrl-C.

    with watch_training(lambda event: print(event["step"], event["loss"])), cancellable(stop):
        run_recipe(recipe)

Listeners and the switch live in context variables, so a run on one thread reports only to the
listeners that thread registered and stops only at its own switch: two studio runs in one process
do not see each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..errors import RunCancelled

Listener = Callable[[dict], None]
_listeners: ContextVar[tuple[Listener, ...]] = ContextVar("surgeon_training_listeners", default=())
_stop: ContextVar[threading.Event | None] = ContextVar("surgeon_run_stop", default=None)


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
    check_cancelled(f"at {event['desc']} step {event['step']} of {event['steps']}")


@contextmanager
def cancellable(stop: threading.Event) -> Iterator[None]:
    """Inside this block, setting `stop` ends the run with RunCancelled at its next check: after an
    optimizer step (a heal saves its checkpoint first, so --resume loses nothing) or between steps."""
    token = _stop.set(stop)
    try:
        yield
    finally:
        _stop.reset(token)


def check_cancelled(where: str) -> None:
    stop = _stop.get()
    if stop is not None and stop.is_set():
        raise RunCancelled(f"cancelled {where}")
