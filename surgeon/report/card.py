"""The model card (README.md) of an export: front matter for the Hub, then what was done and why."""

from __future__ import annotations

import yaml

from ..measure.metrics import METRIC_NAMES
from .chat_sections import chat_section, ifeval_section
from .merge_section import merge_section
from .provenance_plots import CARD_PREFIXES
from .vision_rows import vision_rows

_TAGS_BY_OP = {
    "drop_layers": "layer-pruning",
    "stack": "passthrough",
    "merge": "merge",
    "heal": "distillation",
    "evaluate": None,
    "graft_vision": "vision-graft",
    "reduce_kv_heads": "gqa",
    "sparse_attention": "sparse-attention",
}


def render_card(report: dict, recipe_text: str, plots: list[str] = ()) -> str:
    vision = any(p["op"] == "graft_vision" for p in report["provenance"])
    lines = _header(report, vision) + _what_was_done(report)
    stages = report["stages"]
    lines += _kl_section([s for s in stages if s.get("kind", "kl") == "kl"])
    lines += chat_section([s for s in stages if s.get("kind") == "chat"])
    lines += ifeval_section([s for s in stages if s.get("kind") == "ifeval"])
    lines += _instruction_section([s for s in stages if s.get("kind") == "instructions"])
    vision_stages = [s for s in stages if s.get("kind") == "vision"]
    if vision_stages:
        lines += _vision_section(vision_stages)
    lines += _plots_section(plots)
    for entry in report["provenance"]:
        if entry["op"] == "heal":
            lines += _healing_section(entry)
        elif entry["op"] == "merge":
            lines += merge_section(entry)
    lines += _use_section(vision, report)
    lines += ["## Recipe", "", "```yaml", recipe_text.strip(), "```", ""]
    return "\n".join(lines)


def _header(report: dict, vision: bool) -> list[str]:
    """Front matter for the Hub, the title, where it came from and the shape before and after."""
    tags = ["model-surgeon"] + sorted({t for p in report["provenance"] if (t := _TAGS_BY_OP.get(p["op"]))})
    front = {
        "library_name": "transformers",
        "pipeline_tag": "image-text-to-text" if vision else "text-generation",
        "tags": tags,
    }
    hub_id = report["base"].get("hub_id")
    if hub_id:
        front["base_model"] = hub_id
    before, after = report["shape"]["before"], report["shape"]["after"]
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {report['name']}",
        "",
        f"Made with [model-surgeon](https://pypi.org/project/model-surgeon/) from **{report['base']['label']}**"
        + (f" ([{hub_id}](https://huggingface.co/{hub_id}))" if hub_id else "")
        + ".",
        "",
    ]
    if report.get("description"):
        lines += [report["description"].strip(), ""]
    return lines + [
        "| | layers | heads | KV heads | parameters |",
        "|---|---:|---:|---:|---:|",
        f"| parent | {before['layers']} | {before['heads']} | {before['kv_heads']} | {before['params']:,} |",
        f"| this model | {after['layers']} | {after['heads']} | {after['kv_heads']} | {after['params']:,} |",
        "",
    ]


def _what_was_done(report: dict) -> list[str]:
    lines = ["## What was done", ""]
    if not report["provenance"]:
        lines += ["No operation changed the model.", ""]
    for number, entry in enumerate(report["provenance"], start=1):
        lines += [f"{number}. **{entry['op']}**: {entry['what']}. Why: {entry['why']}."]
    return lines + [""]


def _kl_section(kl_stages: list[dict]) -> list[str]:
    if not kl_stages:
        return []
    lines = [
        "## Measured against the parent",
        "",
        "KL(parent ‖ this model) per token over the whole vocabulary, top-1 agreement of the two argmaxes, "
        "and perplexity of both on held-out text (non-overlapping windows, BOS first where the tokenizer has one).",
        "",
        "| stage | data | " + " | ".join(METRIC_NAMES) + " |",
        "|---|---|" + "---:|" * len(METRIC_NAMES),
    ]
    for stage in kl_stages:
        cells = [_fmt(stage["metrics"].get(name, "—")) for name in METRIC_NAMES]  # kl_max: newer reports only
        lines.append(f"| {stage['name']} | {stage['data']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _instruction_section(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    lines = [
        "## Instruction check",
        "",
        f"{checks[0]['metrics']['total']} prompts with checkable answers (capitals, arithmetic, lists, "
        "yes/no facts), greedy decoding.",
        "",
        "| stage | correct | parent |",
        "|---|---:|---:|",
    ]
    for stage in checks:
        m = stage["metrics"]
        lines.append(f"| {stage['name']} | {m['correct']}/{m['total']} | {m['parent_correct']}/{m['total']} |")
    return lines + [""]


def _plots_section(plots: list[str]) -> list[str]:
    """The analysis figures the steps measured under their own heading, then the other plots."""
    analysis = [name for name in plots if name.startswith(CARD_PREFIXES)]
    lines = []
    if analysis:
        lines += [
            "## Layer analysis",
            "",
            "What the steps measured on their calibration text, drawn as `surgeon analyze` draws it"
            + (
                " (shaded: the removed block's start; circled: the removed layers)."
                if any(n.startswith("angular") for n in analysis)
                else "."
            ),
            "",
        ]
        lines += [f"![{name.removesuffix('.png')}]({name})\n" for name in analysis]
    return lines + [f"![{name.removesuffix('.png')}]({name})\n" for name in plots if name not in analysis]


