"""Every checkable mistake is reported as file:line: path: message before any weight is loaded."""

from __future__ import annotations

import pytest

from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.schema import load_recipe


def problems(path) -> list[str]:
    with pytest.raises(RecipeError) as info:
        plan_recipe(load_recipe(path))
    return info.value.problems


def test_layer_index_out_of_range_names_file_line_and_path(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers:
              layers: [1, 2,
                       31]
        """)
    assert problems(path) == [f"{path}:6: steps[0].drop_layers.layers: index 31 out of range (model has 6 layers)"]


def test_range_out_of_range_and_reversed(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: ["4-9"]}}
        """)
    assert problems(path) == [f"{path}:4: steps[0].drop_layers.layers: index 6 out of range (model has 6 layers)"]
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: ["4-2"]}}
        """)
    assert "range '4-2' is empty" in problems(path)[0]


def test_later_steps_see_the_model_earlier_steps_made(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [0, 1]}}
          - drop_layers: {{layers: [5]}}
        """)
    assert problems(path) == [f"{path}:5: steps[1].drop_layers.layers: index 5 out of range (model has 4 layers)"]


def test_unknown_keys_are_named_with_a_suggestion(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        stpes: []
        steps:
          - drop_layers:
              layers: [1]
              calibraton: {{text: x.txt}}
        """)
    found = problems(path)
    assert f"{path}:3: stpes: unknown key 'stpes' (did you mean 'steps'?)" in found
    assert f"{path}:7: steps[0].drop_layers.calibraton: unknown key 'calibraton' (did you mean 'calibration'?)" in found


def test_unknown_operation_and_malformed_step(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layer: {{layers: [1]}}
          - 42
        """)
    found = problems(path)
    assert found[0] == f"{path}:4: steps[0]: unknown operation 'drop_layer' (did you mean 'drop_layers'?)"
    assert found[1].startswith(f"{path}:5: steps[1]: a step is one operation with its parameters")


def test_wrong_types(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers:
              auto: {{metric: angular, count: six}}
              calibration: {{text: x.txt}}
        """)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:5: steps[0].drop_layers.auto.count: input should be a valid integer")
    assert "'six'" in problem


def test_missing_required_key_and_either_or(write_recipe, tiny_llama):
    path = write_recipe("""
        name: t
        steps: []
        """)
    assert problems(path) == [f"{path}:1: (top level): missing required key 'base'"]
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers: {{}}
        """)
    assert "give either `layers`" in problems(path)[0]


def test_missing_data_file_points_at_the_text_line(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - drop_layers:
              auto: {{count: 2}}
              calibration:
                tokens: 1024
                text: no/such/file.txt
        """)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:8: steps[0].drop_layers.calibration.text: no such file: no/such/file.txt")


def test_missing_base_folder_and_unknown_alias(write_recipe):
    path = write_recipe("""
        name: t
        base:
          model: ./nowhere
        steps: []
        """)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:2: base.model: source './nowhere': not a known alias")


def test_sources_that_cannot_be_combined(write_recipe, tmp_path, tokenizer_dir, tiny_llama):
    from conftest import save_tiny_model

    wide = save_tiny_model(tmp_path / "wide", "llama", tokenizer_dir, hidden_size=96)
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        sources:
          wide: {wide}
        steps:
          - stack:
              slices:
                - {{layers: ["0-2"]}}
                - source: wide
                  layers: ["3-5"]
        """)
    (problem,) = problems(path)
    assert problem == (
        f"{path}:9: steps[0].stack.slices[1].source: layers of 'wide' cannot be combined with 'patient': "
        "hidden_size is 96 there and 64 here"
    )


def test_reserved_and_unknown_source_names(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        sources:
          patient: {tiny_llama}
        steps: []
        """)
    assert "'patient' is reserved" in problems(path)[0]
    path = write_recipe(f"""
        name: t
        base: {tiny_llama}
        steps:
          - stack: {{slices: [{{source: donor, layers: [0]}}]}}
        """)
    assert "unknown source 'donor' (known: patient, base)" in problems(path)[0]


def test_invalid_yaml_reports_its_line(write_recipe):
    path = write_recipe("""
        name: t
        base: x
        steps:
          - drop_layers: {layers: [1, 2}
        """)
    (problem,) = problems(path)
    assert problem.startswith(f"{path}:4: invalid YAML")


def test_several_schema_problems_are_reported_together(write_recipe, tiny_llama):
    path = write_recipe(f"""
        name: "bad name!"
        base: {tiny_llama}
        steps:
          - evaluate: {{data: {{text: a.txt, tokens: -5}}}}
        """)
    found = problems(path)
    assert any(p.startswith(f"{path}:1: name: string should match pattern") for p in found)
    assert any(p.startswith(f"{path}:4: steps[0].evaluate.data.tokens: input should be greater than 0") for p in found)
