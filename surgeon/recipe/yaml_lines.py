"""YAML loading that remembers the line of every node, so errors can say `file:line`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError


@dataclass
class LineMap:
    """Maps a path of keys and indices (("steps", 0, "drop_layers")) to a 1-based line number."""

    filename: str
    lines: dict[tuple, int] = field(default_factory=dict)

    def line(self, path: tuple) -> int:
        """The line of the deepest node on `path` that exists (a missing key points at its parent)."""
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def where(self, path: tuple) -> str:
        return f"{self.filename}:{self.line(path)}"


def format_path(path: tuple) -> str:
    """("steps", 0, "drop_layers", "layers") -> "steps[0].drop_layers.layers"."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def load_yaml(text: str, filename: str) -> tuple[Any, LineMap]:
    """Parse YAML text into plain Python values plus a LineMap of where each value was written."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, LineMap(filename)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise RecipeError([f"{filename}:{line}: invalid YAML: {exc.problem or exc}"]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([f"{filename}:1: invalid YAML: {exc}"]) from None
    finally:
        loader.dispose()
    lines: dict[tuple, int] = {}
    _record(node, (), lines, yaml.SafeLoader(""))
    return data, LineMap(filename, lines)


def load_yaml_file(path: str | Path) -> tuple[Any, LineMap, str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"{path}: no such recipe file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"{path}: cannot read recipe: {exc}"]) from None
    data, line_map = load_yaml(text, str(path))
    return data, line_map, text


def _record(node: yaml.Node, path: tuple, lines: dict[tuple, int], constructor: yaml.SafeLoader) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = constructor.construct_object(key_node)
            _record(value_node, path + (key,), lines, constructor)
            # A key's own line is where a reader looks for "unknown key" errors.
            lines[path + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record(item, path + (index,), lines, constructor)
