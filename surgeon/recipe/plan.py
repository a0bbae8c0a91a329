"""Check a recipe against the models it names and compute, per step, the shape of the result.

Runs on configs and the meta device only: no weights are read, so `validate` and `plan` are quick
and every mistake they can see is reported before `run` loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import families
from ..checkpoints.gguf_export import check_exportable
from ..checkpoints.sources import DTYPES, Source, resolve_source
from ..errors import ExportError, ParamError, RecipeError, SourceError
from ..ops import OPERATIONS
from ..paths import PathRefused, user_path
from ..surgery.architecture import Shape, shape_of
from .schema import Recipe, SourceSpec
from .step import BASE, ModelState, StepContext


@dataclass
class PlanRow:
    step: str  # "base" or "steps[2].drop_layers"
    note: str
    shape: Shape

    def as_dict(self) -> dict:
        return {"step": self.step, "note": self.note, **self.shape.as_dict()}


@dataclass
class Plan:
    recipe: Recipe
    base: Source
    sources: dict[str, Source]  # named sources plus BASE
    rows: list[PlanRow] = field(default_factory=list)
    contexts: list[StepContext] = field(default_factory=list)  # one per step, reused by `run`
    final: ModelState | None = None

    def as_dict(self) -> dict:
        return {"recipe": self.recipe.spec.name, "rows": [row.as_dict() for row in self.rows]}


def _resolve(recipe: Recipe, spec: SourceSpec, path: tuple) -> Source:
    try:
        source = resolve_source(
            spec.model, recipe.directory, spec.modules, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code
        )
        _ = source.config  # read now, so a broken config is reported at this line
        return source
    except SourceError as exc:
        raise RecipeError([recipe.problem(path + ("model",), str(exc), node=path)]) from None


def plan_recipe(recipe: Recipe) -> Plan:
    """Resolve sources and walk the steps on configs; RecipeError (file:line) on the first problem."""
    base = _resolve(recipe, recipe.spec.base, ("base",))
    sources = {name: _resolve(recipe, spec, ("sources", name)) for name, spec in recipe.spec.sources.items()}
    sources[BASE] = base
    if recipe.spec.export.path:
        try:
            user_path(recipe.spec.export.path, recipe.directory)
        except PathRefused as exc:
            raise RecipeError([recipe.problem(("export", "path"), str(exc))]) from None
    plan = Plan(recipe=recipe, base=base, sources=sources)
    state = ModelState(base.config, base.dtype)
    plan.rows.append(PlanRow("base", base.describe(), shape_of(state.config, state.dtype)))
    previous = None
    for step in recipe.steps:
        ctx = StepContext(
            recipe_dir=recipe.directory, sources=sources, index=step.index, label=step.label, previous_op=previous
        )
        if families.is_surgeon_vlm(state.config) and not OPERATIONS[step.op].accepts_vlm:
            raise RecipeError(
                [
                    recipe.problem(
                        ("steps", step.index, step.op),
                        f"{step.op} edits the language model's layers: put it before graft_vision",
                    )
                ]
            )
        try:
            state, note = OPERATIONS[step.op].plan(step.params, state, ctx)
        except ParamError as exc:
            here = ("steps", step.index, step.op)
            raise RecipeError([recipe.problem(here + exc.path, exc.message, node=here + exc.node)]) from None
        except SourceError as exc:
            raise RecipeError([recipe.problem(("steps", step.index, step.op), str(exc))]) from None
        plan.contexts.append(ctx)
        plan.rows.append(PlanRow(step.label, note, shape_of(state.config, state.dtype)))
        if not OPERATIONS[step.op].measures:
            previous = step.op
    plan.final = state
    export_dtype = recipe.spec.export.dtype
    if export_dtype and DTYPES[export_dtype] != state.dtype:
        plan.rows.append(PlanRow("export", f"saved as {export_dtype}", shape_of(state.config, DTYPES[export_dtype])))
    for kind in recipe.spec.export.gguf_types():
        try:
            check_exportable(state.config, "export.gguf")
        except ExportError as exc:
            raise RecipeError([recipe.problem(("export", "gguf"), str(exc).removeprefix("export.gguf: "))]) from None
        plan.rows.append(PlanRow("export", f"also {recipe.spec.name}.{kind}.gguf", shape_of(state.config, state.dtype)))
    return plan


def format_plan(plan: Plan) -> str:
    header = ("step", "layers", "heads", "kv_heads", "params", "bytes", "what")
    rows = [header]
    for row in plan.rows:
        s = row.shape
        rows.append(
            (row.step, str(s.layers), str(s.heads), str(s.kv_heads), _count(s.params), _bytes(s.bytes), row.note)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [r[i].ljust(widths[i]) if i == 0 else r[i].rjust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells) + "  " + r[-1])
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
