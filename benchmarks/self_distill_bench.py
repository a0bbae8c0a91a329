"""Self-distillation's generation: surgeon's engine against the path it replaced, in one process.

    python benchmarks/self_distill_bench.py [--prompts 96] [--max-new-tokens 96]

Baseline (named "generate/16"): transformers `generate` over batches of 16 left-padded prompts,
sampled at temperature 0.7, as self_distill generated until the engine took over. Against it, the
engine as self_distill runs it (96 sequences at once, continuous batching, prefix cache) in fp32
and in bf16, on the same prompts (recipes/prompts/chat-heal.txt) and settings. Tokens/s counts
generated tokens (a finished answer stops counting; in a padded batch it keeps computing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def baseline(model, tokenizer, chats, max_new_tokens: int) -> int:
    """transformers generate, 16 prompts per call, left padding: tokens generated."""
    tokenizer.padding_side = "left"
    tokens = 0
    torch.manual_seed(0)
    for start in range(0, len(chats), 16):
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in chats[start : start + 16]
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=0.7,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, inputs["input_ids"].shape[1] :]:
            kept = row.tolist()
            tokens += next((i + 1 for i, t in enumerate(kept) if t == tokenizer.eos_token_id), len(kept))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    from surgeon import answers
    from surgeon.answers import AnswerSettings
    from surgeon.checkpoints.sources import resolve_source
    from surgeon.prompts import read_prompt_files

    source = resolve_source("smollm2-135m-instruct", ROOT)
    model, tokenizer = source.load_model().eval(), source.load_tokenizer()
    chats = read_prompt_files([ROOT / "recipes" / "prompts" / "chat-heal.txt"])[: args.prompts]
    rows = []
    with torch.inference_mode():
        start = time.perf_counter()
        tokens = baseline(model, tokenizer, chats, args.max_new_tokens)
        rows.append(("generate/16 (baseline)", tokens, time.perf_counter() - start))
        for dtype in ("float32", "bfloat16"):
            settings = AnswerSettings(max_new_tokens=args.max_new_tokens, temperature=0.7, dtype=dtype)
            start = time.perf_counter()
            _, ids, _ = answers._generate(model, tokenizer, chats, [None] * len(chats), settings)
            rows.append((f"engine, {dtype}, 96 at once", sum(len(i) for i in ids), time.perf_counter() - start))
    base_rate = rows[0][1] / rows[0][2]
    print(
        f"{len(chats)} prompts, <= {args.max_new_tokens} new tokens, temperature 0.7, {torch.get_num_threads()} threads"
    )
    print(f"{'path':<28} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs baseline':>12}")
    for name, tokens, seconds in rows:
        print(f"{name:<28} {tokens:>7} {seconds:>8.1f} {tokens / seconds:>9.1f} {tokens / seconds / base_rate:>11.2f}x")


if __name__ == "__main__":
    main()
