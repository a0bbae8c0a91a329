"""The one-line summary of each stage that `surgeon run` prints after an export (one per kind)."""

from __future__ import annotations

from .vision_rows import vision_rows


def stage_line(stage: dict) -> str:
    """A stage of any kind as one line; a kind this module does not know still prints its numbers."""
    kind = stage.get("kind", "kl")
    line = _LINES.get(kind, _any_line)
    return line(stage)


def metrics_line(name: str, m: dict) -> str:
    """KL-to-parent metrics (evaluate, surgeon eval) as one line."""
    return (
        f"{name}: kl_mean {m['kl_mean']:.4f}  kl_median {m['kl_median']:.4f}  kl_p99 {m['kl_p99']:.4f}  "
        + (f"kl_max {m['kl_max']:.2f}  " if "kl_max" in m else "")
        + f"top1_agreement {m['top1_agreement']:.4f}  ppl {m['ppl']:.2f}  ppl_parent {m['ppl_parent']:.2f}  "
        f"tokens {m['tokens']}"
    )


def _kl_line(stage: dict) -> str:
    return metrics_line(f"{stage['name']} on {stage['data']}", stage["metrics"])


def _instructions_line(stage: dict) -> str:
    m = stage["metrics"]
    return (
        f"{stage['name']}: instructions {m['correct']}/{m['total']} right (parent {m['parent_correct']}/{m['total']})"
    )


def _chat_line(stage: dict) -> str:
    m = stage["metrics"]
    return (
        f"{stage['name']}: chat_kl {m['chat_kl_mean']:.4f}  median {m['chat_kl_median']:.4f}  "
        f"p99 {m['chat_kl_p99']:.3f}  chat_top1 {m['chat_top1']:.4f}  first 16 tokens same {m['chat_first16']:.0%} "
        f"of {m['prompts']} prompts"
    )


def _ifeval_line(stage: dict) -> str:
    m = stage["metrics"]
    return (
        f"{stage['name']}: IFEval {m['ifeval']:.3f} (parent {m['parent_ifeval']:.3f}; prompt strict "
        f"{m['prompt_strict']:.3f}, instruction strict {m['inst_strict']:.3f}) over {m['prompts']} prompts"
    )


def _vision_line(stage: dict) -> str:
    """Per image source: exact-answer accuracy, then the shuffled-image control and chance."""
    parts = []
    for row in vision_rows(stage["metrics"]):
        if row.kind:
            continue
        controls = [
            f"{label} {v:.1%}" for label, v in (("shuffled", row.shuffled), ("chance", row.chance)) if v is not None
        ]
        count = f" of {row.examples}" if row.examples is not None else ""
        extra = f" ({', '.join(controls)})" if controls else ""
        parts.append(f"{row.source} {row.accuracy:.1%}{count}{extra}")
    return f"{stage['name']}: image questions right: {'; '.join(parts) or 'none measured'}"


def _any_line(stage: dict) -> str:
    numbers = "  ".join(f"{k} {v:.4g}" for k, v in stage["metrics"].items() if isinstance(v, int | float))
    return f"{stage['name']} ({stage.get('kind')}) on {stage.get('data', '?')}: {numbers}"


_LINES = {
    "kl": _kl_line,
    "chat": _chat_line,
    "ifeval": _ifeval_line,
    "instructions": _instructions_line,
    "vision": _vision_line,
}
