"""analyze(): load a model, measure it on text, write the plots, report.html, measures.json and
suggested-recipe.yaml into one folder."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from .. import families
from ..checkpoints.atomic import atomic_folder
from ..checkpoints.sources import resolve_source
from ..errors import DataError, SurgeonError
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
    def recipe(self) -> Path | None:
        """The suggested recipe, or None where none can be written (see the suggestion's reasons)."""
        return self.folder / "suggested-recipe.yaml" if self.suggestion.has_recipe else None


def analyze(
    model_spec: str,
    data_files: list[str],
    out_dir: str | Path,
    tokens: int = 8192,
    window: int = 512,
    heldout_files: list[str] | None = None,
) -> Report:
    """`data_files`: what is measured (and what the suggested recipe calibrates and heals on);
    `heldout_files`: text the suggested recipe's evaluate steps read, which must not overlap it."""
    started = time.perf_counter()
    source = resolve_source(model_spec, Path.cwd())
    files = resolve_files(list(data_files), Path.cwd(), "data")
    heldout = resolve_files(list(heldout_files), Path.cwd(), "heldout") if heldout_files else None
    if heldout and (shared := sorted({f.resolve() for f in files} & {f.resolve() for f in heldout})):
        raise DataError(
            f"--heldout shares {', '.join(str(f) for f in shared)} with --data: held-out text must be "
            "text the suggested recipe does not calibrate or heal on"
        )
    model, tokenizer = source.load_model(), source.load_tokenizer()
    windows = token_windows(tokenizer, files, TextData(text=[str(f) for f in files], tokens=tokens, window=window))
    log.info("measuring %s on %d windows of %s", source.describe(), len(windows), describe_files(files))
    m = measure(model, windows)
    suggestion = suggest(m, model.config, dense_origin(source, model.config.model_type))
    drawn = draw(m, suggestion)
    out = Path(out_dir)
    name = f"{Path(model_spec).name}-suggested"
    recipe = None
    if suggestion.has_recipe:
        recipe = recipe_text(suggestion, name, model_spec, model.config.model_type, files, out, tokens, heldout)
    title = f"surgeon analyze: {source.describe()} on {describe_files(files)} ({windows.numel():,} tokens)"
    with atomic_folder(out) as tmp:  # a rerun replaces the whole folder, never half of it
        for figure in drawn:
            (tmp / figure.name).write_bytes(figure.png)
        (tmp / "measures.json").write_text(json.dumps(m.as_dict(), indent=1) + "\n")
        if recipe is not None:
            (tmp / "suggested-recipe.yaml").write_text(recipe)
        html = render_html(title, m, drawn, suggestion.summary(), suggestion.reasons, recipe or "")
        (tmp / "report.html").write_text(html)
    return Report(out, m, suggestion, {f.name: f for f in drawn}, time.perf_counter() - started)


def dense_origin(source, model_type: str) -> str | None:
    """For a sparse-attention export: the dense model it was made from, as its report.json names
    it, if surgeon can find that model (an alias, or a folder beside the export); else None."""
    if not families.is_sparse_export(model_type) or source.kind != "folder":
        return None
    report = Path(source.location) / "report.json"
    try:
        label = json.loads(report.read_text())["base"]["label"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for base_dir in (Path(source.location), Path(source.location).parent, Path.cwd()):
        try:
            found = resolve_source(label, base_dir)
        except SurgeonError:
            continue
        return found.location if found.kind != "alias" else label
    return None


def draw(m: LayerMeasures, suggestion: Suggestion | None = None) -> list[figures.Figure]:
    chosen = (suggestion.drop or None) if suggestion else None
    sizes = sorted({n for n in (1, 2, 4, len(chosen or [])) if n in m.angular})
    drawn = [figures.angular_distance(m.angular, sizes, chosen), figures.block_influence(m.influence, chosen)]
    if m.kv_similarity:
        drawn.append(figures.kv_similarity(m.kv_similarity, m.merge_loss))
    if m.recall:
        drawn.append(figures.indexer_recall({"recall on the analysis text": m.recall}))
    return drawn
