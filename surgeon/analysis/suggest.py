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
MAX_MERGE_LOSS = 0.25
DROP_SHARE = 5  # at most 1/5 of the layers


@dataclass
class Suggestion:
    drop: list[int]
    kv_heads: int | None  # None: keep them all
    reasons: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kv = f"merge to {_heads(self.kv_heads)}" if self.kv_heads else "keep all KV heads"
        return f"drop layers {format_ranges(self.drop)}; {kv}"


def suggest(m: LayerMeasures) -> Suggestion:
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


def recipe_text(
    s: Suggestion, name: str, model_spec: str, model_type: str, data_files: list[Path], recipe_dir: Path, tokens: int
) -> str:
    """The suggested recipe as YAML, paths relative to `recipe_dir` (where it is written)."""
    text = [_relative(f, recipe_dir) for f in data_files]
    text = text[0] if len(text) == 1 else text
    calibration = {"text": text, "tokens": tokens}
    base = model_spec if not Path(model_spec).expanduser().exists() else _relative(Path(model_spec), recipe_dir)
    drop = {"layers": [s.drop[0] if len(s.drop) == 1 else f"{s.drop[0]}-{s.drop[-1]}"]}
    if families.is_bridgeable(model_type) and s.drop[0] > 0:
        drop.update(calibration=calibration, bridge="linear")
    steps = [{"drop_layers": drop}]
    if s.kv_heads:
        steps.append({"reduce_kv_heads": {"kv_heads": s.kv_heads, "init": "svd", "calibration": calibration}})
    evaluate = {"evaluate": {"data": calibration}}
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
    header = [
        "# Suggested by `surgeon analyze` from the curves in report.html; edit before running.",
        *[f"# - {reason}" for reason in s.reasons],
        "# The evaluate steps read the analysis text: point them at held-out text for a fair measure.",
    ]
    return "\n".join(header) + "\n" + yaml.dump(recipe, Dumper=_NoAliases, sort_keys=False, width=100)


def _heads(count: int) -> str:
    return f"{count} KV head{'s' if count != 1 else ''}"


class _NoAliases(yaml.SafeDumper):
    """Repeat shared values in full: `&id001` anchors would puzzle whoever edits the recipe."""

    def ignore_aliases(self, data):
        return True


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(start).resolve())
