"""The embedded engine against transformers `generate`, on this machine, in one process.

    python benchmarks/engine_bench.py                       # all sections
    python benchmarks/engine_bench.py --only decode,batch   # some of them

Sections (each prints its own ratio against a named baseline run in the same process):
  decode   batch-1 greedy decode, 128 prompt + 128 new tokens: engine tokens/s / transformers tokens/s
  batch    16 concurrent requests (128 + 128): engine total tokens/s / sequential transformers tokens/s
  prefix   a shared 512-token system prompt: time to first token without / with a prefix-cache hit
  sparse   time per decoded token at 1K and 4K context, DSA (k = 64) against its dense parent
  exact    greedy tokens of the engine == transformers generate on 20 prompts (dense, GQA, DSA)

Models: SmolLM2-135M-Instruct (the `smollm2-135m-instruct` alias) and the exports of
recipes/smollm2-mqa.yaml and recipes/smollm2-dsa.yaml (run those recipes first, or pass other paths).
Timings interleave the two sides (A B A B ...) and report medians, so a drifting machine moves both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT.parent / "shared" / "data" / "text" / "austen" / "persuasion.txt"


def text_tokens(tokenizer, count: int, offset: int = 0) -> list[int]:
    """Real prose (held-out Austen) when the shared data is there, else a fixed pseudo-random run."""
    if TEXT.is_file():
        ids = tokenizer(TEXT.read_text(encoding="utf-8")[:400_000])["input_ids"]
        return ids[offset : offset + count]
    generator = torch.Generator().manual_seed(offset)
    return torch.randint(100, 40_000, (count,), generator=generator).tolist()


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    from surgeon import modeling  # noqa: F401  registers the sparse-attention class
    from surgeon.checkpoints.sources import resolve_source

    folder = resolve_source(path, Path.cwd()).folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # fixed lengths on both sides
    return model


def hf_generate(model, ids: list[int], new: int, lookup: int | None = None) -> list[int]:
    """Greedy, exactly `new` tokens; `lookup` switches on transformers' prompt lookup with that many tokens."""
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def params(new: int):
    from surgeon.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, loop_window=0)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def section_decode(args, state) -> None:
    from surgeon.engine import LLM

    llm, hf = state["dense"], state["hf"]
    ids = text_tokens(llm.tokenizer, 128)
    engines = {
        "engine fp32": llm,
        "engine bf16": LLM(args.dense, dtype="bfloat16"),
        "engine fp32 compiled": LLM(args.dense, compile=True),
        "engine int8": LLM(args.dense, quantize="int8"),
        "engine int8 compiled": LLM(args.dense, quantize="int8", compile=True),
        "engine int4": LLM(args.dense, quantize="int4"),
        "engine int4 compiled": LLM(args.dense, quantize="int4", compile=True),
    }
    runs = {"transformers": [], **{name: [] for name in engines}}
    hf_generate(hf, ids, 8)  # warm-up
    for engine in engines.values():  # warm-up (and torch.compile's one-time compile)
        engine.generate([ids], params(8))
    for _ in range(args.repeats):
        runs["transformers"].append(128 / timed(lambda: hf_generate(hf, ids, 128)))
        for name, engine in engines.items():
            runs[name].append(128 / timed(lambda engine=engine: engine.generate([ids], params(128))))
    base = statistics.median(runs["transformers"])
    state["hf_tokens_per_s"] = base
    print(f"decode, batch 1, 128 prompt + 128 new tokens (median of {args.repeats}, tokens/s incl. prefill):")
    for name, values in runs.items():
        rate = statistics.median(values)
        print(f"  {name:<21} {rate:7.1f} tokens/s   {rate / base:5.2f}x transformers generate (fp32)")


def section_batch(args, state) -> None:
    llm = state["dense"]
    prompts = [text_tokens(llm.tokenizer, 128, offset=1000 * i) for i in range(16)]
    llm.generate(prompts[:2], params(4))
    rates = [16 * 128 / timed(lambda: llm.generate(prompts, params(128))) for _ in range(args.repeats)]
    base = state.get("hf_tokens_per_s") or 128 / timed(lambda: hf_generate(state["hf"], prompts[0], 128))
    rate = statistics.median(rates)
    print(
        f"16 concurrent requests, 128 + 128 tokens: engine {rate:.1f} tokens/s in total; sequential "
        f"transformers generate {base:.1f} tokens/s -> {rate / base:.2f}x"
    )


def first_token_time(llm, prompt) -> float:
    start = time.perf_counter()
    rid = llm.add_request(prompt, params(1))
    while True:
        if any(out.request_id == rid for out in llm.step()):
            return time.perf_counter() - start


