"""Distillation throughput: surgeon's heal loop against a plain transformers Trainer subclass.

Both distil SmolLM2-135M-Instruct (the teacher) into the same student (layers 13-18 dropped),
train the same parameters on the same windows and batches with the same KL(teacher || student)
loss at the same precision, in this process. Prints tokens/s of each and the ratio.

    python benchmarks/heal_throughput.py [--steps 12] [--batch 8] [--window 256] [--precision auto]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from surgeon.checkpoints.sources import resolve_source
from surgeon.runtime import limit_heap_fragmentation
from surgeon.surgery.architecture import keep_layers
from surgeon.training.driver import resolve_precision
from surgeon.training.heal_data import DataSource, HealData
from surgeon.training.loop import LoopSpec, train
from surgeon.training.text_set import build_train_set
from surgeon.training.trainable import TrainSpec, prepare_student

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "austen" / "emma.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps of each (after 2 warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--train", default="model.layers.1[3-9],model.layers.2?", help="comma-separated globs")
    args = parser.parse_args()
    limit_heap_fragmentation()
    torch.manual_seed(0)

    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    teacher = source.load_model()
    for p in teacher.parameters():
        p.requires_grad_(False)
    tokenizer = source.load_tokenizer()
    data = build_train_set(
        HealData(
            sources=[DataSource(text=str(TEXT))],
            window=args.window,
            heldout_windows=0,
            tokens=(args.steps + 2) * args.batch * args.window,
        ),
        {0: [TEXT]},
        tokenizer,
    )
    precision = resolve_precision(args.precision, torch.device("cpu"))
    globs = args.train.split(",")
    kept = [i for i in range(30) if not 13 <= i < 19]
    tokens_per_step = args.batch * args.window
    print(
        f"teacher SmolLM2-135M-Instruct, student without layers 13-18, training {globs}; "
        f"batch {args.batch} x {args.window} tokens, {precision}, {torch.get_num_threads()} threads"
    )

    baseline = trainer_tokens_per_second(teacher, keep_layers(teacher, kept), globs, data, args, precision)
    print(f"transformers Trainer subclass : {baseline:7.1f} tokens/s")

    student, trainable = prepare_student(keep_layers(teacher, kept), TrainSpec(params=globs))
    spec = LoopSpec(
        steps=args.steps + 2,
        batch_size=args.batch,
        precision=precision,
        checkpoint_every=10**6,
        log_every=1,
        optimizer={"warmup_steps": 0},
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = train(
            student,
            trainable,
            teacher,
            data,
            spec,
            teacher_fingerprint=source.fingerprint(),
            teacher_is_parent=True,
            layer_origin=kept,
            checkpoint_dir=Path(tmp),
            resume=False,
            run_digest="benchmark",
        )
    timed = result.curve[2:]  # the same two warm-up steps left out
    ours = tokens_per_step / (sum(c["step_seconds"] for c in timed) / len(timed))
    print(f"surgeon heal                  : {ours:7.1f} tokens/s  (first {result.shared_prefix} layers shared)")
    print(f"ratio surgeon / Trainer       : {ours / baseline:7.2f}x  ({tokens_per_step} tokens per step)")


def trainer_tokens_per_second(teacher, student, globs, data, args, precision) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from surgeon.surgery.selection import select

    names = [n for n, _ in student.named_parameters()]
    chosen = set(select(names, globs))
    for name, param in student.named_parameters():
        param.requires_grad_(name in chosen)
        if name in chosen:
            param.data = param.data.clone()

    class DistillTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids).logits[:, :-1].float()
            student_logits = model(input_ids=ids).logits[:, :-1].float()
            log_p = torch.log_softmax(teacher_logits, dim=-1)
            log_q = torch.log_softmax(student_logits, dim=-1)
            loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
            return (loss, None) if return_outputs else loss

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *_args, **_kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            self.times.append(time.perf_counter() - self.started)

    dataset = [{"input_ids": row} for row in data.train_ids]
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps + 2,
            learning_rate=2e-4,
            bf16=precision == "bf16",
            use_cpu=not torch.cuda.is_available(),
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            remove_unused_columns=False,
            max_grad_norm=1.0,
        )
        trainer = DistillTrainer(
            model=student,
            args=training_args,
            train_dataset=dataset,
            data_collator=lambda rows: {"input_ids": torch.stack([r["input_ids"] for r in rows])},
            callbacks=[timer],
        )
        trainer.train()
    timed = timer.times[2:]
    return args.batch * args.window / (sum(timed) / len(timed))


if __name__ == "__main__":
    main()
