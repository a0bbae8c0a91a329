"""Translate a mergekit config into the equivalent surgeon recipe (`surgeon import-mergekit`).

What maps: `models` or a single full-depth slice of `sources` (linear, slerp, task_arithmetic, ties,
dare_linear, dare_ties become a `merge` step), `slices` of one model each (passthrough becomes a
`stack` step), `base_model`, global, per-slice and per-model `parameters` (numbers, gradients and
filtered values keep their meaning), `dtype` / `out_dtype` (the export's dtype) and
`tokenizer_source` (base or one of the models). Anything else is an error at its file:line rather
than a recipe that quietly means something else; where surgeon differs in a detail (passthrough's
head taken with the embeddings, DARE's rescale), the recipe starts with a note saying so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from ..checkpoints.aliases import ALIASES
from ..errors import RecipeError
from .step import BASE, PATIENT
from .yaml_lines import LineMap, format_path, load_yaml_file

MERGE_METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties")
KNOWN_KEYS = ("models", "slices", "merge_method", "base_model", "dtype", "out_dtype", "parameters", "tokenizer_source")
STEP_PARAMETERS = ("weight", "density", "t", "normalize", "lambda")
MODEL_PARAMETERS = ("weight", "density")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPES |= {"float16": "float16", "fp16": "float16", "half": "float16"}
_RESERVED = (BASE, PATIENT, "parent")


class _Translation:
    def __init__(self, path: Path, data: dict, lines: LineMap, recipe_dir: Path):
        self.path, self.data, self.lines, self.recipe_dir = path, data, lines, recipe_dir
        self.problems: list[str] = []
        self.names: dict[str, str] = {}  # mergekit reference -> recipe source name
        self.notes: list[str] = []

    def problem(self, where: tuple, message: str) -> None:
        self.problems.append(f"{self.lines.where(where)}: {format_path(where)}: {message}")

    # --- models ------------------------------------------------------------------------------

    def reference(self, value: Any, where: tuple) -> str | None:
        if not isinstance(value, str) or not value:
            self.problem(where, "a model is named by a string (an alias, a folder or a Hub id)")
            return None
        if "+" in value:
            self.problem(where, f"'{value}' applies a LoRA (model+lora): merge the LoRA into the model first")
            return None
        if "@" in value:
            self.problem(where, f"'{value}' pins a revision: download that revision and name its folder")
            return None
        return value

    def source_name(self, reference: str) -> str:
        if reference not in self.names:
            stem = re.sub(r"[^a-z0-9]+", "_", reference.rstrip("/").split("/")[-1].lower()).strip("_") or "model"
            name = stem if stem not in _RESERVED else f"{stem}_model"
            taken = set(self.names.values())
            suffix = 2
            while name in taken:
                name, suffix = f"{stem}_{suffix}", suffix + 1
            self.names[reference] = name
        return self.names[reference]

    def location(self, reference: str) -> str:
        """As the recipe must write it: aliases and Hub ids as they are, folders relative to the recipe."""
        if reference in ALIASES:
            return reference
        if Path(reference).expanduser().is_absolute():
            return reference  # as the user wrote it
        candidate = Path(os.path.abspath(self.path.parent / reference))  # links kept as named
        if candidate.exists():
            try:
                return os.path.relpath(candidate, self.recipe_dir)
            except ValueError:  # another drive
                return str(candidate)
        return reference

    # --- parameters ----------------------------------------------------------------------------

    def setting(self, value: Any, where: tuple) -> Any:
        """A mergekit parameter value (number, gradient, or list of {filter, value}) as surgeon writes it."""
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            return list(value)
        if isinstance(value, dict):
            value = [value]
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out = []
            for index, cond in enumerate(value):
                extra = set(cond) - {"filter", "value"}
                if extra or "value" not in cond:
                    self.problem(where + (index,), "a conditional value is {filter: NAME, value: NUMBER or [gradient]}")
                    continue
                name = cond.get("filter")
                if name not in (None, "*") and any(c in str(name) for c in "*?["):
                    # mergekit reads a filter as a plain substring; surgeon would read this one as a glob
                    self.problem(where + (index, "filter"), "with *, ? or [ it is a glob to surgeon, text to mergekit")
                    continue
                item = {"filter": cond["filter"]} if cond.get("filter") is not None else {}
                item["value"] = self.setting(cond["value"], where + (index, "value"))
                out.append(item)
            return out
        self.problem(where, f"a parameter is a number, a gradient [..] or a list of {{filter, value}} (got {value!r})")
        return None

    def parameters(self, values: Any, allowed: tuple, where: tuple) -> dict:
        if values is None:
            return {}
        if not isinstance(values, dict):
            self.problem(where, "parameters are a mapping")
            return {}
        out = {}
        for key, value in values.items():
            if key == "int8_mask":
                self.notes.append("int8_mask (a memory option of mergekit's) is dropped: surgeon merges in row blocks")
                continue
            if key == "rescale":
                if value is not True or not str(self.data.get("merge_method", "")).startswith("dare"):
                    self.problem(
                        where + (key,),
                        "rescale does not map: surgeon's DARE always rescales the kept entries by 1 / density, "
                        "and no other method rescales",
                    )
                else:
                    self.notes.append("rescale: surgeon scales DARE's kept entries by 1 / density (mergekit: L1 norm)")
                continue
            if key not in allowed:
                self.problem(where + (key,), f"'{key}' does not map (surgeon's merge parameters: {', '.join(allowed)})")
                continue
            out[key] = self.setting(value, where + (key,))
        return out


def import_mergekit(config_path: str | Path, recipe_path: str | Path | None = None) -> str:
    """The recipe (YAML text) equivalent to a mergekit config. `recipe_path`: where it will be
    written, so folder paths in it resolve from there (default: beside the config)."""
    path = Path(config_path)
    data, lines, _ = load_yaml_file(path)
    recipe_dir = Path(os.path.abspath(Path(recipe_path).expanduser() if recipe_path else path)).parent
    if not isinstance(data, dict):
        raise RecipeError([f"{lines.where(())}: a mergekit config is a mapping with merge_method and models or slices"])
    tr = _Translation(path, data, lines, recipe_dir)
    for key in data:
        if key not in KNOWN_KEYS:
            hint = {
                "modules": "per-module merges do not map; merge the language model only",
                "tokenizer": "tokenizer surgery does not map: surgeon merges identical vocabularies",
                "chat_template": "the chat template comes with the tokenizer's source (tokenizer_source)",
            }.get(key, f"not a mergekit key surgeon knows ({', '.join(KNOWN_KEYS)})")
            tr.problem((key,), hint)
    method = data.get("merge_method")
    if method not in (*MERGE_METHODS, "passthrough"):
        tr.problem(
            ("merge_method",),
            f"surgeon has no '{method}' merge (it has {', '.join(MERGE_METHODS)} and passthrough)",
        )
        raise RecipeError(tr.problems)
    if ("models" in data) == ("slices" in data):
        tr.problem((), "give exactly one of `models` and `slices`")
        raise RecipeError(tr.problems)
    base_ref = tr.reference(data["base_model"], ("base_model",)) if data.get("base_model") is not None else None
    step = _stack_step(tr) if method == "passthrough" else _merge_step(tr, method, base_ref)
    if tr.problems:
        raise RecipeError(tr.problems)
    recipe_base = base_ref or next(iter(tr.names))
    recipe = {"name": _recipe_name(path), "description": f"Translated from the mergekit config {path.name}."}
    recipe["base"] = tr.location(recipe_base)
    others = {tr.names[ref]: tr.location(ref) for ref in tr.names if ref != recipe_base}
    if others:
        recipe["sources"] = others
    recipe["steps"] = [_rename(step, tr.names.get(recipe_base), BASE)]
    export = {}
    dtype = data.get("out_dtype") or data.get("dtype")
    if dtype is not None:
        key = "out_dtype" if data.get("out_dtype") else "dtype"
        if dtype not in DTYPES:
            raise RecipeError([f"{lines.where((key,))}: {key}: {dtype!r} is not float32, bfloat16 or float16"])
        export["dtype"] = DTYPES[dtype]
    if export:
        recipe["export"] = export
    header = [f"# Translated by `surgeon import-mergekit {path.name}`."]
    header += [f"# Note: {note}" for note in dict.fromkeys(tr.notes)]
    return "\n".join(header) + "\n" + yaml.safe_dump(recipe, sort_keys=False, width=110)


def _merge_step(tr: _Translation, method: str, base_ref: str | None) -> dict:
    data = tr.data
    models: list[tuple[str, dict, tuple]] = []  # (reference, parameters, where)
    step_values = tr.parameters(data.get("parameters"), STEP_PARAMETERS, ("parameters",))
    if "models" in data:
        if not isinstance(data["models"], list) or not data["models"]:
            tr.problem(("models",), "a list of {model, parameters}")
            return {}
        for index, item in enumerate(data["models"]):
            where = ("models", index)
            item = {"model": item} if isinstance(item, str) else item
            if not isinstance(item, dict) or set(item) - {"model", "parameters"}:
                tr.problem(where, "each model is {model: NAME, parameters: {...}}")
                continue
            ref = tr.reference(item.get("model"), where + ("model",))
            values = tr.parameters(item.get("parameters"), MODEL_PARAMETERS, where + ("parameters",))
            if ref:
                models.append((ref, values, where))
    else:
        slices = data["slices"]
        if not isinstance(slices, list) or len(slices) != 1:
            tr.problem(("slices",), f"{method} over several slices does not map: surgeon merges whole models")
            return {}
        piece = slices[0]
        extra = set(piece) - {"sources", "parameters", "base_model"} if isinstance(piece, dict) else {"?"}
        if extra:
            tr.problem(("slices", 0), f"a slice is {{sources, parameters}} (got {sorted(extra)})")
            return {}
        for key, value in tr.parameters(piece.get("parameters"), STEP_PARAMETERS, ("slices", 0, "parameters")).items():
            step_values[key] = _with_fallback(value, step_values.get(key))
        if piece.get("base_model") is not None:
            base_ref = tr.reference(piece["base_model"], ("slices", 0, "base_model"))
        ranges = set()
        for index, source in enumerate(piece.get("sources") or []):
            where = ("slices", 0, "sources", index)
            ref = tr.reference(source.get("model"), where + ("model",))
            layer_range = source.get("layer_range")
            ranges.add(tuple(layer_range) if isinstance(layer_range, list) else None)
            values = tr.parameters(source.get("parameters"), MODEL_PARAMETERS, where + ("parameters",))
            if ref:
                models.append((ref, values, where))
        if len(ranges) != 1 or next(iter(ranges)) is None or next(iter(ranges))[0] != 0:
            tr.problem(("slices", 0), "the sources must share one layer_range from 0 (the whole model)")
            return {}
        _check_full_depth(tr, models, next(iter(ranges))[1])
    listed = set()
    for ref, _, where in models:
        if ref in listed:
            tr.problem(where, f"{ref} is listed twice (mergekit counts it once): list it once")
        listed.add(ref)
        tr.source_name(ref)
    if base_ref is not None:
        tr.source_name(base_ref)
    if method != "linear" and base_ref is None:
        tr.problem(("base_model",), f"{method} needs base_model (task vectors are taken from it; slerp's t = 0)")
        return {}
    step: dict[str, Any] = {"method": method}
    entries = []
    for ref, values, _ in models:
        if method != "linear" and ref == base_ref:
            # mergekit lists the base among the models; it contributes no task vector there either
            if values:
                tr.notes.append(f"the parameters of the base model ({ref}) are unused by {method}, as in mergekit")
            continue
        entries.append({"model": tr.names[ref], **values})
    step["models"] = entries
    if method != "linear":
        step["base"] = tr.names[base_ref]
    step.update(step_values)
    tokenizer = data.get("tokenizer_source")
    if tokenizer not in (None, "base"):
        if tokenizer == "union":
            tr.problem(("tokenizer_source",), "a union of vocabularies does not map: surgeon merges identical ones")
        elif tr.reference(tokenizer, ("tokenizer_source",)):
            step["tokenizer"] = tr.source_name(tokenizer)
    return {"merge": step}


def _with_fallback(value, fallback):
    """A slice's value, falling back to the config's global one where none of its filters applies
    (mergekit reads the slice first, then the globals)."""
    if fallback is None or not (isinstance(value, list) and value and isinstance(value[0], dict)):
        return value
    if any("filter" not in cond for cond in value):
        return value  # the slice has its own catch-all
    return value + (
        fallback if isinstance(fallback, list) and fallback and isinstance(fallback[0], dict) else [{"value": fallback}]
    )


def _check_full_depth(tr: _Translation, models: list, end: int) -> None:
    """A slice [0, end) means the whole model only if the model has `end` layers: checked where the
    model's config can be read here (aliases, folders); a Hub id is trusted and noted."""
    from ..checkpoints.sources import resolve_source
    from ..errors import SourceError

    for ref, _, where in models:
        try:
            source = resolve_source(tr.location(ref), tr.recipe_dir)
            if source.kind == "hub" and source.local_folder() is None:
                raise SourceError("not fetched")  # not worth a download to translate a file
            layers = source.config.num_hidden_layers
        except SourceError:
            tr.notes.append(f"{ref}'s layer count could not be read here: the slice [0, {end}) is taken as all of it")
            continue
        if layers != end:
            tr.problem(where + ("layer_range",), f"{ref} has {layers} layers: a slice of [0, {end}) is part of it")


