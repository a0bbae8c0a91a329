"""drop_layers: remove decoder layers, named in the recipe or chosen on calibration text.

A (config, state dict) rewrite: the new config lists the kept layers, per-layer fields follow them,
tensors are renamed into place and shared with the parent (no copy), so the result is a standard
architecture that plain transformers loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm.auto import tqdm

from .. import families
from ..errors import ParamError
from ..measure.metrics import compare_to_parent, parent_reference
from ..recipe.layer_spec import LayerList, expand_layers, format_ranges
from ..recipe.patient import Patient, Provenance
from ..recipe.step import ModelState, Operation, StepContext, register
from ..surgery import architecture
from ..surgery.layer_scores import angular_distances, boundary_statistics, cheapest_block, least_influential
from ..surgery.linear_bridge import contiguous_runs, fit_bridges, fold_into_down_proj
from ..text import TextData, describe_files


class AutoDrop(BaseModel):
    """Choose `count` layers from calibration text: `angular` drops the contiguous block whose input
    and output last-token states are closest (Gromov et al.); `block_influence` drops the layers that
    change their input least (ShortGPT), contiguous or not; `kl` tries every contiguous block and
    drops the one whose removal moves the output distribution least (one forward pass per candidate:
    slower, but it measures the objective instead of a proxy)."""

    model_config = ConfigDict(extra="forbid")

    metric: Literal["angular", "block_influence", "kl"] = "angular"
    count: int = Field(gt=0)


class DropLayersParams(BaseModel):
    """`bridge: linear` fits, on the calibration text, a linear map that stands in for each dropped
    block and folds it into the MLP of the layer before it (see linear_bridge.py)."""

    model_config = ConfigDict(extra="forbid")

    layers: LayerList | None = None
    auto: AutoDrop | None = None
    calibration: TextData | None = None
    bridge: Literal["none", "linear"] = "none"

    @model_validator(mode="after")
    def _one_way(self):
        if (self.layers is None) == (self.auto is None):
            raise ValueError("give either `layers` (explicit indices) or `auto` (chosen on calibration data)")
        if (self.auto is not None or self.bridge != "none") and self.calibration is None:
            raise ValueError("`auto` and `bridge` need `calibration` text to measure the layers on")
        if self.layers is not None and self.calibration is not None and self.bridge == "none":
            raise ValueError("`calibration` is only used with `auto` or `bridge`")
        return self


@register
class DropLayers(Operation):
    name = "drop_layers"
    Params = DropLayersParams
    summary = "remove decoder layers, named or chosen by angular distance, block influence or KL"

    def plan(self, params: DropLayersParams, state: ModelState, ctx: StepContext):
        n = state.config.num_hidden_layers
        where = ""
        if params.calibration is not None:
            files = ctx.resolve_text("calibration_files", params.calibration, ("calibration",))
            where = f" on {describe_files(files)}"
        if params.layers is not None:
            listed = expand_layers(params.layers, n, ("layers",))
            dropped = sorted(set(listed))
            if len(dropped) != len(listed):
                raise ParamError(("layers",), "a layer is listed twice")
            note = f"drop {format_ranges(dropped)}"
            if params.bridge != "none" and dropped[0] == 0:
                raise ParamError(
                    ("layers",),
                    "a linear bridge folds into the layer before a dropped block: "
                    "layer 0 has none (use bridge: none, or keep layer 0)",
                )
        else:
            count = params.auto.count
            if count >= n:
                raise ParamError(("auto", "count"), f"cannot drop {count} of {n} layers (at least one must stay)")
            dropped = list(range(n - count, n))  # placeholder of the right size; chosen at run time
            note = f"drop {count} by {params.auto.metric}{where} (chosen at run time)"
        if params.bridge != "none":
            if not families.is_bridgeable(state.config.model_type):
                raise ParamError(
                    ("bridge",),
                    f"a linear bridge needs an MLP that adds to the residual stream "
                    f"directly ({', '.join(families.bridgeable_types())}); "
                    f"{state.config.model_type} normalises it first",
                )
            note += f", linear bridge fitted{where}"
        if len(dropped) >= n:
            raise ParamError(("layers",), f"cannot drop all {n} layers")
        kept = [i for i in range(n) if i not in dropped]
        config = architecture.config_with_layers(state.config, [(state.config, i) for i in kept])
        return ModelState(config, state.dtype), note

    def apply(self, params: DropLayersParams, patient: Patient, ctx: StepContext) -> Patient:
        model = patient.model
        n = model.config.num_hidden_layers
        windows = None
        if params.calibration is not None:
            files, windows = ctx.text_windows("calibration_files", params.calibration, patient.tokenizer)
        if params.layers is not None:
            dropped, why, details = sorted(set(expand_layers(params.layers, n, ("layers",)))), "named in the recipe", {}
        else:
            dropped, why, details = _choose(model, windows, params.auto, patient.fingerprint())
            why += f" on {describe_files(files)}"
        if windows is not None:
            details["calibration"] = {"files": [str(f) for f in files], "windows": list(windows.shape)}
        kept = [i for i in range(n) if i not in dropped]
        child = architecture.keep_layers(model, kept)
        if params.bridge == "linear":
            why += "; " + _bridge(model, child, windows, dropped, kept, details)
        entry = Provenance(
            op=self.name,
            what=f"dropped layer{'s' if len(dropped) > 1 else ''} {format_ranges(dropped)} ({len(dropped)} of {n})"
            + (", with a linear bridge" if params.bridge == "linear" else ""),
            why=why,
            params={
                "layers": dropped,
                **({"metric": params.auto.metric} if params.auto else {}),
                **({"bridge": params.bridge} if params.bridge != "none" else {}),
            },
            before=patient.shape().as_dict(),
            after=architecture.shape_of(child.config, child.dtype).as_dict(),
            details=details,
        )
        origin = patient.layer_origin()
        return patient.with_model(child, entry, origin=[origin[i] for i in kept])


def _bridge(model, child, windows, dropped: list[int], kept: list[int], details: dict) -> str:
    """Fit a linear bridge over each dropped block (on `model`) and fold it into `child`."""
    runs = contiguous_runs(dropped)
    skipped = [run for run in runs if run[0] == 0]  # nothing before layer 0 to fold into
    fitted = fit_bridges(model, windows, [run for run in runs if run[0] > 0])
    details["bridge"] = []
    for (a, b), (t, relative) in fitted.items():
        fold_into_down_proj(child.model.layers[kept.index(a - 1)], t)
        details["bridge"].append(
            {
                "dropped": format_ranges(list(range(a, b + 1))),
                "into_layer": a - 1,
                "error_vs_plain_drop": round(relative, 4),
            }
        )
    parts = [
        f"layers {d['dropped']} bridged into layer {d['into_layer']}'s MLP "
        f"(residual error {d['error_vs_plain_drop']:.2f}x the plain drop's)"
        for d in details["bridge"]
    ]
    if skipped:
        parts.append(f"{format_ranges(list(range(skipped[0][0], skipped[0][1] + 1)))} not bridged (no layer before it)")
    return "; ".join(parts)


def _choose(model, windows, auto: AutoDrop, fingerprint: str) -> tuple[list[int], str, dict]:
    """(layers to drop, why, every candidate's score): all metrics are reported, one decides."""
    count = auto.count
    stats = boundary_statistics(model, windows)
    distances = angular_distances(stats["last"], count)
    details = {"angular_distance_by_block_start": distances, "block_influence_by_layer": stats["influence"].tolist()}
    if auto.metric == "angular":
        dropped = cheapest_block(distances, count)
        why = (
            f"the {count}-layer block with the smallest angular distance between its input and output "
            f"({distances[dropped[0]]:.4f}; median over all blocks {_median(distances):.4f})"
        )
    elif auto.metric == "kl":
        kls = details["kl_by_block_start"] = _kl_by_block(model, windows, count, fingerprint)
        dropped = cheapest_block(kls, count)
        why = (
            f"of all {len(kls)} contiguous {count}-layer blocks, the one whose removal costs the least KL "
            f"({kls[dropped[0]]:.4f}; median over all blocks {_median(kls):.4f})"
        )
    else:
        dropped = least_influential(stats["influence"], count)
        why = f"the {count} layers with the lowest block influence (1 - cos between input and output)"
    return dropped, why, details


def _kl_by_block(model, windows, count: int, fingerprint: str) -> list[float]:
    """Mean KL(model || model without block [l, l+count)) on `windows`, for every start l."""
    n = model.config.num_hidden_layers
    reference = parent_reference(lambda: model, windows, fingerprint)
    kls = []
    for start in tqdm(range(n - count + 1), desc="kl per block", unit="block", leave=False):
        kept = [i for i in range(n) if not start <= i < start + count]
        kls.append(compare_to_parent(architecture.keep_layers(model, kept), windows, reference)["kl_mean"])
    return kls


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
