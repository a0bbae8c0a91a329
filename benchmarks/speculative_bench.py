"""Speculative decoding against transformers `generate` (plain and with its prompt lookup) and
against the engine without speculation, in one process, fp32, batch 1 (and 16 at once).

    python benchmarks/speculative_bench.py                         # both workloads, all drafts
    python benchmarks/speculative_bench.py --draft out/smollm2-draft --prompts 8
    python benchmarks/speculative_bench.py --workloads chat --engines draft compiled+draft

`--engines` picks the engine rows (the plain engine always runs: it is the reference eager
speculative rows' tokens are checked against; compiled ones are checked against the compiled
engine when `compiled` is among the rows); each compiled engine costs minutes of compile.

Workloads (128 new tokens each, greedy, the chat template):
  grounded  summarise / rewrite / quote from a ~400-token passage of held-out Austen (Persuasion)
  chat      open prompts from recipes/prompts/chat-eval.txt
Rows: transformers generate; transformers prompt lookup (`prompt_lookup_num_tokens=4`); the engine
plain, compiled, and compiled batch-invariant (`invariant`: bit-exact speculation); with the n-gram
draft; with the draft model (`--draft`, made by recipes/smollm2-draft.yaml). Every speculative
row's tokens are checked against its engine's plain output (greedy: they must be identical) and the
share of identical outputs is printed. Timings interleave the rows prompt by prompt, so a drifting
machine moves all of them alike. Each speculative engine also prints its break-even: the per-token
acceptance from which its planner speculates at batch 1, priced with the step and draft-round costs
it measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from engine_bench import hf_generate, hf_model  # this folder is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
PERSUASION = ROOT.parent / "shared" / "data" / "text" / "austen" / "persuasion.txt"
CHAT_PROMPTS = ROOT / "recipes" / "prompts" / "chat-eval.txt"
ASKS = (
    "Summarise this passage in a few sentences.",
    "Rewrite this passage in plain modern English, keeping every event.",
    "Quote the two sentences of this passage that say the most about the characters, then explain why.",
    "List the people in this passage and what each says or does, quoting them.",
)


WORKLOADS = {
    "grounded": "grounded: summarise / rewrite / quote a ~400-token Persuasion passage",
    "chat": "chat: open prompts (chat-eval.txt)",
}
ENGINES = {  # --engines key: row name
    "compiled": "engine compiled",
    "ngram": "engine + ngram",
    "compiled+ngram": "engine compiled + ngram",
    "invariant": "engine compiled batch-invariant",
    "invariant+ngram": "engine compiled batch-invariant + ngram",
    "draft": "engine + draft",
    "compiled+draft": "engine compiled + draft",
}


def grounded_prompts(tokenizer, count: int) -> list[list[dict]]:
    """Passages of ~400 tokens from Persuasion (held out from every heal), each with an ask."""
    text = PERSUASION.read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 30]
    prompts, current = [], []
    for paragraph in paragraphs[40:]:
        current.append(paragraph)
        if len(tokenizer("\n\n".join(current))["input_ids"]) >= 400:
            ask = ASKS[len(prompts) % len(ASKS)]
            prompts.append([{"role": "user", "content": f"{ask}\n\n" + "\n\n".join(current)}])
            current = []
        if len(prompts) == count:
            break
    return prompts


def chat_prompts(count: int) -> list[list[dict]]:
    lines = [line.strip() for line in CHAT_PROMPTS.read_text().splitlines() if line.strip() and line[0] != "#"]
    return [[{"role": "user", "content": line}] for line in lines[:count]]


def greedy(new: int, speculate: bool = True):
    from surgeon.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, loop_window=0, speculate=speculate)


def run_rows(rows: dict, prompts: list[list[int]], new: int) -> dict:
    """Each row on each prompt in turn; per row: seconds, tokens, and outputs."""
    results = {name: {"seconds": [], "outputs": [], "stats": []} for name in rows}
    for ids in prompts:
        for name, fn in rows.items():
            start = time.perf_counter()
            tokens, stats = fn(ids, new)
            results[name]["seconds"].append(time.perf_counter() - start)
            results[name]["outputs"].append(tokens)
            results[name]["stats"].append(stats)
    return results


def engine_row(llm, speculate: bool = True):
    def run(ids, new):
        done = llm.generate([ids], greedy(new, speculate))[0]
        return done.token_ids, done.speculation

    return run


def report(title: str, results: dict, new: int, reference: str, baseline: str) -> None:
    print(f"\n{title} (batch 1, {new} new tokens, {len(results[baseline]['seconds'])} prompts; tokens/s incl. prefill)")
    base_rate = results_rate(results, baseline, new)
    for name, got in results.items():
        rate = results_rate(results, name, new)
        # Speculation is exact against the engine that verifies: a compiled row against the compiled
        # engine when that row ran (compiled and eager steps round differently, as any two kernels do).
        plain = name.split(" + ")[0]
        want = results[plain if plain != name and plain in results else reference]["outputs"]
        same = sum(a == b for a, b in zip(got["outputs"], want))
        stats = [s for s in got["stats"] if s]
        extra = ""
        if stats:
            proposed = sum(s["proposed"] for s in stats)
            accepted = sum(s["accepted"] for s in stats)
            rejected = sum(s["rejected"] for s in stats)
            steps = sum(s["target_steps"] for s in stats)
            # Per token: the chance that each next draft token is accepted, the figure the planner
            # estimates and its break-even is stated in (tokens after a rejection are never tested).
            per_token = accepted / max(accepted + rejected, 1)
            extra = (
                f"   acceptance {accepted / max(proposed, 1):.2f} ({per_token:.2f} per token), "
                f"{new * len(stats) / max(steps, 1):.2f} tokens per target step"
            )
        print(f"  {name:<34} {rate:7.1f} tokens/s  {rate / base_rate:5.2f}x  identical {same}/{len(want)}{extra}")


def break_even_line(planner) -> str:
    """What the draft must reach to pay at batch 1, from the costs the planner measured in this run."""
    fitted, level = planner.costs.fit(), planner.break_even()
    if fitted is None:
        return "no step measured"
    a, b, c = fitted
    draft = planner.costs.draft_round
    costs = f"plain step {1e3 * (a + b):.1f} ms, verification +{1e3 * c:.1f} ms, +{1e3 * b:.1f} ms a token" + (
        f", draft round {1e3 * draft:.1f} ms" if draft is not None else ""
    )
    if not planner.costs.prices_c:
        # c is measured only with both kinds of step in one window; until then it reads 0 and the
        # break-even below is a lower bound.
        costs += "; plain steps and verifications never shared the cost window, so c is unpriced"
    elif not any(verify for _, verify, _ in planner.costs.samples):
        costs += f" (c as last measured: no verification among the last {len(planner.costs.samples)} steps)"
    if level is None:
        return f"no acceptance pays ({costs})"
    return f"the plan speculates from per-token acceptance {level:.2f} ({costs})"


def results_rate(results: dict, name: str, new: int) -> float:
    got = results[name]
    return new * len(got["seconds"]) / sum(got["seconds"])


def concurrent(llm, prompts: list[list[int]], new: int, repeats: int) -> tuple[float, float]:
    """Total tokens/s of 16 requests at once, without and with speculation (interleaved)."""
    plain, fast = [], []
    llm.generate(prompts[:2], greedy(8))
    for _ in range(repeats):
        for speculate, into in ((False, plain), (True, fast)):
            start = time.perf_counter()
            llm.generate(prompts, greedy(new, speculate))
            into.append(len(prompts) * new / (time.perf_counter() - start))
    return statistics.median(plain), statistics.median(fast)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=str(ROOT / "out" / "smollm2-draft"))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="engine rows besides the plain one"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from surgeon.chat import chat_ids
    from surgeon.engine import LLM

    hf = hf_model(args.model)
    common = {"max_num_seqs": args.concurrent, "kv_cache_tokens": 32768}
    draft = Path(args.draft)
    wanted = set(args.engines)
    if wanted & {"draft", "compiled+draft"} and not (draft / "config.json").is_file():
        print(f"no draft at {draft}: run recipes/smollm2-draft.yaml (or pass --draft) for the draft rows")
        wanted -= {"draft", "compiled+draft"}
    speculative = {
        "ngram": {"method": "ngram", "k": args.k},
        "draft": {"method": "model", "draft": str(draft), "k": args.k},
    }
    engines = {"engine": LLM(args.model, **common)}
    for key in ENGINES:  # in the table's order
        if key in wanted:
            mode, _, method = key.partition("+")  # method "" for an engine alone
            engines[ENGINES[key]] = LLM(
                args.model,
                compile=mode in ("compiled", "invariant"),
                batch_invariant=mode == "invariant",
                speculative=speculative.get(method or mode),
                **common,
            )
    tokenizer = engines["engine"].tokenizer
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, k up to {args.k}, adaptive")

    workloads = {
        WORKLOADS[name]: grounded_prompts(tokenizer, args.prompts) if name == "grounded" else chat_prompts(args.prompts)
        for name in args.workloads
    }
    warm = [chat_ids(tokenizer, workloads[next(iter(workloads))][0], generation_prompt=True)]
    for engine in engines.values():  # warm-up, torch.compile's one-time compile included
        engine.warm_up()
        engine.generate(warm * 2, greedy(24))
        # `warm_up` compiles the step shapes (an answer alone did not reach them all: a draft's
        # two-token catch-up once compiled for 13.7 s in a timed row); a whole answer then
        # seeds the planner's step costs and the draft's acceptance as a served request would.
        engine.generate(warm, greedy(args.new))
    hf_generate(hf, warm[0], 8)
    for title, chats in workloads.items():
        prompts = [chat_ids(tokenizer, chat, generation_prompt=True) for chat in chats]
        rows = {
            "transformers generate": lambda ids, new: (hf_generate(hf, ids, new), None),
            f"transformers prompt lookup (k={args.k})": lambda ids, new: (hf_generate(hf, ids, new, args.k), None),
            **{name: engine_row(engine) for name, engine in engines.items()},
        }
        results = run_rows(rows, prompts, args.new)
        report(title, results, args.new, reference="engine", baseline="transformers generate")
        for name, engine in engines.items():
            if engine.speculator is not None:
                print(f"  {name}: {break_even_line(engine.speculator.planner)}")
        for name in ("engine + ngram", "engine + draft"):
            if name in engines:
                plain, fast = concurrent(engines[name], (prompts * 16)[: args.concurrent], args.new, args.repeats)
                print(
                    f"  {args.concurrent} at once, {name.removeprefix('engine + ')}: {plain:.1f} tokens/s without, "
                    f"{fast:.1f} with speculation ({fast / plain - 1:+.1%})"
                )


if __name__ == "__main__":
    main()
