"""The fine-tune-and-merge experiment (recipes/merge/) runs end to end through `surgeon run` on tiny
twins: both fine-tunes first, then every merge recipe on their exports, each with exit 0 and a
summary line per stage."""

from __future__ import annotations

import json

import yaml
from test_recipes_run import BASES, twin

from conftest import ROOT, requires_shared_data, save_tiny_model
from surgeon import cli

MERGE_DIR = ROOT / "recipes" / "merge"
FINETUNES = {"austen": MERGE_DIR / "finetune-austen.yaml", "shakespeare": MERGE_DIR / "finetune-shakespeare.yaml"}
MERGES = sorted(p for p in MERGE_DIR.glob("*.yaml") if p not in FINETUNES.values())


def _run(recipe: dict, path, out, capsys) -> str:
    path.write_text(yaml.safe_dump(recipe))
    code = cli.main(["run", str(path), "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    return printed.out


def test_the_set_is_complete():
    methods = {yaml.safe_load(p.read_text())["steps"][0]["merge"]["method"] for p in MERGES}
    assert methods == {"linear", "task_arithmetic", "ties", "dare_ties", "regmean"}
    for path in MERGES:
        sources = yaml.safe_load(path.read_text())["sources"]
        for name, finetune in FINETUNES.items():  # each merge reads where the fine-tune exports
            exported = (finetune.parent / yaml.safe_load(finetune.read_text())["export"]["path"]).resolve()
            assert (path.parent / sources[name]).resolve() == exported


@requires_shared_data
def test_finetunes_then_merges_run_end_to_end(tmp_path, tokenizer_dir, capsys):
    family, layers = BASES["smollm2-135m-instruct"]
    base = save_tiny_model(tmp_path / "base", family, tokenizer_dir, layers=layers)
    exported = {}
    for name, path in FINETUNES.items():
        recipe = twin(yaml.safe_load(path.read_text()), base, path.parent)
        exported[name] = tmp_path / f"ft-{name}"
        _run(recipe, tmp_path / path.name, exported[name], capsys)
    for path in MERGES:
        recipe = twin(yaml.safe_load(path.read_text()), base, path.parent)
        recipe["sources"] = {name: str(folder) for name, folder in exported.items()}
        out = tmp_path / path.stem
        printed = _run(recipe, tmp_path / path.name, out, capsys)
        report = json.loads((out / "report.json").read_text())
        assert report["provenance"][0]["op"] == "merge"
        for stage in report["stages"]:
            assert any(line.startswith(stage["name"]) for line in printed.splitlines()), (stage["name"], printed)
        assert "As a mergekit config" in (out / "README.md").read_text()


def test_regmean_calibrates_on_each_finetunes_training_text_never_on_what_it_is_judged_on():
    recipe = yaml.safe_load((MERGE_DIR / "regmean.yaml").read_text())

    def files(text, folder=MERGE_DIR) -> set:
        return {(folder / t).resolve() for t in ([text] if isinstance(text, str) else text)}

    judged = set()
    for step in recipe["steps"][1:]:
        if "evaluate" in step:
            judged |= files(step["evaluate"]["data"]["text"])
    assert judged
    for model in recipe["steps"][0]["merge"]["models"]:
        calibration = files(model["data"]["text"])
        assert calibration and not calibration & judged
        finetune = FINETUNES[model["model"]]
        heal = yaml.safe_load(finetune.read_text())["steps"][0]["heal"]
        trained_on = files(heal["data"]["sources"][0]["text"], finetune.parent)
        assert calibration == trained_on  # its own domain: what that fine-tune learned from
