"""The side panel's content: an export's model card (what surgery was done, the metrics tables) and
its plots. Anything that is not a surgeon export gets a line saying so.

The card's full KL table has eight columns, which a 1280 px panel squeezes until its headers break
letter by letter; the panel shows the three numbers a person reads first (KL, top-1 agreement,
perplexity beside the parent's) and keeps the full table for an accordion below the card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KL_HEADING = "## Measured against the parent"


@dataclass
class ModelCard:
    markdown: str
    plots: list[tuple[Path, str]] = field(default_factory=list)  # (png, caption)
    all_metrics: str = ""  # the card's full KL table (markdown), shown on demand


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
    stages = _kl_stages(folder / "report.json")
    if not stages:
        return ModelCard(card, plots)
    before, full, after = _split_section(card, KL_HEADING)
    return ModelCard(before + _compact_table(stages) + after, plots, full.removeprefix(KL_HEADING).lstrip())


def _kl_stages(report: Path) -> list[dict]:
    try:
        stages = json.loads(report.read_text(encoding="utf-8"))["stages"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [s for s in stages if s.get("kind", "kl") == "kl" and "kl_mean" in s.get("metrics", {})]


def _compact_table(stages: list[dict]) -> str:
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


def _split_section(card: str, heading: str) -> tuple[str, str, str]:
    """(the card before the section, the section, the card after it); no such section: it would
    have come at the end."""
    start = card.find(f"\n{heading}\n")
    if start == -1:
        return card.rstrip() + "\n\n", "", ""
    end = card.find("\n## ", start + len(heading) + 2)
    end = len(card) if end == -1 else end
    return card[: start + 1], card[start + 1 : end].strip() + "\n", card[end:]


def _without_front_matter(text: str) -> str:
    """The Hub's YAML header is metadata, not something a reader wants at the top of the panel."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return text[end + 5 :].lstrip()
    return text
