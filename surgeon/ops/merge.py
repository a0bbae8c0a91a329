"""merge: combine same-architecture checkpoints tensor by tensor (mergekit's methods).

Methods: linear, slerp, task_arithmetic, ties, dare_linear, dare_ties (surgeon/surgery/merge.py
holds the math), and regmean, which also runs each model over its own `data` (surgeon/surgery/
regmean.py). Sources are read a block of rows at a time from their safetensors, so the step holds
the result plus a few tensors' worth of work, however many models it merges (regmean: plus its
sums, and one model at a time while it runs them).

Parameter values follow mergekit: a number; a gradient `[0, 0.5, 1]` spread over the decoder (layer i
of L takes the value at i / (L - 1); tensors outside the layers take the first value, as mergekit
does); or a list of `{filter, value}` where the first matching filter wins (`self_attn`: a substring
of the tensor name, as in mergekit; with `*`, `?` or `[`: a surgeon glob) and `{value}` is the
fallback.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import time
import zlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm.auto import tqdm

from ..checkpoints.lazy_tensors import SafetensorsTensors, StateTensors
from ..errors import ParamError, SourceError
from ..recipe.patient import Patient, Provenance
from ..recipe.step import BASE, PATIENT, ModelState, Operation, StepContext, register
from ..surgery import architecture, merge
from ..surgery.regmean import RegMeanSums, decoder_linears
from ..surgery.selection import matches, unmatched_patterns
from ..text import TextData, describe_files

log = logging.getLogger(__name__)

REGMEAN_ALPHA = 0.9  # the share of the Gram matrices' off-diagonals RegMean keeps unless told
CHUNK_ELEMENTS = 1 << 22  # rows are merged in blocks of about this many values (16 MB in fp32)
COMPARED_FIELDS = (*architecture.LAYER_SHAPE_FIELDS, "num_hidden_layers", "vocab_size", "tie_word_embeddings")


class Conditional(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filter: str | None = None
    value: float | list[float]


Setting = float | list[float] | list[Conditional]


def setting_value(setting: Setting | None, name: str, t: float) -> float | None:
    """The value `setting` gives tensor `name` at depth `t` (None: nothing applies)."""
    if setting is None or isinstance(setting, (int, float)):
        return setting
    if all(isinstance(v, (int, float)) for v in setting):
        return merge.gradient_value(list(setting), t)
    for cond in setting:
        if _filter_matches(cond.filter, name):
            return setting_value(cond.value, name, t)
    return None


def _filter_matches(pattern: str | None, name: str) -> bool:
    if pattern in (None, "*"):
        return True
    return matches(name, [pattern]) if any(c in pattern for c in "*?[") else pattern in name


class MergeModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)  # a source name, `base` or `patient`
    weight: Setting | None = None
    density: Setting | None = None
    data: TextData | None = None  # regmean: text of the model's own domain

    @field_validator("density")
    @classmethod
    def _density_in_range(cls, value):
        _check_densities(value)
        return value


class MergeParams(BaseModel):
    """`models` with their `weight` / `density` (defaults: the step's, else 1); `base`: the model
    task vectors are taken from (and SLERP's t = 0 end; default: the recipe's base); `t`: SLERP's
    position; `normalize` (default per method) and `lambda` scale the combined deltas; `tensors`:
    globs of the tensors to merge, the rest copied from the base (linear, regmean: the first model);
    `tokenizer`: the source whose tokenizer the result takes (default: the patient's); `seed` makes
    DARE's drops repeatable. regmean: each model's `data` (text of its own domain, never what the
    merge is judged on) and `alpha`, the share of the Gram matrices' off-diagonals kept (default
    REGMEAN_ALPHA).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    method: Literal["linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties", "regmean"]
    models: list[MergeModel] = Field(min_length=1)
    base: str | None = None
    weight: Setting | None = None
    density: Setting | None = None
    t: Setting | None = None
    normalize: bool | None = None
    lambda_: float = Field(1.0, alias="lambda")
    tensors: list[str] | None = Field(None, min_length=1)
    tokenizer: str | None = None
    seed: int = 0
    alpha: float | None = Field(None, ge=0, le=1)

    @field_validator("density")
    @classmethod
    def _density_in_range(cls, value):
        _check_densities(value)
        return value

    def the_base(self) -> str | None:
        return (self.base or BASE) if merge.METHODS[self.method].uses_base else self.base

    def contributors(self) -> list[tuple[int, MergeModel]]:
        """(index, model) of the models that contribute a delta / a weighted term (not the base)."""
        base = self.the_base() if merge.METHODS[self.method].uses_base else None
        return [(i, m) for i, m in enumerate(self.models) if m.model != base]

    def normalizes(self) -> bool:
        return merge.METHODS[self.method].normalize if self.normalize is None else self.normalize


def _check_densities(setting) -> None:
    values = []
    if isinstance(setting, (int, float)):
        values = [setting]
    elif isinstance(setting, list):
        for item in setting:
            inner = item.value if isinstance(item, Conditional) else item
            values += inner if isinstance(inner, list) else [inner]
    bad = [v for v in values if not 0 <= v <= 1]
    if bad:
        raise ValueError(f"a density is the share of each delta kept, between 0 and 1 (got {bad[0]})")


@register
class Merge(Operation):
    name = "merge"
    Params = MergeParams
    summary = (
        "merge same-architecture checkpoints: linear, slerp, task arithmetic, TIES, DARE (mergekit's methods), "
        "RegMean (fitted to each model's own text)"
    )

    def plan(self, params: MergeParams, state: ModelState, ctx: StepContext):
        method = merge.METHODS[params.method]
        names = _referenced(params)
        for where, name in names:
            _check_compatible(name, state, ctx, where)
        seen = set()
        for index, model in enumerate(params.models):
            if model.model in seen:
                raise ParamError(("models", index, "model"), f"'{model.model}' is listed twice: give it one weight")
            seen.add(model.model)
        contributors = params.contributors()
        if params.method == "slerp":
            if len(contributors) != 1:
                raise ParamError(
                    ("models",),
                    f"slerp interpolates between the base ('{params.the_base()}') and exactly one other model; "
                    f"got {len(contributors)} others",
                )
            if params.t is None:
                raise ParamError(("t",), "slerp needs `t`: 0 keeps the base, 1 takes the other model")
        elif method.uses_base and not contributors:
            raise ParamError(("models",), f"{params.method} needs at least one model besides the base")
        elif not method.uses_base and len(params.models) < 2:
            raise ParamError(("models",), f"a {params.method} merge combines two or more models")
        if params.method != "slerp" and params.t is not None:
            raise ParamError(("t",), f"`t` is slerp's; {params.method} weighs models by `weight`")
        if not method.sparsify:
            given = [("density",)] if params.density is not None else []
            given += [("models", i, "density") for i, m in enumerate(params.models) if m.density is not None]
            if given:
                raise ParamError(given[0], f"{params.method} keeps every delta entry: density is for ties and dare_*")
        meta = _meta_state(state.config)
        _check_regmean(params, meta, ctx)
        if params.tokenizer is not None:
            _check_known(params.tokenizer, ctx, ("tokenizer",))
        if params.tensors:
            bad = unmatched_patterns(meta, params.tensors)
            if bad:
                raise ParamError(("tensors",), f"{bad} match no tensor of the model (e.g. {next(iter(meta))})")
        ctx.facts["vocabulary_checked"] = _check_vocabularies(_with_tokenizer_source(params, names), ctx)
        largest = max(shape.numel() for shape in meta.values())
        result = architecture.shape_of(state.config, state.dtype).bytes
        # Row blocks of every source at once; TIES also holds whole tensors to find its threshold.
        whole = 5 * largest * 4 if method.sparsify == "magnitude" else 0
        working = whole + (len(params.models) + 4) * min(CHUNK_ELEMENTS, largest) * 4
        if params.method == "regmean":  # its sums (fp32) and the one model it runs at a time
            working += _regmean_bytes(meta) + architecture.shape_of(state.config, torch.float32).bytes
        ctx.facts["expected_bytes"] = result + working
        base = f" onto {params.the_base()}" if method.uses_base else ""
        how = "tensor by tensor"
        if params.method == "regmean":
            how = "each model run over its own text, then tensor by tensor"
        note = (
            f"{params.method} of {', '.join(m.model for m in params.models)}{base}, {how}: "
            f"needs {_mib(result)} for the result + {_mib(working)} working beyond the models in memory "
            f"({_mib(min(CHUNK_ELEMENTS, largest) * 4)} more per added source)"
        )
        return ModelState(state.config, state.dtype), note

    def apply(self, params: MergeParams, patient: Patient, ctx: StepContext) -> Patient:
        started = time.perf_counter()
        names = [name for _, name in _referenced(params)]
        checked = ctx.facts.get("vocabulary_checked", set())
        unchecked = [n for n in _with_tokenizer_source(params, _referenced(params)) if n[1] not in checked]
        _check_vocabularies(unchecked, ctx, patient.tokenizer)
        out_state = patient.model.state_dict()
        solved, fitted = None, {}
        if params.method == "regmean":
            solved, fitted = _regmean(params, patient, ctx)
        readers = {}
        try:
            for name in dict.fromkeys(names):
                readers[name] = _reader(name, patient, ctx)
            tensors = _merge_all(params, out_state, readers, patient.model.config.num_hidden_layers, solved)
        finally:
            for reader in readers.values():
                reader.close()
        config = architecture.clean_config(patient.model.config)
        child = architecture.assemble(config, tensors, patient.model.generation_config)
        tokenizer = patient.tokenizer
        if params.tokenizer not in (None, PATIENT):
            tokenizer = ctx.sources[params.tokenizer].load_tokenizer()
        seconds = time.perf_counter() - started
        sources = {
            name: {"label": _label(name, patient, ctx), "fingerprint": _fingerprint(name, patient, ctx)}
            for name in names
        }
        described = ", ".join(_described(m.model, sources) for m in params.models)
        base = f" onto {_described(params.the_base(), sources)}" if params.the_base() in sources else ""
        entry = Provenance(
            op=self.name,
            what=f"{params.method} merge of {described}{base}",
            why="the merge named in the recipe",
            params=params.model_dump(mode="json", by_alias=True, exclude_none=True),
            before=patient.shape().as_dict(),
            after=architecture.shape_of(child.config, child.dtype).as_dict(),
            details={
                "sources": sources,
                "seconds": round(seconds, 2),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "expected_bytes": ctx.facts.get("expected_bytes"),
                "mergekit": mergekit_config(params, sources, str(child.dtype).removeprefix("torch.")),
                **({"regmean": fitted} if fitted else {}),
            },
        )
        log.info("merged in %.1f s", seconds)
        merged = patient.with_model(child, entry)
        return merged if tokenizer is patient.tokenizer else _with_tokenizer(merged, tokenizer)


def _merge_all(
    params: MergeParams, out_state: dict, readers: dict, layers: int, solved: RegMeanSums | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the result, merged (or copied) from the readers, or solved from regmean's
    sums (its Linears, one at a time: each sum is freed once used); tied tensors stay tied."""
    first_of = {}  # data_ptr -> first name, so a tied head is computed once
    aliases = {}
    for name, tensor in out_state.items():
        aliases[name] = first_of.setdefault(tensor.data_ptr(), name)
    names_in = {label: set(reader.names()) for label, reader in readers.items()}

    def stored_name(reader_name: str, name: str) -> str:
        """A tied tensor saved under its partner's name only (lm_head.weight -> embed_tokens)."""
        if name in names_in[reader_name]:
            return name
        partners = [n for n, a in aliases.items() if a == aliases[name] and n in names_in[reader_name]]
        if not partners:
            raise SourceError(f"source '{readers[reader_name].label}' has no tensor {name}")
        return partners[0]

    _check_shapes(out_state, readers, stored_name, aliases)
    merged: dict[str, torch.Tensor] = {}
    for name in tqdm([n for n in out_state if aliases[n] == n], desc="merge", unit="tensor", leave=False):
        split = architecture.split_layer_name(name)
        t = (split[0] / (layers - 1) if layers > 1 else 1.0) if split else 0.0  # mergekit: a lone layer is at t 1
        target = out_state[name]
        if params.tensors and not matches(name, params.tensors):
            keep = params.the_base() or params.models[0].model
            merged[name] = _copy(readers[keep], stored_name(keep, name), target)
            continue
        if solved is not None and name in solved:
            merged[name] = solved.take(name).to(target.dtype)
            continue
        merged[name] = _merge_tensor(params, name, t, target, readers, stored_name)
    for name, first in aliases.items():
        if name != first:
            merged[name] = merged[first]
    return merged


def _merge_tensor(params, name, t, target, readers, stored_name) -> torch.Tensor:
    if target.dim() == 0:  # a scalar merges as a one-row tensor
        return _merge_tensor(params, name, t, target.reshape(1), readers, stored_name).reshape(())
    method = merge.METHODS[params.method]
    out = torch.empty(target.shape, dtype=target.dtype)
    rows = target.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, target.numel() // max(rows, 1)))
    blocks = [(start, min(start + step, rows)) for start in range(0, rows, step)]

    def read(model: str, start: int, stop: int) -> torch.Tensor:
        return readers[model].rows(stored_name(model, name), start, stop)

    contributors = [m for _, m in params.contributors()]
    weights = [_value(m.weight, params.weight, name, t, 1.0) for m in contributors]
    if params.method in ("linear", "regmean"):  # regmean: the tensors outside the decoder's Linears
        for start, stop in blocks:
            chunks = [read(m.model, start, stop) for m in contributors]
            out[start:stop] = merge.linear(chunks, weights, params.normalizes())
        return out
    base = params.the_base()
    if params.method == "slerp":
        other = contributors[0].model
        stats = merge.SlerpStats()
        for start, stop in blocks:
            stats.add(read(base, start, stop), read(other, start, stop))
        position = setting_value(params.t, name, t)
        if position is None:
            raise ParamError(("t",), f"no `t` applies to {name}: end the list with a value without a filter")
        ca, cb = stats.coefficients(position)
        for start, stop in blocks:
            out[start:stop] = ca * read(base, start, stop) + cb * read(other, start, stop)
        return out
    densities = [_value(m.density, params.density, name, t, 1.0) for m in contributors]
    trims = [None] * len(contributors)
    if method.sparsify == "magnitude":  # TIES trims against the whole tensor's magnitudes
        full_base = read(base, 0, rows)
        for i, m in enumerate(contributors):
            trims[i] = merge.magnitude_trim(read(m.model, 0, rows) - full_base, densities[i])
        del full_base
    generators = [_generator(params.seed, name, i) for i in range(len(contributors))]
    for start, stop in blocks:
        base_chunk = read(base, start, stop)
        deltas = []
        for i, m in enumerate(contributors):
            delta = read(m.model, start, stop) - base_chunk
            if method.sparsify == "magnitude" and trims[i] is not None:
                delta = trims[i](delta)
            elif method.sparsify == "random":
                delta = merge.drop_and_rescale(delta, densities[i], generators[i])
            deltas.append(delta)
        mixed = merge.combine_deltas(deltas, weights, method.sign_consensus, params.normalizes())
        out[start:stop] = base_chunk + params.lambda_ * mixed
    return out


def _check_regmean(params: MergeParams, meta: dict[str, torch.Size], ctx: StepContext) -> None:
    """regmean needs each model's own text and positive weights; the other methods read weights only."""
    if params.method != "regmean":
        if params.alpha is not None:
            raise ParamError(("alpha",), f"`alpha` is regmean's; {params.method} has no Gram matrices")
        for index, model in enumerate(params.models):
            if model.data is not None:
                raise ParamError(("models", index, "data"), f"`data` is regmean's; {params.method} reads weights only")
        return
    for index, model in enumerate(params.models):
        if model.data is None:
            raise ParamError(
                ("models", index, "data"),
                "regmean fits each Linear to every model's own activations: give each model `data`, "
                "text of its own domain (not what the merge is judged on)",
            )
        _check_regmean_weight(model.weight, ("models", index, "weight"))
        ctx.resolve_text(f"merge-data-{index}", model.data, ("models", index, "data"))
    _check_regmean_weight(params.weight, ("weight",))
    if params.normalize is False:  # the Linears' solve is a weighted mean: the other tensors must be one too
        raise ParamError(("normalize",), "regmean's least-squares solve is normalised: drop `normalize: false`")
    if params.lambda_ != 1.0:
        raise ParamError(("lambda",), "`lambda` scales task vectors; regmean merges weights, not deltas from a base")
    biased = sorted(  # a Linear's bias: a bias beside a matrix (norms' biases are averaged as usual)
        name
        for name in meta
        if architecture.split_layer_name(name)
        and name.endswith(".bias")
        and len(meta.get(name.removesuffix(".bias") + ".weight", ())) == 2
    )
    if biased:  # X^T X fits W alone; a bias would need the inputs' sums too
        raise ParamError(("method",), f"regmean fits Linear weights without biases; this model has {biased[0]}")


def _check_regmean_weight(weight: Setting | None, where: tuple) -> None:
    if isinstance(weight, list):
        raise ParamError(where, "regmean weighs a model as a whole: give a number")
    if weight is not None and weight <= 0:
        raise ParamError(where, f"regmean weighs each model's Gram matrices: give a weight above 0 (got {weight})")


def _regmean(params: MergeParams, patient: Patient, ctx: StepContext) -> tuple[RegMeanSums | None, dict]:
    """(the sums every merged decoder Linear is solved from, what was fitted on what); (None, {})
    when `tensors` leaves no decoder Linear to fit."""
    names = decoder_linears(patient.model)
    if params.tensors:
        names = [n for n in names if matches(f"{n}.weight", params.tensors)]
    if not names:
        return None, {}
    sums = RegMeanSums(names, REGMEAN_ALPHA if params.alpha is None else params.alpha)
    fitted = {}
    for index, entry in enumerate(params.models):
        started = time.perf_counter()
        files, windows = ctx.text_windows(f"merge-data-{index}", entry.data, patient.tokenizer)
        model = _model_of(entry.model, patient, ctx)
        weight = _value(entry.weight, params.weight, "", 0.0, 1.0)
        sums.add(model, windows, weight, _label(entry.model, patient, ctx))
        del model
        seconds = time.perf_counter() - started
        text = describe_files(files)
        fitted[entry.model] = {"text": text, "tokens": windows.numel(), "seconds": round(seconds, 1)}
        log.info("regmean: %s on %d tokens of %s (%.1f s)", entry.model, windows.numel(), text, seconds)
    return sums, fitted


def _model_of(name: str, patient: Patient, ctx: StepContext) -> torch.nn.Module:
    if name == PATIENT:
        return patient.model
    return patient.parent if name == BASE else ctx.sources[name].load_model()


def _regmean_bytes(meta: dict[str, torch.Size]) -> int:
    """An upper bound on regmean's memory: its sums (an fp32 product per decoder Linear, an fp64
    Gram per input) and the fp64 Grams of the model being run, counted as if no two Linears shared
    an input (q/k/v and gate/up do: the real figure is lower)."""
    total = 0
    for name, shape in meta.items():
        if len(shape) == 2 and architecture.split_layer_name(name):
            total += shape.numel() * 4 + shape[1] * shape[1] * (8 + 8)
    return total


def _value(own: Setting | None, default: Setting | None, name: str, t: float, fallback: float) -> float:
    for setting in (own, default):
        value = setting_value(setting, name, t)
        if value is not None:
            return float(value)
    return fallback


def _generator(seed: int, name: str, index: int) -> torch.Generator:
    # crc32, not hash(): Python salts string hashes per process, and DARE must repeat across runs.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}|{index}".encode()))


def _copy(reader, name: str, target: torch.Tensor) -> torch.Tensor:
    rows = target.shape[0] if target.dim() else 1
    return reader.rows(name, 0, rows).to(target.dtype).reshape(target.shape).clone()


def _check_shapes(out_state: dict, readers: dict, stored_name, aliases: dict) -> None:
    """Every source holds every tensor with the result's shape (header reads only)."""
    for name, tensor in out_state.items():
        if aliases[name] != name:
            continue
        for label, reader in readers.items():
            shape = reader.shape(stored_name(label, name))
            if tuple(shape) != tuple(tensor.shape):
                raise SourceError(
                    f"cannot merge '{reader.label}': {name} is {list(shape)} there and {list(tensor.shape)} here"
                )


def _referenced(params: MergeParams) -> list[tuple[tuple, str]]:
    """(recipe path, name) of every model the merge reads, the base included."""
    out = [(("models", i, "model"), m.model) for i, m in enumerate(params.models)]
    base = params.the_base()
    if base is not None and base not in [m.model for m in params.models]:
        out.append((("base",), base))
    return out


def _with_tokenizer_source(params: MergeParams, names: list) -> list:
    """The models read, plus the source whose tokenizer the result takes: its vocabulary must match too."""
    if params.tokenizer in (None, PATIENT, BASE) or params.tokenizer in [n for _, n in names]:
        return names
    return [*names, (("tokenizer",), params.tokenizer)]


def _check_known(name: str, ctx: StepContext, where: tuple) -> None:
    if name not in (PATIENT, BASE) and name not in ctx.sources:
        known = ", ".join([PATIENT, *ctx.sources])
        raise ParamError(where, f"unknown source '{name}' (known: {known})")


def _check_compatible(name: str, state: ModelState, ctx: StepContext, where: tuple) -> None:
    _check_known(name, ctx, where)
    if name == PATIENT:
        return
    source = ctx.sources[name]
    if source.modules:
        subset = ", ".join(source.modules)
        raise ParamError(where, f"source '{name}' is a subset ({subset}): a merge needs whole models")
    config = source.config
    for field in COMPARED_FIELDS:
        mine, theirs = getattr(config, field, None), getattr(state.config, field, None)
        if mine != theirs:
            raise ParamError(where, f"'{name}' cannot be merged here: {field} is {mine} there, {theirs} here")


def _meta_state(config) -> dict[str, torch.Size]:
    return {name: tensor.shape for name, tensor in architecture.meta_model(config).state_dict().items()}


def _check_vocabularies(names, ctx: StepContext, patient_tokenizer=None) -> set[str]:
    """Identical vocabularies merge directly; otherwise stop before any weight is read, naming the
    first token that differs. At plan (no `patient_tokenizer`), a source still to be converted from
    GGUF is left for apply; returns the names compared."""
    reference = patient_tokenizer or _tokenizer_of(BASE, ctx, convert=False)
    checked: set[str] = set()
    if reference is None:
        return checked
    for where, name in names:
        if name in (PATIENT, BASE):
            continue
        other = _tokenizer_of(name, ctx, convert=patient_tokenizer is not None)
        if other is None:
            continue
        difference = vocabulary_difference(reference, other)
        if difference:
            raise ParamError(
                where,
                f"'{name}' has another vocabulary than the base ({difference}); "
                "a merge adds embedding rows of the same token only",
            )
        checked.add(name)
    return checked


def _tokenizer_of(name: str, ctx: StepContext, convert: bool):
    source = ctx.sources[name]
    if not convert and source.local_folder() is None:
        return None
    return source.load_tokenizer()


def vocabulary_difference(a, b) -> str | None:
    """The first difference between two tokenizers' vocabularies, in words (None: identical)."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    by_id_a = {i: t for t, i in vocab_a.items()}
    by_id_b = {i: t for t, i in vocab_b.items()}
    for token_id in sorted(set(by_id_a) | set(by_id_b)):
        left, right = by_id_a.get(token_id), by_id_b.get(token_id)
        if left != right:
            return f"token {token_id} is {left!r} in one and {right!r} in the other"
    return None


def _reader(name: str, patient: Patient, ctx: StepContext):
    if name == PATIENT:
        return StateTensors(PATIENT, patient.model.state_dict())
    if name == BASE:
        return StateTensors(patient.base.label, patient.parent.state_dict())
    return SafetensorsTensors(ctx.sources[name])


def _label(name: str, patient: Patient, ctx: StepContext) -> str:
    if name == PATIENT:
        return "the patient"
    return patient.base.label if name == BASE else ctx.sources[name].label


def _fingerprint(name: str, patient: Patient, ctx: StepContext) -> str:
    if name == PATIENT:
        return patient.fingerprint()
    return patient.base.fingerprint() if name == BASE else ctx.sources[name].fingerprint()


def _described(name: str, sources: dict) -> str:
    label = sources[name]["label"]
    return label if label == name else f"{name} ({label})"


def _with_tokenizer(patient: Patient, tokenizer) -> Patient:
    return dataclasses.replace(patient, tokenizer=tokenizer)


def mergekit_config(params: MergeParams, sources: dict, dtype: str) -> dict:
    """The merge in mergekit's own vocabulary, for the model card (mergekit users read configs)."""

    def plain(setting):
        if isinstance(setting, list):
            return [s.model_dump(exclude_none=True) if isinstance(s, Conditional) else s for s in setting]
        return setting

    models = []
    for m in params.models:
        entry = {"model": sources[m.model]["label"]}
        values = {k: plain(v) for k, v in (("weight", m.weight), ("density", m.density)) if v is not None}
        if values:
            entry["parameters"] = values
        models.append(entry)
    config = {"merge_method": params.method, "models": models}
    if params.the_base():
        config["base_model"] = sources[params.the_base()]["label"]
    global_values = {
        "weight": plain(params.weight),
        "density": plain(params.density),
        "t": plain(params.t),
        "normalize": params.normalize,
        "lambda": params.lambda_ if params.lambda_ != 1.0 else None,
    }
    parameters = {k: v for k, v in global_values.items() if v is not None}
    if parameters:
        config["parameters"] = parameters
    if params.tokenizer not in (None, PATIENT):
        config["tokenizer_source"] = sources.get(params.tokenizer, {}).get("label", params.tokenizer)
    config["dtype"] = dtype
    if params.tensors:  # mergekit has no such key: say so rather than describe another merge
        config["surgeon_only"] = {"tensors": params.tensors, "note": "the other tensors are the base's"}
    if params.method == "regmean":
        config.setdefault("surgeon_only", {})["method"] = (
            f"regmean (alpha {REGMEAN_ALPHA if params.alpha is None else params.alpha}) is not a mergekit method: "
            "each decoder Linear solved by least squares on its models' own text, the rest averaged"
        )
    return config


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
