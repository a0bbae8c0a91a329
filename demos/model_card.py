"""The side panel's content: an export's model card (what surgery was done, the metrics tables) and
its plots. Anything that is not a surgeon export gets a line saying so."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelCard:
    markdown: str
    plots: list[tuple[Path, str]] = field(default_factory=list)  # (png, caption)


def read_card(path: str) -> ModelCard:
    folder = Path(path)
    readme = folder / "README.md"
    if not readme.is_file():
        return ModelCard(
            f"**{folder.name}** is not a surgeon export: no surgery was done, so there is no "
            "model card or metrics to show."
        )
    plots = [(png, png.stem.replace("-", " ")) for png in sorted(folder.glob("*.png"))]
    return ModelCard(_without_front_matter(readme.read_text(encoding="utf-8")), plots)


def _without_front_matter(text: str) -> str:
    """The Hub's YAML header is metadata, not something a reader wants at the top of the panel."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return text[end + 5 :].lstrip()
    return text
