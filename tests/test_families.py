"""surgeon/families.py is the one place a model family is described: each row marked tested is
built by a tiny fixture, the tests it names exist, and no other module names a model type."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from conftest import tiny_family_config
from surgeon import families
from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonVLMConfig

ROOT = Path(__file__).resolve().parents[1]
TESTED = [row for row in families.FAMILIES.values() if row.tested]


@pytest.mark.parametrize("row", TESTED, ids=lambda row: row.model_type)
def test_each_tested_family_is_built_by_a_tiny_fixture(row):
    config = tiny_family_config(row.model_type)
    assert config.model_type == row.model_type
    for name in row.tested:
        assert (ROOT / "tests" / name).is_file(), f"{row.model_type}: {name} named in families.py does not exist"
    if row.role == "lm":  # the fixture really builds a model of it
        from transformers import AutoModelForCausalLM

        from surgeon import modeling  # noqa: F401  registers the sparse LM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert model.config.model_type == row.model_type


def test_every_family_surgery_supports_is_tested():
    untested = [t for t in families.surgery_types() + families.engine_types() if not families.FAMILIES[t].tested]
    assert not untested, f"called supported but no test runs them: {untested}"


def test_the_model_types_agree_with_surgeons_own_classes():
    assert families.SURGEON_VLM == SurgeonVLMConfig.model_type
    assert families.SURGEON_SPARSE_LLAMA == SurgeonSparseLlamaConfig.model_type
    assert families.family("nonesuch") is None and not families.is_bridgeable("nonesuch")


def test_no_module_but_families_names_a_model_type():
    # Tower kinds ("clip", "siglip") double as vision model types; only LM and VLM types are checked.
    names = {t for t, row in families.FAMILIES.items() if row.role != "vision"}
    found = []
    for path in sorted((ROOT / "surgeon").rglob("*.py")):
        # modeling/ defines the classes (their model_type attributes) and imports nothing of surgeon.
        if path.name == "families.py" or "modeling" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "model types named outside families.py:\n" + "\n".join(found)
