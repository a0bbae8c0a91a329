"""Every recipe shipped in recipes/ validates and plans (no weights are read)."""

from __future__ import annotations

import pytest

from conftest import ROOT, SHARED_DATA
from surgeon.checkpoints.aliases import ALIASES
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.schema import load_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert any(path.name == "quickstart.yaml" for path in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_and_plans(path):
    recipe = load_recipe(path)
    base = recipe.spec.base.model
    if base in ALIASES and not ALIASES[base].installed():
        pytest.skip(f"{base} is not installed ({ALIASES[base].install})")
    if "shared/data" in recipe.text and not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (the workplace's shared data folder)")
    plan = plan_recipe(recipe)
    assert plan.rows[0].step == "base" and len(plan.rows) >= len(recipe.steps) + 1
    assert all(row.shape.params > 0 for row in plan.rows)
