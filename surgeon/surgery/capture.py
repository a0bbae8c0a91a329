"""Forward hooks as context managers: see what enters or leaves modules during forward passes (or
feed a module a different input), with every hook removed on exit however the block ends. The
calibration passes of drop_layers, reduce_kv_heads, the attention fit, `surgeon analyze` and the
distillation forward all hook through here."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch


def hidden_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden state a module was called with (decoder layers take it positionally or by name)."""
    return args[0] if args else kwargs["hidden_states"]


def hidden_output(output) -> torch.Tensor:
    """A module's hidden-state output (attention modules return (hidden, weights))."""
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def on_input(
    modules: Mapping[Hashable, torch.nn.Module], take: Callable[[Hashable, torch.Tensor, dict], None]
) -> Iterator[None]:
    """While open, `take(key, hidden, kwargs)` sees the hidden state entering each module (and the
    other keyword arguments it was called with)."""
    with ExitStack() as hooks:
        for key, module in modules.items():

            def hook(_module, args, kwargs, key=key):
                take(key, hidden_input(args, kwargs), kwargs)

            hooks.callback(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
        yield


@contextmanager
def on_output(
    modules: Mapping[Hashable, torch.nn.Module], take: Callable[[Hashable, torch.Tensor], None]
) -> Iterator[None]:
    """While open, `take(key, hidden)` sees the hidden state leaving each module."""
    with ExitStack() as hooks:
        for key, module in modules.items():

            def hook(_module, _args, output, key=key):
                take(key, hidden_output(output))

            hooks.callback(module.register_forward_hook(hook).remove)
        yield


@contextmanager
def feeding(module: torch.nn.Module, hidden: torch.Tensor) -> Iterator[None]:
    """While open, `module` is called with `hidden` in place of the hidden state it is given."""

    def hook(_module, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
