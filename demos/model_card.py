"""The side panel's content: an export's model card (what surgery was done, the metrics tables) and
its plots. Anything that is not a surgeon export gets a line saying so.

The card's metrics tables are wide (the KL table has nine columns, the image-question table seven),
and a 1280 px panel squeezed them until headers broke letter by letter. The panel shows the few
numbers a person reads first (KL, top-1 agreement, perplexity beside the parent's; accuracy beside
the shuffled-image control) and keeps the full tables for an accordion below the card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from surgeon.report.vision_rows import vision_rows

KL_HEADING = "## Measured against the parent"
VISION_HEADING = "## Image questions"


@dataclass
class ModelCard:
    markdown: str
    plots: list[tuple[Path, str]] = field(default_factory=list)  # (png, caption)
    all_metrics: str = ""  # the card's full metrics tables (markdown), shown on demand


def read_card(path: str) -> ModelCard:
    folder = Path(path)
    readme = folder / "README.md"
    if not readme.is_file():
        return ModelCard(
            f"**{folder.name}** is not a surgeon export: no surgery was done, so there is no "
            "model card or metrics to show."
        )
    plots = [(png, png.stem.replace("-", " ")) for png in sorted(folder.glob("*.png"))]
    card = _without_front_matter(readme.read_text(encoding="utf-8"))
    stages = _stages(folder / "report.json")
    full = []
    for heading, kind, compact in ((KL_HEADING, "kl", _kl_table), (VISION_HEADING, "vision", _vision_table)):
        chosen = [s for s in stages if s.get("kind", "kl") == kind]
        if chosen:
            card, section = _replace_section(card, heading, compact(chosen))
            full += [section] if section else []
    return ModelCard(card, plots, "\n".join(full))


def _stages(report: Path) -> list[dict]:
    try:
        return list(json.loads(report.read_text(encoding="utf-8"))["stages"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _kl_table(stages: list[dict]) -> str:
    lines = [
        KL_HEADING,
        "",
        "KL to the parent, top-1 agreement, perplexity (the parent's in brackets); every metric under *All metrics*.",
        "",
        "| stage | KL | top-1 | ppl |",
        "|---|---:|---:|---:|",
    ]
    for stage in stages:
        m = stage["metrics"]
        lines.append(
            f"| {stage['name']} | {m['kl_mean']:.3f} | {m['top1_agreement']:.1%} | "
            f"{m['ppl']:.1f} ({m['ppl_parent']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


def _vision_table(stages: list[dict]) -> str:
    lines = [
        VISION_HEADING,
        "",
        "Exact answers on held-out image questions, and the same questions about other images "
        "(*shuffled*); chance and counts under *All metrics*.",
        "",
        "| questions | right | shuffled |",
        "|---|---:|---:|",
    ]
    for stage in stages:
        for row in vision_rows(stage["metrics"]):
            label = f"{row.source} {row.kind}".strip() + (f" ({stage['name']})" if len(stages) > 1 else "")
            shuffled = "" if row.shuffled is None else f"{row.shuffled:.1%}"
            lines.append(f"| {label} | {row.accuracy:.1%} | {shuffled} |")
    return "\n".join(lines) + "\n"


def _replace_section(card: str, heading: str, compact: str) -> tuple[str, str]:
    """(the card with that section replaced by `compact`, the section as it was). No such section:
    the compact one goes at the end."""
    start = card.find(f"\n{heading}\n")
    if start == -1:
        return card.rstrip() + "\n\n" + compact, ""
    end = card.find("\n## ", start + len(heading) + 2)
    end = len(card) if end == -1 else end
    return card[: start + 1] + compact + card[end:], card[start + 1 : end].strip() + "\n"


def _without_front_matter(text: str) -> str:
    """The Hub's YAML header is metadata, not something a reader wants at the top of the panel."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return text[end + 5 :].lstrip()
    return text
