"""The card's conversation sections: chat_kl against the parent's own answers, and IFEval."""

from __future__ import annotations

IFEVAL_CREDIT = (
    'IFEval: Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models" '
    "(arXiv 2311.07911), data CC BY 4.0; checks by `if-verifiable` (Google's code)."
)


def chat_section(stages: list[dict]) -> list[str]:
    if not stages:
        return []
    lines = [
        "## Measured on the parent's conversations",
        "",
        "The parent answers each chat prompt greedily once; this model is teacher-forced on those answers. "
        "chat_kl is KL(parent ‖ this model) per answer token; first 16 is the share of prompts whose greedy "
        "answer would start with the parent's 16 tokens.",
        "",
        "| stage | data | chat_kl | median | p99 | chat_top1 | first 16 | tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for stage in stages:
        m = stage["metrics"]
        lines.append(
            f"| {stage['name']} | {stage['data']} | {m['chat_kl_mean']:.4f} | {m['chat_kl_median']:.4f} | "
            f"{m['chat_kl_p99']:.3f} | {m['chat_top1']:.4f} | {m['chat_first16']:.0%} | {m['tokens']:,} |"
        )
    return lines + [""]


def ifeval_section(stages: list[dict]) -> list[str]:
    if not stages:
        return []
    first = stages[0]["metrics"]
    lines = [
        "## IFEval",
        "",
        f"Greedy through the chat template, at most {first['max_tokens']} tokens per answer. IFEval is the mean of "
        "prompt-level and instruction-level strict accuracy. " + IFEVAL_CREDIT,
        "",
        "| stage | prompts | IFEval | parent | prompt strict | instruction strict | prompt loose | instruction loose |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stage in stages:
        m = stage["metrics"]
        lines.append(
            f"| {stage['name']} | {m['prompts']} | {m['ifeval']:.3f} | {m['parent_ifeval']:.3f} | "
            f"{m['prompt_strict']:.3f} | {m['inst_strict']:.3f} | {m['prompt_loose']:.3f} | {m['inst_loose']:.3f} |"
        )
    splitter = stages[0].get("details", {}).get("sentence_splitter")
    if splitter and splitter != "nltk punkt":
        lines += ["", f"Sentence counting: {splitter}."]
    return lines + [""]
