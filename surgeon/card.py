"""The model card (README.md) of an export: front matter for the Hub, then what was done and why."""

from __future__ import annotations

import yaml

from .metrics import METRIC_NAMES

_TAGS_BY_OP = {"drop_layers": "layer-pruning", "stack": "passthrough", "evaluate": None}


def render_card(report: dict, recipe_text: str) -> str:
    tags = ["model-surgeon"] + sorted({t for p in report["provenance"] if (t := _TAGS_BY_OP.get(p["op"]))})
    front = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags,
    }
    if report["base"].get("hub_id"):
        front["base_model"] = report["base"]["hub_id"]
    before, after = report["shape"]["before"], report["shape"]["after"]
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {report['name']}",
        "",
        f"Made with [model-surgeon](https://pypi.org/project/model-surgeon/) from **{report['base']['label']}**"
        + (f" ([{report['base']['hub_id']}](https://huggingface.co/{report['base']['hub_id']}))" if report["base"].get("hub_id") else "")
        + ".",
        "",
    ]
    if report.get("description"):
        lines += [report["description"].strip(), ""]
    lines += [
        "| | layers | heads | KV heads | parameters |",
        "|---|---:|---:|---:|---:|",
        f"| parent | {before['layers']} | {before['heads']} | {before['kv_heads']} | {before['params']:,} |",
        f"| this model | {after['layers']} | {after['heads']} | {after['kv_heads']} | {after['params']:,} |",
        "",
        "## What was done",
        "",
    ]
    if not report["provenance"]:
        lines += ["No operation changed the model.", ""]
    for number, entry in enumerate(report["provenance"], start=1):
        lines += [f"{number}. **{entry['op']}**: {entry['what']}. Why: {entry['why']}."]
    lines += [""]
    if report["stages"]:
        lines += [
            "## Measured against the parent",
            "",
            "KL(parent ‖ this model) per token over the whole vocabulary, top-1 agreement of the two argmaxes, "
            "and perplexity of both on held-out text (non-overlapping windows, BOS first where the tokenizer has one).",
            "",
            "| stage | data | " + " | ".join(METRIC_NAMES) + " |",
            "|---|---|" + "---:|" * len(METRIC_NAMES),
        ]
        for stage in report["stages"]:
            cells = [_fmt(stage["metrics"][name]) for name in METRIC_NAMES]
            lines.append(f"| {stage['name']} | {stage['data']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")',
        "```",
        "",
        "## Recipe",
        "",
        "```yaml",
        recipe_text.strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
