"""analyze(): load a model, measure it on text, write the plots, report.html, measures.json and
suggested-recipe.yaml into one folder."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.atomic import atomic_folder
from ..checkpoints.sources import resolve_source
from ..report import figures
from ..text import TextData, describe_files, resolve_files, token_windows
from .html_report import render_html
from .measures import LayerMeasures, measure
from .suggest import Suggestion, recipe_text, suggest

log = logging.getLogger(__name__)


@dataclass
class Report:
    folder: Path
    measures: LayerMeasures
    suggestion: Suggestion
    figures: dict[str, figures.Figure]  # file name -> figure
    seconds: float

    @property
    def html(self) -> Path:
        return self.folder / "report.html"

    @property
    def recipe(self) -> Path:
        return self.folder / "suggested-recipe.yaml"


def analyze(
    model_spec: str, data_files: list[str], out_dir: str | Path, tokens: int = 8192, window: int = 512
) -> Report:
    started = time.perf_counter()
    source = resolve_source(model_spec, Path.cwd())
    files = resolve_files(list(data_files), Path.cwd(), "data")
    model, tokenizer = source.load_model(), source.load_tokenizer()
    windows = token_windows(tokenizer, files, TextData(text=[str(f) for f in files], tokens=tokens, window=window))
    log.info("measuring %s on %d windows of %s", source.describe(), len(windows), describe_files(files))
    m = measure(model, windows)
    suggestion = suggest(m)
    drawn = draw(m, suggestion)
    out = Path(out_dir)
    name = f"{Path(model_spec).name}-suggested"
    recipe = recipe_text(suggestion, name, model_spec, model.config.model_type, files, out, tokens)
    title = f"surgeon analyze: {source.describe()} on {describe_files(files)} ({windows.numel():,} tokens)"
    with atomic_folder(out) as tmp:  # a rerun replaces the whole folder, never half of it
        for figure in drawn:
            (tmp / figure.name).write_bytes(figure.png)
        (tmp / "measures.json").write_text(json.dumps(m.as_dict(), indent=1) + "\n")
        (tmp / "suggested-recipe.yaml").write_text(recipe)
        (tmp / "report.html").write_text(render_html(title, m, drawn, suggestion.summary(), suggestion.reasons, recipe))
    return Report(out, m, suggestion, {f.name: f for f in drawn}, time.perf_counter() - started)


def draw(m: LayerMeasures, suggestion: Suggestion | None = None) -> list[figures.Figure]:
    chosen = suggestion.drop if suggestion else None
    sizes = sorted({n for n in (1, 2, 4, len(chosen or [])) if n in m.angular})
    drawn = [figures.angular_distance(m.angular, sizes, chosen), figures.block_influence(m.influence, chosen)]
    if m.kv_similarity:
        drawn.append(figures.kv_similarity(m.kv_similarity, m.merge_loss))
    if m.recall:
        drawn.append(figures.indexer_recall({"recall on the analysis text": m.recall}))
    return drawn
