"""surgeon's GGUF files in the real llama.cpp (built from its PyPI sdist by benchmarks/llamacpp.py;
.ci/run builds it on a fresh machine): it loads them, answers from them, and measures q8_0 against
f16 within the format's error by its own --kl-divergence."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from conftest import requires_shared_data, requires_smollm2

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("llamacpp_bench", ROOT / "benchmarks" / "llamacpp.py")
llamacpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llamacpp)


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    if not all(llamacpp.binary(tool).is_file() for tool in llamacpp.TOOLS):
        if os.environ.get("CI") == "true":
            raise RuntimeError(
                "CI=true but llama.cpp is not built: .ci/run should have run benchmarks/llamacpp.py build"
            )
        pytest.skip(f"llama.cpp is not built in {llamacpp.CACHE} (python benchmarks/llamacpp.py build)")
    return llamacpp.CACHE / "bin"


def test_the_build_asks_only_for_the_vector_extensions_the_cpu_has():
    """An AVX-512 build on a host with AVX2 only died with SIGILL in every tool: the switches follow
    /proc/cpuinfo, and AVX-512 needs all five subsets ggml compiles for."""
    avx2 = {"avx", "avx2", "fma", "f16c"}
    assert llamacpp.simd_switches(avx2) == ["GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"]
    assert "GGML_AVX512" not in llamacpp.simd_switches(avx2 | {"avx512f"})
    full = avx2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
    assert llamacpp.simd_switches(full)[-1] == "GGML_AVX512"
    assert "-DGGML_AVX512=ON" in llamacpp.FLAGS or "-DGGML_AVX512=OFF" in llamacpp.FLAGS


@pytest.fixture(scope="module")
def smollm2_ggufs(tmp_path_factory) -> dict[str, Path]:
    from surgeon.checkpoints.gguf_export import export_gguf
    from surgeon.checkpoints.sources import resolve_source

    source = resolve_source("smollm2-135m-instruct", Path.cwd())
    model, tokenizer = source.load_model(), source.load_tokenizer()
    folder = tmp_path_factory.mktemp("gguf")
    return {kind: export_gguf(model, tokenizer, folder / f"smollm2.{kind}.gguf", kind) for kind in ("f16", "q8_0")}


def _complete(llama_bin: Path, gguf: Path, prompt: str, tokens: int = 24) -> str:
    out = subprocess.run(
        [str(llama_bin / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "--temp", "0",
         "-t", "2", "-no-cnv", "--no-warmup", "--simple-io"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out.stdout


@pytest.mark.real_model
@requires_smollm2
def test_llamacpp_answers_from_surgeons_gguf(llama_bin, smollm2_ggufs):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert "Paris" in _complete(llama_bin, smollm2_ggufs["q8_0"], prompt)


@pytest.mark.real_model
@requires_smollm2
@requires_shared_data
def test_llamacpp_measures_q8_0_close_to_f16(llama_bin, smollm2_ggufs, tmp_path):
    """llama.cpp's q8_0 path also rounds activations to 8 bits (its dot products are q8 x q8), so
    its KL has a floor of its own: ~0.004 here on SmolLM2, which the 0.01 bound leaves room for."""
    text = tmp_path / "persuasion.txt"
    text.write_text((llamacpp.PERSUASION).read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    base = tmp_path / "f16.kld"
    llamacpp.save_base_logits(smollm2_ggufs["f16"], base, text, 2, 512, 4)
    kl = llamacpp.kl_divergence(smollm2_ggufs["q8_0"], base, text, 2, 512, 4)
    assert kl["kl_mean"] is not None and 0 < kl["kl_mean"] <= 0.01, kl
    assert kl["top1_agreement"] > 0.9  # 0.94-0.96 here
