"""Run a recipe: check it, load the base, apply the steps in order, export the result."""

from __future__ import annotations

import datetime
import hashlib
import logging
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import PartialState

from .. import __version__
from ..checkpoints.export import check_target, export_model, push_folder
from ..errors import ExportError, ParamError, RecipeError, RunCancelled, SurgeonError
from ..ops import OPERATIONS
from ..paths import PathRefused, user_path
from ..training.progress import check_cancelled
from .patient import Patient
from .plan import Plan, plan_recipe
from .schema import Recipe

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    patient: Patient
    target: Path
    report: dict


def export_target(recipe: Recipe, out: str | Path | None) -> Path:
    """--out (relative to the current directory), else export.path (relative to the recipe), else out/NAME."""
    if out is not None:
        try:
            return user_path(out).resolve()
        except PathRefused as exc:
            raise PathRefused(f"--out {exc}") from None
    if recipe.spec.export.path:
        return user_path(recipe.spec.export.path, recipe.directory).resolve()
    return user_path(Path("out") / recipe.spec.name).resolve()


def work_dir_for(target: Path) -> Path:
    """Where a run keeps its checkpoints: beside the export, removed once the export is written."""
    return target.parent / f"{target.name}.checkpoints"


def run_recipe(
    recipe: Recipe, out: str | Path | None = None, overwrite: bool = False, resume: bool = False
) -> RunResult:
    started = time.perf_counter()
    plan = plan_recipe(recipe)  # every check that needs no weights, first
    target = export_target(recipe, out)
    overwrite = overwrite or recipe.spec.export.overwrite
    check_target(target, overwrite)
    work = work_dir_for(target)
    if work.exists() and not resume:
        if not overwrite:
            raise ExportError(
                f"{work} holds checkpoints of an interrupted run: pass --resume to continue it, "
                "or --overwrite to start over"
            )
        shutil.rmtree(work)
    digest = hashlib.sha256(recipe.text.encode()).hexdigest()[:16]
    for ctx in plan.contexts:
        ctx.work_dir, ctx.resume, ctx.recipe_digest = work, resume, digest
    patient = Patient.from_source(plan.base)
    timings = {"load_s": round(time.perf_counter() - started, 2)}
    for step, ctx in zip(recipe.steps, plan.contexts, strict=True):
        check_cancelled(f"before {step.label}")
        log.info("%s", step.label)
        step_started = time.perf_counter()
        try:
            patient = OPERATIONS[step.op].apply(step.params, patient, ctx)
        except RunCancelled:
            raise
        except ParamError as exc:
            here = ("steps", step.index, step.op)
            raise RecipeError([recipe.problem(here + exc.path, exc.message, node=here + exc.node)]) from exc
        except SurgeonError as exc:
            raise SurgeonError(f"{recipe.where(('steps', step.index))}: {step.label}: {exc}") from exc
        timings[step.label] = round(time.perf_counter() - step_started, 2)
    timings["total_s"] = round(time.perf_counter() - started, 2)
    report = build_report(recipe, plan, patient, timings)
    state = PartialState()  # under `accelerate launch`, every process ran the steps; one exports
    if state.is_main_process:
        export_model(
            patient.model,
            patient.tokenizer,
            target,
            report=report,
            recipe_text=recipe.text,
            dtype=recipe.spec.export.dtype,
            overwrite=overwrite,
            quantization=patient.quantization,
            gguf=recipe.spec.export.gguf_types(),
            name=recipe.spec.name,
        )
        shutil.rmtree(work, ignore_errors=True)
    state.wait_for_everyone()
    if recipe.spec.export.push and state.is_main_process:
        push = recipe.spec.export.push
        push_folder(target, push.repo_id, push.private)
    return RunResult(patient, target, report)


def build_report(recipe: Recipe, plan: Plan, patient: Patient, timings: dict) -> dict:
    base = plan.base
    return {
        "name": recipe.spec.name,
        "description": recipe.spec.description,
        "surgeon_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base": {"label": base.label, "hub_id": base.hub_id, "fingerprint": base.fingerprint()},
        "shape": {"before": plan.rows[0].shape.as_dict(), "after": patient.shape().as_dict()},
        "provenance": [asdict(entry) for entry in patient.provenance],
        "stages": [asdict(stage) for stage in patient.stages],
        "timing": timings,
        "memory": {
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "base_checkpoint_bytes": plan.rows[0].shape.bytes,
        },
    }
