"""Every recipe in recipes/ goes through `surgeon run` end to end, as a new user runs it, with exit 0
and a summary line for every stage — on a tiny-model twin, so CI can afford all of them.

A twin keeps the recipe's steps, options and data files and swaps only what costs time: the base
becomes a tiny random model of the same family with the same layer count (so layer ranges and globs
still mean what they say), and counts (tokens, steps, examples, prompts) are capped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, requires_shared_data, save_tiny_model
from surgeon import cli
from surgeon.report.summary import _LINES

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

# The real bases' shapes that recipes address by layer number.
BASES = {
    "smollm2-135m-instruct": ("llama", 30),
    "gemma3-270m": ("gemma3", 18),
}
CAPS = {
    "tokens": 384,
    "steps": 2,
    "examples": 12,
    "heldout_examples": 4,
    "heldout_windows": 2,
    "batch_size": 2,
    "batch": 2,
    "samples": 1,
    "max_new_tokens": 32,
    "max_tokens": 16,
    "count": 8,
    "vocabulary": 64,
    "limit": 3,
    "window": 64,
    "every": 1,
    "checkpoint_every": 1,
}


def _is_recipe_file(recipe_dir: Path, value: str) -> bool:
    """A path beside the recipe, such as prompts/chat-eval.txt (not prose that merely is a string)."""
    return "\n" not in value and len(value) < 200 and (recipe_dir / value).is_file()


def twin(recipe: dict, base: Path, recipe_dir: Path) -> dict:
    """The recipe with counts capped and relative data paths made absolute (the twin lives elsewhere)."""

    def shrink(value, key=None):
        if isinstance(value, dict):
            out = {k: shrink(v, k) for k, v in value.items()}
            if key == "mnist":  # a held-out split is every held-out row unless capped
                out["examples"] = min(out.get("examples") or CAPS["examples"], CAPS["examples"])
            return out
        if isinstance(value, list):
            items = value[:4] if key == "prompts" else value
            return [shrink(v, key) for v in items]
        if isinstance(value, int) and not isinstance(value, bool) and key in CAPS:
            return min(value, CAPS[key])
        if isinstance(value, str) and (value.startswith(("../", "./")) or _is_recipe_file(recipe_dir, value)):
            return str((recipe_dir / value).resolve())
        return value

    out = shrink(recipe)
    out["base"] = str(base)
    return out


@pytest.fixture(scope="module")
def tiny_bases(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("twin-bases")
    return {
        name: save_tiny_model(root / name, family, tokenizer_dir, layers=layers)
        for name, (family, layers) in BASES.items()
    }


@requires_shared_data
@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_runs_end_to_end_through_the_cli(recipe_path, tiny_bases, tmp_path, capsys):
    recipe = yaml.safe_load(recipe_path.read_text())
    assert recipe["base"] in tiny_bases, f"{recipe_path.name}: no tiny twin for base {recipe['base']!r}"
    twin_path = tmp_path / recipe_path.name
    twin_path.write_text(yaml.safe_dump(twin(recipe, tiny_bases[recipe["base"]], recipe_path.parent)))
    out = tmp_path / "out"

    code = cli.main(["run", str(twin_path), "--out", str(out)])

    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert list(out.glob("*.safetensors")) and (out / "README.md").is_file(), sorted(p.name for p in out.iterdir())
    report = json.loads((out / "report.json").read_text())
    lines = printed.out.splitlines()
    assert lines[-1].startswith(f"exported {out}")
    for stage in report["stages"]:
        assert stage.get("kind", "kl") in _LINES, f"stage kind {stage.get('kind')!r} has no summary line"
        assert any(line.startswith(f"{stage['name']}") for line in lines), (stage["name"], printed.out)
    measuring_steps = [s for s in recipe["steps"] if next(iter(s)).startswith(("evaluate", "check"))]
    assert len(report["stages"]) >= len(measuring_steps)


def test_every_stage_kind_has_a_readable_summary_line():
    """The kinds `surgeon run` prints; a vision stage has no kl_mean (it once raised KeyError here)."""
    from surgeon.report.summary import stage_line

    kl = {"kl_mean": 0.31, "kl_median": 0.2, "kl_p99": 1.5, "top1_agreement": 0.7, "ppl": 40.0}
    stages = [
        {
            "name": "after heal",
            "data": "persuasion.txt",
            "kind": "kl",
            "metrics": {**kl, "ppl_parent": 39.0, "tokens": 8},
        },
        {
            "name": "after heal",
            "data": "",
            "kind": "instructions",
            "metrics": {"correct": 9, "total": 26, "parent_correct": 17},
        },
        {
            "name": "after heal",
            "data": "synthetic, mnist",
            "kind": "vision",
            "metrics": {
                "synthetic_accuracy": 0.9,
                "synthetic_shuffled_accuracy": 0.3,
                "synthetic_chance": 0.25,
                "synthetic_examples": 600,
                "mnist_accuracy": 0.8,
            },
        },
        {"name": "after x", "data": "d", "kind": "something new", "metrics": {"score": 0.5, "note": "n/a"}},
    ]
    lines = [stage_line(stage) for stage in stages]
    assert lines[0].startswith("after heal on persuasion.txt: kl_mean 0.3100")
    assert lines[1] == "after heal: instructions 9/26 right (parent 17/26)"
    assert lines[2] == (
        "after heal: image questions right: mnist 80.0%; synthetic 90.0% of 600 (shuffled 30.0%, chance 25.0%)"
    )
    assert lines[3] == "after x (something new) on d: score 0.5"
