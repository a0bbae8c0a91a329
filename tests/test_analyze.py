"""`surgeon analyze` on tiny models: plots exist, are PNGs with the expected curves, the HTML shows
them all, and the suggested recipe passes surgeon's own validation and plan."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image
from transformers import AutoTokenizer, LlamaForCausalLM

from conftest import tiny_config
from surgeon.analysis import analyze
from surgeon.cli import main
from surgeon.modeling import SurgeonSparseLlamaConfig, SurgeonSparseLlamaForCausalLM
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.schema import load_recipe

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS = 1024  # 8 windows of 128: enough for every measure, fast


def _check_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    with Image.open(io.BytesIO(data)) as image:
        image.verify()
        assert image.format == "PNG"


@pytest.fixture(scope="module")
def dense_report(tiny_llama, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis") / "llama"
    return analyze(str(tiny_llama), [str(text_dir / "calibration.txt")], out, tokens=TOKENS, window=128)


def test_dense_model_gets_every_plot_with_its_curves(dense_report):
    # 6 layers: angular curves for n = 1, 2, 4 (the suggested size, 1, among them); one influence
    # curve; K and V cosines plus K and V energy kept for the one candidate head count (2 -> 1).
    expected = {"angular-distance.png": 3, "block-influence.png": 1, "kv-head-similarity.png": 4}
    assert {name: f.curves for name, f in dense_report.figures.items()} == expected
    page = dense_report.html.read_text()
    for name in expected:
        _check_png(dense_report.folder / name)
        assert name in page
    assert "data:image/png;base64," in page and "drop_layers" in page
    assert len(dense_report.measures.influence) == 6
    assert sorted(dense_report.measures.merge_loss) == [1]


def test_suggested_recipe_validates_and_plans(dense_report):
    recipe = load_recipe(dense_report.recipe)
    plan = plan_recipe(recipe)
    ops = [step.op for step in recipe.steps]
    assert ops[0] == "drop_layers" and "heal" in ops and ops[-1] == "evaluate"
    assert (ops[1] == "reduce_kv_heads") == (dense_report.suggestion.kv_heads is not None)
    assert plan is not None
    assert yaml.safe_load(dense_report.recipe.read_text())["steps"][0]["drop_layers"]["layers"]


def test_sparse_model_adds_the_recall_plot(tokenizer_dir, text_dir, tmp_path):
    config = tiny_config("llama", layers=4)
    sparse_config = SurgeonSparseLlamaConfig(
        sparse_attention={"top_k": 16, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8},
        **config.to_dict(),
    )
    sparse = SurgeonSparseLlamaForCausalLM(sparse_config)
    sparse.load_state_dict(LlamaForCausalLM(config).state_dict(), strict=False)
    sparse.save_pretrained(tmp_path / "sparse")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / "sparse")
    report = analyze(
        str(tmp_path / "sparse"), [str(text_dir / "calibration.txt")], tmp_path / "out", tokens=512, window=128
    )
    assert report.figures["indexer-recall.png"].curves == 1
    assert sorted(report.measures.recall) == [0, 1, 2, 3]
    assert all(0 < r <= 1 for r in report.measures.recall.values())
    _check_png(tmp_path / "out" / "indexer-recall.png")
    assert "indexer-recall.png" in report.html.read_text()
    # Saved without a report.json, nothing names the dense model it came from: no recipe, and why.
    assert report.recipe is None and not (tmp_path / "out" / "suggested-recipe.yaml").exists()
    assert any("no recipe" in reason for reason in report.suggestion.reasons)


def test_a_sparse_export_gets_a_rebuild_recipe_that_validates(tokenizer_dir, text_dir, tiny_llama, tmp_path):
    """A sparse model takes no layer surgery itself: the suggestion rebuilds it from the dense base
    its report.json names, sparse on the layers whose recall clears the bar, and it plans."""
    from surgeon.analysis import suggest as suggest_module
    from surgeon.analysis.measures import LayerMeasures

    dense = {k: v for k, v in tiny_config("llama", layers=6).to_dict().items() if k != "model_type"}
    sparse_config = SurgeonSparseLlamaConfig(
        sparse_attention={"top_k": 16, "sinks": 2, "window": 3, "index_heads": 2, "index_dim": 16, "rope_dim": 8},
        **dense,
    )
    measures = LayerMeasures(
        6, 2, {1: [0.1] * 6}, [0.1] * 6, None, {}, {0: 0.5, 1: 0.9, 2: 0.95, 3: 0.7, 4: 0.85, 5: 0.99}
    )
    suggestion = suggest_module.suggest(measures, sparse_config, str(tiny_llama))
    assert suggestion.sparse["layers"] == [1, 2, 4, 5] and suggestion.has_recipe
    assert "0, 3 fall below and stay dense" in suggestion.reasons[0]
    calibration, heldout = text_dir / "calibration.txt", text_dir / "heldout.txt"
    text = suggest_module.recipe_text(
        suggestion, "rebuilt", "sparse-export", sparse_config.model_type, [calibration], tmp_path, 512, [heldout]
    )
    path = tmp_path / "suggested-recipe.yaml"
    path.write_text(text)
    recipe = load_recipe(path)
    assert [step.op for step in recipe.steps] == ["sparse_attention", "evaluate", "heal", "evaluate"]
    assert recipe.steps[0].params.layers == [1, 2, 4, 5]
    plan = plan_recipe(recipe)
    assert "top-16 keys on 4 layers" in plan.rows[1].note

    # Through analyze, with the export's report.json naming that base: the recipe is written.
    sparse = SurgeonSparseLlamaForCausalLM(SurgeonSparseLlamaConfig(**sparse_config.to_dict()))
    sparse.save_pretrained(tmp_path / "sparse")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / "sparse")
    (tmp_path / "sparse" / "report.json").write_text(json.dumps({"base": {"label": str(tiny_llama)}}))
    report = analyze(str(tmp_path / "sparse"), [str(calibration)], tmp_path / "out", tokens=512, window=128)
    assert report.suggestion.origin == str(tiny_llama)
    if report.suggestion.sparse:  # random indexers: their recall decides which layers stay sparse
        assert plan_recipe(load_recipe(report.recipe)) is not None
    else:
        assert report.recipe is None and "none" in report.suggestion.reasons[0]


def test_heldout_text_is_what_the_suggested_recipe_evaluates_on(tiny_llama, text_dir, tmp_path):
    calibration, heldout = text_dir / "calibration.txt", text_dir / "heldout.txt"
    report = analyze(
        str(tiny_llama), [str(calibration)], tmp_path / "out", tokens=512, window=128, heldout_files=[str(heldout)]
    )
    steps = yaml.safe_load(report.recipe.read_text())["steps"]
    evaluates = [s["evaluate"]["data"]["text"] for s in steps if "evaluate" in s]
    trains = [src["text"] for s in steps if "heal" in s for src in s["heal"]["data"]["sources"]]
    assert evaluates and all(Path(report.folder, t).resolve() == heldout for t in evaluates)
    assert trains and all(Path(report.folder, t).resolve() == calibration for t in trains)
    assert "(--heldout)" in report.recipe.read_text()
    assert plan_recipe(load_recipe(report.recipe)) is not None
    # The same file on both sides is refused before anything is measured.
    code = main(
        [
            "analyze",
            str(tiny_llama),
            "--data",
            str(calibration),
            "--heldout",
            str(calibration),
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert code == 2 and not (tmp_path / "b").exists()


def test_cli_reports_a_missing_data_file(tiny_llama, tmp_path, capsys):
    code = main(["analyze", str(tiny_llama), "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "a")])
    assert code == 2
    assert "error: " in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_model_card_shows_the_plots_its_steps_measured():
    from surgeon.report.card import render_card
    from surgeon.report.plots import report_plots

    shape = {"layers": 4, "heads": 4, "kv_heads": 2, "params": 1000}
    report = {
        "name": "tiny",
        "base": {"label": "tiny"},
        "stages": [],
        "shape": {"before": shape, "after": shape},
        "provenance": [
            {
                "op": "drop_layers",
                "what": "dropped layers 2-3",
                "why": "angular",
                "params": {"layers": [2, 3]},
                "details": {
                    "angular_distance_by_block_start": [0.3, 0.2, 0.1, 0.25, 0.3],
                    "block_influence_by_layer": [0.9, 0.1, 0.05, 0.04, 0.2, 0.3],
                },
            },
            {
                "op": "sparse_attention",
                "what": "sparse",
                "why": "flops",
                "params": {},
                "details": {"recall_at_init": {"1": 0.5, "2": 0.6}, "recall": {"1": 0.9, "2": 0.95}},
            },
        ],
    }
    plots = report_plots(report)
    names = ["angular-distance-1.png", "block-influence-1.png", "indexer-recall-2.png"]
    assert all(plots[name].startswith(PNG_SIGNATURE) for name in names)
    card = render_card(report, "name: tiny", sorted(plots))
    assert "## Layer analysis" in card and all(f"({name})" in card for name in names)
