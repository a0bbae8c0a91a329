"""Operations a recipe step can name, one registered operation per module (the contract they
implement is surgeon/recipe/step.py). Modules here are imported automatically, so adding an
operation touches one file; `OPERATIONS` here is the registry with all of them in it."""

import importlib
import pkgutil

from ..recipe.step import OPERATIONS

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["OPERATIONS"]
