"""From the measures to a recipe: which block to drop, how many KV heads to keep, then heal and evaluate.

Rules (simple on purpose; the report shows the curves they read, so a user can overrule them):
- drop the largest contiguous block of at most a fifth of the layers whose angular distance is at
  most MAX_ANGULAR (the last-token state turns by under ~27 degrees across it), at least the single
  cheapest layer; the block is the one with the smallest distance for that size.
- keep the fewest KV heads whose svd merge loses at most MAX_MERGE_LOSS of the K and of the V output
  energy, averaged over layers; healing is expected to recover a loss of that size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import families
from ..recipe.layer_spec import format_ranges
from .measures import LayerMeasures

MAX_ANGULAR = 0.15
MIN_RECALL = 0.8  # a sparse layer keeping less of the dense attention mass stays dense
MAX_MERGE_LOSS = 0.25
DROP_SHARE = 5  # at most 1/5 of the layers


@dataclass
class Suggestion:
    drop: list[int]  # empty for a sparse export (it takes no layer surgery)
    kv_heads: int | None  # None: keep them all
    reasons: list[str] = field(default_factory=list)
    sparse: dict | None = None  # a sparse export: sparse_attention's parameters for the rebuild
    origin: str | None = None  # ...and the dense model to rebuild it from (None: unknown, no recipe)

    @property
    def has_recipe(self) -> bool:
        return bool(self.drop) or (self.sparse is not None and self.origin is not None)

    def summary(self) -> str:
        if self.sparse is not None or not self.drop:
            if self.sparse is None:
                dense = f"keep the dense model {self.origin}" if self.origin else "keep the dense model"
                return f"no layer's selection keeps {MIN_RECALL:.0%} of the attention: {dense}"
            where = f", rebuilt from {self.origin}" if self.origin else ""
            return f"sparse attention on layers {format_ranges(self.sparse['layers'])}{where}"
        kv = f"merge to {_heads(self.kv_heads)}" if self.kv_heads else "keep all KV heads"
        return f"drop layers {format_ranges(self.drop)}; {kv}"


def suggest(m: LayerMeasures, config=None, origin: str | None = None) -> Suggestion:
    """What to do next. A sparse-attention export takes no layer surgery itself: its suggestion
    rebuilds it from `origin` (the dense model it was made from), sparse only where the measured
    recall says selection keeps the attention (see suggest_sparse)."""
    if config is not None and families.is_sparse_export(config.model_type):
        return suggest_sparse(m, config, origin)
    best = {n: min(range(len(d)), key=d.__getitem__) for n, d in m.angular.items()}
    limit = max(1, m.layers // DROP_SHARE)
    fits = [n for n in range(1, limit + 1) if n in m.angular and m.angular[n][best[n]] <= MAX_ANGULAR]
    size = max(fits, default=1)
    start = best[size]
    drop = list(range(start, start + size))
    reasons = [
        f"layers {format_ranges(drop)}: the {size}-layer block with the smallest angular distance "
        f"({m.angular[size][start]:.3f}; limit {MAX_ANGULAR} for at most {limit} layers)"
    ]
    if size < limit and size + 1 in m.angular:
        reasons[-1] += f"; the best {size + 1}-layer block would be {m.angular[size + 1][best[size + 1]]:.3f}"
    kv = None
    if m.merge_loss:
        losses = {t: max(sum(v) / len(v) for v in loss.values()) for t, loss in m.merge_loss.items()}
        fitting = [t for t, lost in losses.items() if lost <= MAX_MERGE_LOSS]
        summary = ", ".join(f"{_heads(t)} {lost:.1%}" for t, lost in sorted(losses.items()))
        if fitting:
            kv = min(fitting)
            reasons.append(
                f"{m.kv_heads} -> {_heads(kv)}: an svd merge loses at most {losses[kv]:.1%} of the K or V "
                f"output energy (mean over layers; limit {MAX_MERGE_LOSS:.0%}; {summary})"
            )
        else:
            reasons.append(f"keep {m.kv_heads} KV heads: every merge loses more than {MAX_MERGE_LOSS:.0%} ({summary})")
    return Suggestion(drop, kv, reasons)


def suggest_sparse(m: LayerMeasures, config, origin: str | None) -> Suggestion:
    spec = dict(config.sparse_attention)
    measured = sorted(m.recall or {})
    keep = [layer for layer in measured if m.recall[layer] >= MIN_RECALL]
    dense = [layer for layer in measured if m.recall[layer] < MIN_RECALL]
    params = {k: spec[k] for k in ("top_k", "sinks", "window", "index_heads", "index_dim", "rope_dim") if k in spec}
    reasons = [
        f"sparse layers whose top-{spec.get('top_k')} selection keeps at least {MIN_RECALL:.0%} of the dense "
        f"attention mass: {format_ranges(keep) if keep else 'none'}"
        + (f"; {format_ranges(dense)} fall below and stay dense" if dense else "")
    ]
    if origin is None:
        reasons.append(
            "no recipe: the export's report.json names no dense base surgeon can find, and a sparse model takes "
            "no layer surgery itself"
        )
    else:
        reasons.append(f"rebuilt from {origin}, the dense model the export's report.json names")
    return Suggestion([], None, reasons, sparse={**params, "layers": keep} if keep else None, origin=origin)


def recipe_text(
    s: Suggestion,
    name: str,
    model_spec: str,
    model_type: str,
    data_files: list[Path],
    recipe_dir: Path,
    tokens: int,
    heldout_files: list[Path] | None = None,
) -> str:
    """The suggested recipe as YAML, paths relative to `recipe_dir` (where it is written). Surgery
    calibrates and healing trains on `data_files`; evaluate steps read `heldout_files` if given."""
    text = _text_value(data_files, recipe_dir)
    calibration = {"text": text, "tokens": tokens}
    if s.sparse is not None:
        model_spec = s.origin
    base = model_spec if not Path(model_spec).expanduser().exists() else _relative(Path(model_spec), recipe_dir)
    measured_on = {"text": _text_value(heldout_files, recipe_dir), "tokens": tokens} if heldout_files else calibration
    steps = []
    if s.sparse is not None:
        warmup = {
            "data": calibration,
            "heldout_windows": 2,
            "steps": 100,
            "batch_size": 4,
            "optimizer": {"lr": 2.0e-3, "warmup_steps": 10},
        }
        steps.append({"sparse_attention": {**s.sparse, "recall": measured_on, "warmup": warmup}})
    if s.drop:
        drop = {"layers": [s.drop[0] if len(s.drop) == 1 else f"{s.drop[0]}-{s.drop[-1]}"]}
        if families.is_bridgeable(model_type) and s.drop[0] > 0:
            drop.update(calibration=calibration, bridge="linear")
        steps.append({"drop_layers": drop})
    if s.kv_heads:
        steps.append({"reduce_kv_heads": {"kv_heads": s.kv_heads, "init": "svd", "calibration": calibration}})
    evaluate = {"evaluate": {"data": measured_on}}
    steps += [
        evaluate,
        {
            "heal": {
                "data": {"sources": [{"text": text, "tokens": 20480}], "window": 256, "heldout_windows": 4},
                "train": {"params": ["model.layers"]},
                "steps": 60,
                "batch_size": 4,
                "optimizer": {"lr": 5.0e-4, "warmup_steps": 4},
                "eval": {"every": 20},
            }
        },
        evaluate,
    ]
    recipe = {
        "name": name,
        "description": f"Suggested by surgeon analyze: {s.summary()}.",
        "base": base,
        "steps": steps,
    }
    fairness = (
        "# The evaluate steps read the held-out text (--heldout), which nothing here trains or calibrates on."
        if heldout_files
        else "# The evaluate steps read the analysis text: give --heldout text (or edit them) for a fair measure."
    )
    header = [
        "# Suggested by `surgeon analyze` from the curves in report.html; edit before running.",
        *[f"# - {reason}" for reason in s.reasons],
        fairness,
    ]
    return "\n".join(header) + "\n" + yaml.dump(recipe, Dumper=_NoAliases, sort_keys=False, width=100)


def _text_value(files: list[Path], recipe_dir: Path) -> str | list[str]:
    text = [_relative(f, recipe_dir) for f in files]
    return text[0] if len(text) == 1 else text


def _heads(count: int) -> str:
    return f"{count} KV head{'s' if count != 1 else ''}"


class _NoAliases(yaml.SafeDumper):
    """Repeat shared values in full: `&id001` anchors would puzzle whoever edits the recipe."""

    def ignore_aliases(self, data):
        return True


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(start).resolve())
