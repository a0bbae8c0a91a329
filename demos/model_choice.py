"""Which model the chat opens, and why: the one named, else the vision recipe's export if it has
been run, else the base model. The reason is shown to the user, so it says what to do to change it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from surgeon.checkpoints.aliases import DEFAULT_MODEL
from surgeon.errors import SurgeonError

# demos/ sits beside recipes/ in the repository (an editable install keeps it there).
VISION_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-eyes.yaml"


@dataclass(frozen=True)
class ModelChoice:
    path: str  # an export folder, a Hugging Face folder or an alias
    why: str


def choose_model(path: str | None = None, vision_recipe: Path = VISION_RECIPE) -> ModelChoice:
    if path:
        return ModelChoice(str(path), "the model you named")
    from surgeon.recipe.run import export_target
    from surgeon.recipe.schema import load_recipe

    try:
        target = export_target(load_recipe(vision_recipe), None)  # where `surgeon run` writes it
    except SurgeonError as exc:
        return ModelChoice(DEFAULT_MODEL, f"the base model: the vision recipe cannot be read ({exc})")
    if (target / "config.json").is_file():
        return ModelChoice(str(target), f"the export of the vision recipe {vision_recipe.name}, found at {target}")
    return ModelChoice(
        DEFAULT_MODEL,
        f"the base model: the vision recipe has no export at {target} yet (`surgeon run {vision_recipe}` makes one)",
    )
