"""Property-style: broken copies of every recipe in recipes/ (lines deleted, values swapped,
indentation broken, text cut short, NUL bytes and stray characters put in) either plan or fail with
RecipeError whose every problem names the file and line. No other exception may escape; one did (a
NUL byte in a path reached os.path.realpath as `ValueError: embedded null byte`)."""

from __future__ import annotations

import random
import re
import zlib
from pathlib import Path

import pytest

from conftest import ROOT
from surgeon.errors import RecipeError
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.schema import load_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
MUTATIONS_PER_RECIPE = 40
VALUE = re.compile(r"^(\s*-?\s*[\w.]+:\s+)(\S.*)$")
PATH = re.compile(r"(?<![\w\"'])\.\./[^\s,}\]\"']+")


def _delete_line(lines, rng):
    del lines[rng.randrange(len(lines))]


def _swap_values(lines, rng):
    spots = [i for i, line in enumerate(lines) if VALUE.match(line)]
    if len(spots) >= 2:
        a, b = rng.sample(spots, 2)
        ma, mb = VALUE.match(lines[a]), VALUE.match(lines[b])
        lines[a], lines[b] = ma[1] + mb[2], mb[1] + ma[2]


def _break_indent(lines, rng):
    i = rng.randrange(len(lines))
    lines[i] = " " * rng.choice((1, 3)) + lines[i] if rng.random() < 0.5 else lines[i].lstrip()


def _truncate(lines, rng):
    text = "\n".join(lines)
    cut = rng.randrange(len(text))
    lines[:] = text[:cut].split("\n")


def _nul_in_value(lines, rng):
    spots = [i for i, line in enumerate(lines) if VALUE.match(line)]
    if spots:
        i = rng.choice(spots)
        key, value = VALUE.match(lines[i]).groups()
        value = value.replace('"', "").replace("\\", "")
        at = rng.randrange(len(value) + 1)
        lines[i] = f'{key}"{value[:at]}\\0{value[at:]}"'


def _nul_in_path(lines, rng):
    spots = [(i, m) for i, line in enumerate(lines) for m in PATH.finditer(line)]
    if spots:
        i, m = rng.choice(spots)
        at = rng.randrange(m.start(), m.end() + 1)
        path = lines[i][m.start() : at] + "\\0" + lines[i][at : m.end()]
        lines[i] = f'{lines[i][: m.start()]}"{path}"{lines[i][m.end() :]}'


def _stray_characters(lines, rng):
    i = rng.randrange(len(lines))
    at = rng.randrange(len(lines[i]) + 1)
    lines[i] = lines[i][:at] + rng.choice(["{", "]", ":", "&x", "*nope", "\t", "'", "-1", "1e999", "~"]) + lines[i][at:]


MUTATORS = [_delete_line, _swap_values, _break_indent, _truncate, _nul_in_value, _nul_in_path, _stray_characters]


def mutations(text: str, seed: int, count: int):
    rng = random.Random(seed)
    for n in range(count):
        lines = text.split("\n")
        applied = [rng.choice(MUTATORS) for _ in range(rng.choice((1, 1, 2)))]
        for mutate in applied:
            if lines:
                mutate(lines, rng)
        yield f"#{n} {'+'.join(m.__name__.lstrip('_') for m in applied)}", "\n".join(lines)


@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_broken_recipes_fail_with_located_errors_only(recipe_path: Path):
    text = recipe_path.read_text()
    located = re.compile(rf"^{re.escape(str(recipe_path))}:\d+: ")
    outcomes = {"planned": 0, "recipe error": 0}
    for label, mutated in mutations(text, seed=zlib.crc32(recipe_path.name.encode()), count=MUTATIONS_PER_RECIPE):
        try:
            plan_recipe(load_recipe(recipe_path, text=mutated))
            outcomes["planned"] += 1
        except RecipeError as exc:
            unlocated = [p for p in exc.problems if not located.match(p)]
            assert not unlocated, f"{label}: problems without file:line: {unlocated}\n--- recipe ---\n{mutated}"
            outcomes["recipe error"] += 1
        except Exception as exc:  # anything else escaping is the defect this test hunts
            pytest.fail(f"{label}: {type(exc).__name__}: {exc}\n--- recipe ---\n{mutated}")
    assert outcomes["recipe error"] > 0, outcomes  # the mutations really break things


def test_a_nul_byte_in_any_path_is_a_located_recipe_error(write_recipe, tiny_llama, text_dir):
    for where, text in {
        "base": f'name: n\nbase: "{tiny_llama}\\0x"\nsteps: []\n',
        "text": (
            f"name: n\nbase: {tiny_llama}\nsteps:\n  - evaluate:\n"
            f'      data: {{text: "{text_dir}/held\\0out.txt", tokens: 64}}\n'
        ),
        "export": f'name: n\nbase: {tiny_llama}\nsteps: []\nexport: {{path: "out\\0/x"}}\n',
    }.items():
        path = write_recipe(text)
        with pytest.raises(RecipeError) as caught:
            plan_recipe(load_recipe(path))
        (problem,) = caught.value.problems
        assert re.match(rf"^{re.escape(str(path))}:\d+: ", problem) and "NUL byte" in problem, (where, problem)