def section_prefix(args, state) -> None:
    llm = state["dense"]
    tok = llm.tokenizer
    cold, warm = [], []
    for i in range(args.repeats):
        system = tok.decode(text_tokens(tok, 600, offset=20_000 + 3000 * i))
        system_ids = tok(system)["input_ids"][:512]
        system = tok.decode(system_ids)
        ask = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: who is speaking?"}]
        other = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: where are they?"}]
        cold.append(first_token_time(llm, ask))  # a new system prompt: nothing cached
        warm.append(first_token_time(llm, other))  # the same system prompt: its blocks are cached
    a, b = statistics.median(cold), statistics.median(warm)
    print(
        f"time to first token, 512-token system prompt: miss {a * 1000:.0f} ms, hit {b * 1000:.0f} ms "
        f"-> {a / b:.1f}x faster with the prefix cache"
    )


def decode_step_time(llm, context: int, steps: int) -> float:
    ids = text_tokens(llm.tokenizer, context)
    rid = llm.add_request(ids, params(steps + 1))
    while not any(out.request_id == rid for out in llm.step()):
        pass  # prefill, chunk by chunk
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    return (time.perf_counter() - start) / steps


def section_sparse(args, state) -> None:
    from surgeon.engine import LLM

    dense = state["dense"]
    sparse = LLM(args.dsa, kv_cache_tokens=8192, max_batched_tokens=1024)
    rows = {}
    for name, llm in (("dense", dense), ("DSA k=64", sparse)):
        rows[name] = [decode_step_time(llm, context, args.steps) for context in (1024, 4096)]
    print("time per decoded token (batch 1):")
    for name, (short, long) in rows.items():
        print(f"  {name:<9} 1K {short * 1000:6.1f} ms   4K {long * 1000:6.1f} ms   growth {long / short:.2f}x")
    growth = {name: long / short for name, (short, long) in rows.items()}
    print(f"  DSA growth {growth['DSA k=64']:.2f}x against dense growth {growth['dense']:.2f}x")


def section_exact(args, state) -> None:
    from surgeon.engine import LLM

    for label, path in (("dense", args.dense), ("GQA (MQA)", args.gqa), ("DSA", args.dsa)):
        llm = LLM(path)
        hf = hf_model(path)
        # 20 prompts of 20-400 tokens: the long ones exercise DSA's top-64 selection.
        prompts = [text_tokens(llm.tokenizer, 20 + 20 * i, offset=50_000 + 700 * i) for i in range(20)]
        got = [out.token_ids for out in llm.generate(prompts, params(args.exact_tokens))]
        want = [hf_generate(hf, ids, args.exact_tokens) for ids in prompts]
        same = sum(g == w for g, w in zip(got, want))
        print(f"greedy tokens equal to transformers generate ({label}, {args.exact_tokens} new tokens): {same}/20")
        if label == "dense":
            compiled = LLM(path, compile=True)
            fused = [out.token_ids for out in compiled.generate(prompts, params(args.exact_tokens))]
            print(f"  fp32 compiled: {sum(f == w for f, w in zip(fused, want))}/20 identical")
            quantized = LLM(path, quantize="int8")
            close = [out.token_ids for out in quantized.generate(prompts, params(args.exact_tokens))]
            agree = [next((i for i, (a, b) in enumerate(zip(c, w)) if a != b), len(w)) for c, w in zip(close, want)]
            print(
                f"  int8 weights: {sum(c == w for c, w in zip(close, want))}/20 identical; "
                f"tokens before the first difference: mean {statistics.mean(agree):.1f} of {args.exact_tokens}"
            )


SECTIONS = {
    "decode": section_decode,
    "batch": section_batch,
    "prefix": section_prefix,
    "sparse": section_sparse,
    "exact": section_exact,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", default="smollm2-135m-instruct")
    parser.add_argument("--gqa", default=str(ROOT / "out" / "smollm2-mqa"))
    parser.add_argument("--dsa", default=str(ROOT / "out" / "smollm2-dsa"))
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per context length")
    parser.add_argument("--exact-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from surgeon.engine import LLM

    wanted = [name.strip() for name in args.only.split(",")]
    state = {}
    if set(wanted) & {"decode", "batch", "prefix", "sparse"}:
        state["dense"] = LLM(args.dense, max_num_seqs=16, kv_cache_tokens=16384)
        state["hf"] = hf_model(args.dense)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 unless stated")
    for name in wanted:
        SECTIONS[name](args, state)


if __name__ == "__main__":
    main()
