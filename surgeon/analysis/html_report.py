"""report.html: one self-contained page (PNGs inlined as base64) with the plots, the numbers per
layer and the suggested recipe."""

from __future__ import annotations

import base64
import html

from ..report.figures import Figure
from .measures import LayerMeasures


def render_html(
    title: str, m: LayerMeasures, figures: list[Figure], summary: str, reasons: list[str], recipe: str
) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;"
        "text-align:right}pre{background:#f6f6f6;padding:1em;overflow:auto}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<h2>Suggestion</h2><p><b>{html.escape(summary)}</b></p><ul>",
        *[f"<li>{html.escape(r)}</li>" for r in reasons],
        "</ul>",
    ]
    for figure in figures:
        data = base64.b64encode(figure.png).decode()
        parts.append(
            f"<h2>{html.escape(figure.title)}</h2><p><code>{figure.name}</code></p>"
            f"<img alt='{figure.name}' src='data:image/png;base64,{data}'>"
        )
    parts += [
        "<h2>Per layer</h2>",
        _table(m),
        "<h2>Suggested recipe</h2>",
        f"<p><code>suggested-recipe.yaml</code></p><pre>{html.escape(recipe)}</pre>"
        if recipe
        else "<p>None: see the reasons above.</p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _table(m: LayerMeasures) -> str:
    columns = {"angular n=1": m.angular.get(1, []), "block influence": m.influence}
    if m.kv_similarity:
        columns.update({"K cosine": m.kv_similarity["k"], "V cosine": m.kv_similarity["v"]})
        for target, loss in sorted(m.merge_loss.items()):
            columns.update({f"K lost ->{target}": loss["k"], f"V lost ->{target}": loss["v"]})
    if m.recall:
        columns["indexer recall"] = [m.recall.get(i) for i in range(m.layers)]
    rows = ["<table><tr><th>layer</th>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns) + "</tr>"]
    for layer in range(m.layers):
        cells = [values[layer] if layer < len(values) else None for values in columns.values()]
        rows.append(
            f"<tr><td>{layer}</td>" + "".join(f"<td>{'' if v is None else f'{v:.4f}'}</td>" for v in cells) + "</tr>"
        )
    return "\n".join(rows + ["</table>"])
