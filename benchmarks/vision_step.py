"""A projector-only training step of a grafted VLM, with and without the shared prompt opening.

While only the projector trains, the chat template's opening (system prompt and user turn start)
that every image question shares is run once and cached (surgeon/training/shared_prefix.py); the
baseline runs the whole sequence every step, as the loop did before. Both run in this process on
the same batches of synthetic questions (tower features computed once, as healing does), in
turn, at the heal's precision. Prints seconds per step of each, the ratio, and how far the two
losses differ.

    python benchmarks/vision_step.py [--model out/smollm2-eyes] [--steps 20] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from surgeon.modeling import SurgeonVLMForConditionalGeneration
from surgeon.runtime import limit_heap_fragmentation
from surgeon.training.heal_data import DataSource, SyntheticImages
from surgeon.training.vision_loop import AnswerLoss, Batches
from surgeon.vision.graft import processor_for
from surgeon.vision.image_set import encode_records, source_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="out/smollm2-eyes", help="a grafted VLM export (surgeon run recipes/smollm2-eyes.yaml)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (after 2 warm-up)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model there; run `surgeon run recipes/smollm2-eyes.yaml` first")
    limit_heap_fragmentation()
    torch.manual_seed(0)
    vlm = SurgeonVLMForConditionalGeneration.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    processor = processor_for(vlm, tokenizer)
    for name, param in vlm.named_parameters():
        param.requires_grad_(name.startswith("projector."))
    vlm.train()

    questions = SyntheticImages(examples=(args.steps + 2) * args.batch, kinds=["colour", "shape", "count"], seed=7)
    records = source_records(DataSource(synthetic=questions), [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = Batches(vlm, processor, {"train": encode_records(records, processor)}, pad, True, torch.device("cpu"))

    shared, whole = AnswerLoss(vlm), AnswerLoss(vlm, shared_opening=False)  # whole: the loop before
    times, gaps = {"shared opening": [], "whole sequence": []}, []
    for step in range(args.steps + 2):
        inputs = batches.batch("train", list(range(step * args.batch, (step + 1) * args.batch)))
        order = [("shared opening", shared), ("whole sequence", whole)]
        losses = {}
        for label, body in order if step % 2 else order[::-1]:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = body(**inputs)[0]
            loss.backward()
            vlm.zero_grad(set_to_none=True)  # no update: both see the same weights
            if step >= 2:
                times[label].append(time.perf_counter() - start)
            losses[label] = loss.item()
        gaps.append(abs(losses["shared opening"] - losses["whole sequence"]) / max(losses["whole sequence"], 1e-9))
    length = inputs["input_ids"].shape[1]
    ids, mask, targets = inputs["input_ids"], inputs["attention_mask"], inputs["targets"]
    opening, _ = shared.prefix.split(vlm.language_model, ids, mask, targets)
    threads = torch.get_num_threads()
    print(f"{args.model}: batch {args.batch} x {length} tokens, {opening} of them shared; bf16, {threads} threads")
    for label, values in times.items():
        print(f"  {label:15s} {statistics.median(values):.3f} s/step (median of {len(values)})")
    ratio = statistics.median(times["whole sequence"]) / statistics.median(times["shared opening"])
    print(f"  speed-up {ratio:.2f}x; largest relative loss difference {max(gaps):.1e} (bf16)")


if __name__ == "__main__":
    main()