def _healing_section(entry: dict) -> list[str]:
    training, data = entry["details"]["training"], entry["details"]["data"]
    heldout = entry["details"].get("heldout") or []
    trainable = entry["params"]["trainable"]
    lines = [
        "## Healing",
        "",
        f"- {training['steps']} optimizer steps, {training['tokens']:,} target tokens in {training['seconds']:.0f} s "
        f"({training['tokens_per_second']} tokens/s, {training['precision']})"
        + (f"; stopped early, weights of step {training['best_step']} kept" if training["stopped_early"] else ""),
        f"- trained {trainable['trainable']:,} of {trainable['total']:,} parameters"
        + (
            f"; the first {training['shared_prefix_layers']} layers were shared with the teacher and skipped"
            if training["shared_prefix_layers"]
            else ""
        ),
    ]
    if "train_examples" in data:  # a grafted VLM trained on image questions
        lines.append(f"- data: {data['train_examples']:,} image questions, {data['heldout_examples']} held out")
        prepared = training.get("prepared")
        if prepared:
            how = (
                "all read from the cache"
                if prepared["from_cache"] == prepared["images"]
                else f"computed in {prepared['seconds'] / 60:.1f} min"
                + (f" ({prepared['from_cache']:,} read from the cache)" if prepared["from_cache"] else "")
            )
            lines.append(
                f"- the frozen tower's outputs for {prepared['images']:,} images, {how}, "
                "apart from the training time above"
            )
        if len(heldout) >= 2:
            lines.append(
                f"- held-out answer loss {heldout[0]['loss']:.4f} -> {heldout[-1]['loss']:.4f}; exact answers "
                f"{heldout[0]['exact']:.1%} -> {heldout[-1]['exact']:.1%}"
            )
        return lines + [""]
    lines.append(
        f"- data: {data['train_windows']} windows of {data['window']} tokens, {data['heldout_windows']} held out"
    )
    for made in entry["details"].get("generation", []):
        how = "read from the cache" if made["cached"] else f"generated in {made['seconds'] / 60:.1f} min"
        lines.append(
            f"- the teacher's answers to {made['prompts']} prompts ({made['conversations']} conversations, "
            f"{made['tokens']:,} tokens), {how}, apart from the training time above"
        )
    if len(heldout) >= 2:
        lines.append(f"- held-out KL: {heldout[0]['kl_mean']:.4f} before healing, {heldout[-1]['kl_mean']:.4f} after")
    return lines + [""]


def _fmt(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def _vision_section(stages: list[dict]) -> list[str]:
    lines = [
        "## Image questions",
        "",
        "Exact answers (greedy decoding) on held-out image questions; *shuffled* asks the same questions "
        "about other examples' images, and *chance* is what always giving the commonest answer of each "
        "kind scores.",
        "",
        "| stage | data | kind | accuracy | shuffled | chance | examples |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for stage in stages:
        for row in vision_rows(stage["metrics"]):
            lines.append(
                f"| {stage['name']} | {row.source} | {row.kind or 'all'} | {row.accuracy:.1%} | "
                f"{_fmt_share(row.shuffled)} | {_fmt_share(row.chance)} | "
                f"{'' if row.examples is None else row.examples} |"
            )
    return lines + [""]


def _fmt_share(value) -> str:
    return "" if value is None else f"{value:.1%}"


def _use_section(vision: bool, report: dict) -> list[str]:
    if not vision:
        sparse = any(p["op"] == "sparse_attention" for p in report["provenance"])
        flag = ", trust_remote_code=True" if sparse else ""
        return [
            "## Use",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO"{flag})',
            f'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO"{flag})',
            "```",
            "",
            *(
                [
                    "The sparse-attention model class is saved beside the weights (`auto_map`); "
                    "`trust_remote_code=True` runs that code, which you can read first.",
                    "",
                ]
                if sparse
                else []
            ),
            *(
                [
                    "The weights are int4/int8 in compressed-tensors format: transformers needs the "
                    "`compressed-tensors` package (`pip install compressed-tensors`); vLLM and "
                    "`surgeon serve` load them as they are.",
                    "",
                ]
                if report["provenance"] and report["provenance"][-1]["op"] == "quantize"  # not healed since
                else []
            ),
        ]
    remote = report.get("export_class") != "LlavaForConditionalGeneration"
    flag = ", trust_remote_code=True" if remote else ""
    return [
        "## Use",
        "",
        "```python",
        "from PIL import Image",
        "from transformers import AutoModelForImageTextToText, AutoProcessor",
        "",
        f'model = AutoModelForImageTextToText.from_pretrained("PATH_OR_REPO"{flag})',
        f'processor = AutoProcessor.from_pretrained("PATH_OR_REPO"{flag})',
        'chat = [{"role": "user", "content": [{"type": "image"}, '
        '{"type": "text", "text": "What colour is the shape?"}]}]',
        "prompt = processor.apply_chat_template(chat, add_generation_prompt=True)",
        'inputs = processor(images=[Image.open("picture.png")], text=prompt, return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=16, do_sample=False)",
        'print(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        ""
        if not remote
        else "The model class is saved beside the weights (`auto_map`); "
        "`trust_remote_code=True` runs that code, which you can read first.",
        "",
    ]
