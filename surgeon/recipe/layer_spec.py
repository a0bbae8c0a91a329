"""Layer lists as recipes write them: indices and inclusive ranges, e.g. `[3, "10-12"]`."""

from __future__ import annotations

from ..errors import ParamError

LayerList = list[int | str]


def expand_layers(spec: LayerList, n_layers: int, path: tuple) -> list[int]:
    """[3, "10-12"] -> [3, 10, 11, 12]; ranges are inclusive; every index checked against n_layers."""
    out: list[int] = []
    for position, item in enumerate(spec):
        node = path + (position,)
        if isinstance(item, bool):
            raise ParamError(path, f"expected a layer index or a range like '13-18', got {item!r}", node=node)
        if isinstance(item, int):
            indices = [item]
        else:
            first, sep, last = str(item).partition("-")
            if not (sep and first.strip().isdigit() and last.strip().isdigit()):
                raise ParamError(path, f"expected a layer index or a range like '13-18', got {item!r}", node=node)
            a, b = int(first), int(last)
            if b < a:
                raise ParamError(path, f"range {item!r} is empty (write the smaller index first)", node=node)
            indices = list(range(a, b + 1))
        for index in indices:
            if index < 0 or index >= n_layers:
                raise ParamError(path, f"index {index} out of range (model has {n_layers} layers)", node=node)
        out.extend(indices)
    return out


def format_ranges(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
