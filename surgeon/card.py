"""The model card (README.md) of an export: front matter for the Hub, then what was done and why."""

from __future__ import annotations

import yaml

from .metrics import METRIC_NAMES

_TAGS_BY_OP = {"drop_layers": "layer-pruning", "stack": "passthrough", "heal": "distillation", "evaluate": None}


def render_card(report: dict, recipe_text: str, plots: list[str] = ()) -> str:
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
    kl_stages = [s for s in report["stages"] if s.get("kind", "kl") == "kl"]
    checks = [s for s in report["stages"] if s.get("kind") == "instructions"]
    if kl_stages:
        lines += [
            "## Measured against the parent",
            "",
            "KL(parent ‖ this model) per token over the whole vocabulary, top-1 agreement of the two argmaxes, "
            "and perplexity of both on held-out text (non-overlapping windows, BOS first where the tokenizer has one).",
            "",
            "| stage | data | " + " | ".join(METRIC_NAMES) + " |",
            "|---|---|" + "---:|" * len(METRIC_NAMES),
        ]
        for stage in kl_stages:
            cells = [_fmt(stage["metrics"][name]) for name in METRIC_NAMES]
            lines.append(f"| {stage['name']} | {stage['data']} | " + " | ".join(cells) + " |")
        lines.append("")
    if checks:
        lines += ["## Instruction check", "",
                  f"{checks[0]['metrics']['total']} prompts with checkable answers (capitals, arithmetic, lists, "
                  "yes/no facts), greedy decoding.", "", "| stage | correct | parent |", "|---|---:|---:|"]
        for stage in checks:
            m = stage["metrics"]
            lines.append(f"| {stage['name']} | {m['correct']}/{m['total']} | {m['parent_correct']}/{m['total']} |")
        lines.append("")
    lines += [f"![{name.removesuffix('.png')}]({name})\n" for name in plots]
    for entry in report["provenance"]:
        if entry["op"] == "heal":
            lines += _healing_section(entry)
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


def _healing_section(entry: dict) -> list[str]:
    training, data = entry["details"]["training"], entry["details"]["data"]
    heldout = entry["details"].get("heldout") or []
    lines = [
        "## Healing",
        "",
        f"- {training['steps']} optimizer steps, {training['tokens']:,} target tokens in {training['seconds']:.0f} s "
        f"({training['tokens_per_second']} tokens/s, {training['precision']})"
        + (f"; stopped early, weights of step {training['best_step']} kept" if training["stopped_early"] else ""),
        f"- trained {entry['params']['trainable']['trainable']:,} of {entry['params']['trainable']['total']:,} parameters"
        + (f"; the first {training['shared_prefix_layers']} layers were shared with the teacher and skipped"
           if training["shared_prefix_layers"] else ""),
        f"- data: {data['train_windows']} windows of {data['window']} tokens, {data['heldout_windows']} held out",
    ]
    if len(heldout) >= 2:
        lines.append(f"- held-out KL: {heldout[0]['kl_mean']:.4f} before healing, {heldout[-1]['kl_mean']:.4f} after")
    return lines + [""]


def _fmt(value) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
