"""The recipe schema and its loader. Every problem is reported as `file:line: path: message`.

A recipe names a base model, optional other sources, an ordered list of steps (each one
operation with its parameters) and an export. Paths inside a recipe are relative to the recipe
file, so a recipe works from any current directory.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import RecipeError
from ..ops import OPERATIONS
from .step import BASE, PATIENT
from .yaml_lines import LineMap, format_path, load_yaml, load_yaml_file

DType = Literal["float32", "bfloat16", "float16"]
RESERVED_SOURCE_NAMES = (BASE, PATIENT, "parent")


class SourceSpec(BaseModel):
    """A checkpoint: an alias (`surgeon models`), a Hugging Face folder or a .gguf file; `modules`
    limits it to the tensors matching those globs."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    modules: list[str] | None = None
    dtype: DType = "float32"
    trust_remote_code: bool = False


def _source_shorthand(value: Any) -> Any:
    return {"model": value} if isinstance(value, str) else value


class PushSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    private: bool = False


GGUFType = Literal["f16", "bf16", "q8_0", "q4_0", "q4_1"]


class ExportSpec(BaseModel):
    """`path` defaults to out/NAME in the current directory; `dtype` converts the saved weights;
    `gguf`: a type or list of types, each also written as NAME.TYPE.gguf in the export folder."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    dtype: DType | None = None
    overwrite: bool = False
    push: PushSpec | None = None
    gguf: GGUFType | list[GGUFType] | None = None

    def gguf_types(self) -> list[str]:
        return [] if self.gguf is None else [self.gguf] if isinstance(self.gguf, str) else list(self.gguf)


class RecipeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=96)
    description: str | None = None
    base: SourceSpec
    sources: dict[str, SourceSpec] = {}
    steps: list[Any] = []
    export: ExportSpec = ExportSpec()

    _shorthand_base = field_validator("base", mode="before")(_source_shorthand)

    @field_validator("sources", mode="before")
    @classmethod
    def _shorthand_sources(cls, value):
        return {k: _source_shorthand(v) for k, v in value.items()} if isinstance(value, dict) else value

    @field_validator("export", mode="before")
    @classmethod
    def _empty_export(cls, value):
        return {} if value is None else value


@dataclass
class Step:
    op: str
    params: BaseModel
    index: int

    @property
    def label(self) -> str:
        return f"steps[{self.index}].{self.op}"


@dataclass
class Recipe:
    path: Path
    text: str
    spec: RecipeSpec
    steps: list[Step]
    lines: LineMap

    @property
    def directory(self) -> Path:
        return self.path.resolve().parent

    def where(self, path: tuple) -> str:
        return self.lines.where(path)

    def problem(self, path: tuple, message: str, node: tuple | None = None) -> str:
        return f"{self.lines.where(node if node is not None else path)}: {format_path(path)}: {message}"


def load_recipe(path: str | Path, text: str | None = None) -> Recipe:
    """Parse and schema-check a recipe file (no model is touched). Raises RecipeError. `text`: the
    recipe as edited but not saved (the studio), read as if it were the file at `path`."""
    path = Path(path)
    if text is None:
        data, lines, text = load_yaml_file(path)
    else:
        data, lines = load_yaml(text, str(path))
    if not isinstance(data, dict):
        raise RecipeError([f"{lines.where(())}: a recipe is a mapping with name, base, steps and export"])
    problems: list[str] = []
    spec = None
    try:
        spec = RecipeSpec.model_validate(data)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, data, lines, (), RecipeSpec))
    steps: list[Step] = []
    raw_steps = data.get("steps")
    if isinstance(raw_steps, list):
        for index, item in enumerate(raw_steps):
            step, step_problems = _parse_step(item, index, lines)
            problems.extend(step_problems)
            if step is not None:
                steps.append(step)
    if spec is not None:
        for name in spec.sources:
            if name in RESERVED_SOURCE_NAMES:
                problems.append(
                    f"{lines.where(('sources', name))}: sources.{name}: '{name}' is reserved "
                    f"({', '.join(RESERVED_SOURCE_NAMES)} have fixed meanings); choose another name"
                )
    if problems:
        raise RecipeError(problems)
    return Recipe(path=path, text=text, spec=spec, steps=steps, lines=lines)


def _parse_step(item: Any, index: int, lines: LineMap) -> tuple[Step | None, list[str]]:
    here = ("steps", index)
    if not isinstance(item, dict) or len(item) != 1:
        ops = ", ".join(sorted(OPERATIONS))
        return None, [
            f"{lines.where(here)}: {format_path(here)}: a step is one operation with its parameters, "
            f"e.g. `- drop_layers: {{layers: [12]}}` (operations: {ops})"
        ]
    ((op, raw),) = item.items()
    if op not in OPERATIONS:
        close = difflib.get_close_matches(str(op), OPERATIONS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (operations: {', '.join(sorted(OPERATIONS))})"
        return None, [f"{lines.where(here + (op,))}: {format_path(here)}: unknown operation '{op}'{hint}"]
    params_cls = OPERATIONS[op].Params
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        return None, [
            f"{lines.where(here + (op,))}: {format_path(here + (op,))}: parameters must be a mapping, "
            f"got {type(raw).__name__}"
        ]
    try:
        return Step(op, params_cls.model_validate(raw), index), []
    except ValidationError as exc:
        return None, _pydantic_problems(exc, raw, lines, here + (op,), params_cls)


def _pydantic_problems(exc: ValidationError, data: Any, lines: LineMap, prefix: tuple, model: type) -> list[str]:
    problems: list[str] = []
    for error in exc.errors():
        loc = _data_path(data, error["loc"])
        if prefix == () and loc[:1] == ("steps",) and error["type"] != "list_type":
            continue  # steps are checked one by one, against their operation's schema
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = (
                f" (did you mean '{close[0]}'?)" if close else (f" (allowed: {', '.join(allowed)})" if allowed else "")
            )
            path, message = prefix + loc, f"unknown key '{loc[-1]}'{hint}"
        elif kind == "missing":
            path, message = prefix + loc[:-1], f"missing required key '{loc[-1]}'"
        else:
            text = error["msg"].removeprefix("Value error, ")
            path, message = prefix + loc, text[0].lower() + text[1:]
            if not isinstance(error.get("input"), (dict, list, type(None))):
                message += f" (got {error['input']!r})"
        problem = f"{lines.where(path)}: {format_path(path)}: {message}"
        if problem not in problems:  # union branches can repeat one mistake
            problems.append(problem)
    return problems


def _data_path(data: Any, loc: tuple) -> tuple:
    """Keep the parts of a pydantic error location that address the YAML data (drop union tags)."""
    out, current = [], data
    for part in loc:
        if isinstance(part, int) and isinstance(current, list) and 0 <= part < len(current):
            out.append(part)
            current = current[part]
        elif isinstance(current, dict) and part in current:
            out.append(part)
            current = current[part]
        elif isinstance(part, str) and isinstance(current, dict) and part not in current:
            # A missing or unknown key: the last addressable part.
            if part[:1].isupper() or part in ("str", "int", "bool", "float") or "[" in part:
                continue  # a union branch tag such as 'str' or 'list[str]'
            out.append(part)
            break
    return tuple(out)


def _fields_at(model: type, loc: tuple) -> list[str]:
    """The keys the schema allows at `loc` (for "did you mean" hints)."""
    current = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return []
        current = _inner_model(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, dict):
        args = typing.get_args(annotation)
        for arg in reversed(args) if origin is dict else args:
            inner = _inner_model(arg)
            if inner is not None:
                return inner
    return None
