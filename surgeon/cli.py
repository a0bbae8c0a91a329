"""The `surgeon` command. Thin: parse arguments, call the library, print, map SurgeonError to exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .errors import SurgeonError
from .runtime import limit_heap_fragmentation


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    limit_heap_fragmentation()
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(message)s" if not args.debug else "%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.debug:
        # transformers and accelerate are chatty at INFO; our own log says what matters.
        for noisy in ("transformers", "accelerate", "huggingface_hub", "httpx"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return args.handler(args) or 0
    except SurgeonError as exc:
        if args.debug:
            raise
        for line in str(exc).splitlines() or ["(no message)"]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="surgeon", description="Model surgery from checkpoints you already have.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and results")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a recipe without loading weights")
    p.add_argument("recipe")
    p.set_defaults(handler=_validate)

    p = sub.add_parser("plan", help="show per step the layers, heads, parameters and bytes (meta device)")
    p.add_argument("recipe")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_plan)

    p = sub.add_parser("run", help="run a recipe and export the result")
    p.add_argument("recipe")
    p.add_argument("--out", help="export folder (default: export.path of the recipe, else out/NAME)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export (and discard checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last checkpoint")
    p.set_defaults(handler=_run)

    p = sub.add_parser("eval", help="compare a checkpoint with its parent on text")
    p.add_argument("child", help="alias, model folder or .gguf file")
    p.add_argument("--parent", required=True, help="alias, model folder or .gguf file")
    p.add_argument("--data", required=True, nargs="+", help="text files or globs")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to evaluate (default 8192)")
    p.add_argument("--window", type=int, default=512, help="tokens per window, BOS included (default 512)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_eval)

    p = sub.add_parser("ifeval", help="IFEval: instruction following, scored by Google's checks (greedy)")
    p.add_argument("model", help="alias, model folder or .gguf file")
    p.add_argument("--data", help="IFEval's input_data.jsonl (default: google/IFEval through `datasets`)")
    p.add_argument("--limit", type=int, help="the first N prompts only")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's (default fp32)")
    p.add_argument("--out", help="write every prompt's answer and checks to this jsonl file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_ifeval)

    p = sub.add_parser("export-gguf", help="write a model as a GGUF file for llama.cpp / Ollama")
    p.add_argument("source", help="export folder, Hugging Face folder or alias")
    p.add_argument("--type", default="q8_0", choices=["f16", "bf16", "q8_0", "q4_0", "q4_1"], help="(default q8_0)")
    p.add_argument("--out", help="the .gguf file (default: SOURCE-NAME.TYPE.gguf in the current folder)")
    p.add_argument(
        "--tensor-type",
        action="append",
        default=[],
        metavar="PATTERN=TYPE",
        help="another type for the tensors whose GGUF name the regular expression finds, as llama-quantize's "
        "flag (e.g. token_embd=f16); repeatable, the first match wins",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(handler=_export_gguf)

    p = sub.add_parser("import-mergekit", help="translate a mergekit config into the equivalent surgeon recipe")
    p.add_argument("config", help="a mergekit YAML config")
    p.add_argument("-o", "--out", help="write the recipe to this file (default: print it)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(handler=_import_mergekit)

    p = sub.add_parser("push", help="upload an export to the Hugging Face Hub")
    p.add_argument("folder")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--private", action="store_true")
    p.set_defaults(handler=_push)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="export folder, Hugging Face folder or alias")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="requests that may wait beyond those running; more get 503 (default 256)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on a GPU, float32 on a CPU"
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4", "none"],
        help="int8 / int4 weights on a CPU: faster decoding, outputs close to (not identical with) full precision; "
        "a quantize step's export runs on its own integers by default (none: in float)",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step: faster decoding after a one-time compile"
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="with --compile on a CPU: each request's tokens bit for bit independent of its batch, and "
        "greedy speculation exactly the plain tokens (a verification costs more attention time)",
    )
    p.add_argument(
        "--speculative",
        metavar="ngram|PATH",
        help="speculative decoding (outputs unchanged): 'ngram' (prompt lookup) or a draft model's path or alias",
    )
    p.add_argument("--speculative-k", type=int, default=4, help="most draft tokens per step (default 4)")
    p.set_defaults(handler=_serve)

    p = sub.add_parser(
        "chat", help="chat with a model in the browser (Gradio), beside its model card and the recipe studio"
    )
    p.add_argument(
        "model",
        nargs="?",
        help="export folder, Hugging Face folder or alias (default: the vision recipe's export, else the base model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="default 7860")
    p.add_argument(
        "--speculative",
        metavar="ngram|PATH",
        default="ngram",
        help="the draft the sampling panel's speculative switch uses: 'ngram' (default) or a draft model's path",
    )
    p.add_argument("--speculative-k", type=int, default=4, help="most draft tokens per step (default 4)")
    p.set_defaults(handler=_chat)

    p = sub.add_parser(
        "analyze",
        help="per-layer plots (angular distance, block influence, KV heads, "
        "indexer recall), an HTML report and a suggested recipe",
    )
    p.add_argument("model", help="alias, model folder or .gguf file")
    p.add_argument("--data", required=True, nargs="+", help="text files or globs to measure on")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to measure on (default 8192)")
    p.add_argument(
        "--heldout",
        nargs="+",
        help="text files or globs the suggested recipe's evaluate steps read (must not overlap --data)",
    )
    p.add_argument("--out", help="report folder (default out/analysis-MODEL)")
    p.set_defaults(handler=_analyze)

    p = sub.add_parser("models", help="list model aliases and whether each is installed")
    p.set_defaults(handler=_models)
    return parser


def _validate(args) -> None:
    from .recipe.plan import plan_recipe
    from .recipe.schema import load_recipe

    recipe = load_recipe(args.recipe)
    plan_recipe(recipe)
    print(f"{args.recipe}: ok ({len(recipe.steps)} steps)")


def _plan(args) -> None:
    from .recipe.plan import format_plan, plan_recipe
    from .recipe.schema import load_recipe

    plan = plan_recipe(load_recipe(args.recipe))
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))


def _run(args) -> None:
    from .recipe.run import run_recipe
    from .recipe.schema import load_recipe
    from .report.summary import stage_line

    started = time.perf_counter()
    result = run_recipe(load_recipe(args.recipe), out=args.out, overwrite=args.overwrite, resume=args.resume)
    for step in result.report["provenance"]:
        print(f"{step['op']}: {step['what']}\n    {step['why']}")
    for stage in result.report["stages"]:
        print(stage_line(stage))
    print(f"exported {result.target} in {time.perf_counter() - started:.0f} s")


def _eval(args) -> None:
    from .measure.compare import evaluate_checkpoints
    from .report.summary import metrics_line

    metrics = evaluate_checkpoints(args.child, args.parent, args.data, tokens=args.tokens, window=args.window)
    print(json.dumps(metrics, indent=2) if args.json else metrics_line(args.child, metrics))


def _ifeval(args) -> None:
    from pathlib import Path

    from .checkpoints.atomic import atomic_file
    from .measure.ifeval import ifeval_checkpoint, ifeval_line

    data = Path(args.data).expanduser() if args.data else None
    result = ifeval_checkpoint(args.model, data, args.limit, args.max_tokens, args.dtype)
    if args.out:
        with atomic_file(Path(args.out)) as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in result["per_prompt"]))
    summary = {"metrics": result["metrics"], "settings": result["settings"], "sentence_splitter": result["punkt"]}
    summary["generation"] = result["generation"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(ifeval_line(args.model, result["metrics"]))
    gen = result["generation"]
    print(
        f"    max_tokens {args.max_tokens}, {args.dtype}, greedy; {gen['tokens']} tokens generated in "
        f"{gen['seconds']:.0f} s{' (cached)' if gen['cached'] else ''}; sentences: {result['punkt']}"
    )


def _analyze(args) -> None:
    from pathlib import Path

    from .analysis import analyze

    out = args.out or f"out/analysis-{Path(args.model).name}"
    report = analyze(args.model, args.data, out, tokens=args.tokens, heldout_files=args.heldout)
    print(f"suggestion: {report.suggestion.summary()}")
    for reason in report.suggestion.reasons:
        print(f"    {reason}")
    recipe = report.recipe or "none (see the reasons above)"
    print(f"report: {report.html}\nrecipe: {recipe}\nin {report.seconds:.0f} s")


def _export_gguf(args) -> None:
    from pathlib import Path

    from .checkpoints.gguf_export import check_exportable, export_gguf, parse_tensor_types
    from .checkpoints.sources import resolve_source

    overrides = parse_tensor_types(args.tensor_type)
    source = resolve_source(args.source, Path.cwd())
    check_exportable(source.config, f"'{args.source}'")  # before loading any weights
    name = Path(args.source).name if Path(args.source).is_dir() else args.source
    target = Path(args.out) if args.out else Path(f"{name}.{args.type}.gguf")
    model, tokenizer = source.load_model(), source.load_tokenizer()
    path = export_gguf(model, tokenizer, target, args.type, name, args.overwrite, overrides)
    print(f"{path} ({args.type}, {path.stat().st_size / 1e6:.1f} MB): llama-cli -m {path} -cnv")


def _import_mergekit(args) -> None:
    from pathlib import Path

    from .checkpoints.atomic import atomic_file
    from .errors import ExportError
    from .recipe.mergekit_import import import_mergekit
    from .recipe.schema import load_recipe

    text = import_mergekit(args.config, args.out)
    target = Path(args.out) if args.out else Path(args.config).with_suffix(".surgeon.yaml")
    load_recipe(target, text)  # the translation is a valid recipe, or this is surgeon's bug
    if not args.out:
        print(text, end="")
        return
    if target.exists() and not args.overwrite:
        raise ExportError(f"{target} exists: pass --overwrite to replace it")
    with atomic_file(target) as tmp:
        tmp.write_text(text)
    print(f"wrote {target}: surgeon plan {target} shows what it will do")


def _push(args) -> None:
    from .checkpoints.export import push_folder

    print(push_folder(args.folder, args.repo_id, args.private))


def _serve(args) -> None:
    from .engine.server import ServerLimits, serve

    if args.batch_invariant and not args.compile:
        raise SurgeonError("--batch-invariant needs --compile (eager steps round a row by the batch's size)")
    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_num_seqs=args.max_num_seqs,
        max_pending=args.max_pending,
        limits=ServerLimits(request_timeout=args.timeout),
        log_level="debug" if args.debug else "warning" if args.quiet else "info",
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        compile=args.compile,
        batch_invariant=args.batch_invariant,
        speculative=_speculative(args.speculative, args.speculative_k),
    )


def _speculative(value: str | None, k: int):
    from .engine.speculative import SpeculativeConfig

    if value is None:
        return None
    try:
        return SpeculativeConfig.parse(
            {"method": "ngram", "k": k} if value == "ngram" else {"method": "model", "draft": value, "k": k}
        )
    except ValueError as exc:
        raise SurgeonError(f"--speculative: {exc}") from None


def _chat(args) -> None:
    from .demos.chat import launch

    speculative = _speculative(args.speculative, args.speculative_k)
    launch(args.model, host=args.host, port=args.port, engine_options={"speculative": speculative})


def _models(args) -> None:
    from .checkpoints.aliases import ALIASES, DEFAULT_MODEL

    for alias in ALIASES.values():
        state = f"installed ({alias.version()})" if alias.installed() else f"not installed: {alias.install}"
        default = " [default]" if alias.name == DEFAULT_MODEL else ""
        print(f"{alias.name}{default}\n    {alias.description}\n    {state}")


if __name__ == "__main__":
    sys.exit(main())