def _stack_step(tr: _Translation) -> dict:
    data = tr.data
    if "slices" not in data:
        tr.problem(("models",), "passthrough takes `slices` (layer ranges), not models")
        return {}
    slices, first_ref, last_ref = [], None, None
    for index, piece in enumerate(data["slices"] or []):
        sources = piece.get("sources") if isinstance(piece, dict) else None
        where = ("slices", index)
        if not isinstance(sources, list) or len(sources) != 1:
            tr.problem(where + ("sources",), "a passthrough slice takes its layers from exactly one model")
            continue
        source = sources[0]
        ref = tr.reference(source.get("model"), where + ("sources", 0, "model"))
        layer_range = source.get("layer_range")
        if not (isinstance(layer_range, list) and len(layer_range) == 2 and layer_range[0] < layer_range[1]):
            tr.problem(where + ("sources", 0, "layer_range"), "layer_range is [first, end) with first < end")
            continue
        if ref:
            first_ref = first_ref or ref
            last_ref = ref
            slices.append({"source": tr.source_name(ref), "layers": [f"{layer_range[0]}-{layer_range[1] - 1}"]})
    if data.get("parameters"):
        tr.problem(("parameters",), "passthrough takes no parameters")
    if first_ref and last_ref != first_ref:
        tr.notes.append(
            f"embeddings, final norm and head all come from {first_ref} (mergekit takes the norm and head "
            f"from the last slice's model, {last_ref})"
        )
    step = {"slices": slices}
    if first_ref:
        step["embeddings"] = tr.names[first_ref]
    return {"stack": step}


def _rename(step: dict, old: str | None, new: str) -> dict:
    """The recipe's base is `base` inside the step, not a source of its own."""

    def walk(value, key=None):
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        if key in ("model", "base", "source", "embeddings", "tokenizer") and value == old:
            return new
        return value

    return walk(step) if old else step


def _recipe_name(path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-._") or "merge"
    return name[:96]
