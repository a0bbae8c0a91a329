"""Atomic export (safetensors, config, tokenizer, recipe, report, model card) and upload to the Hub.

An export is written into a hidden temporary folder beside the target and renamed into place only
when complete, so a crash or Ctrl-C never leaves a half-written model where a model is expected.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from ..errors import ExportError
from ..report.card import render_card
from ..report.plots import report_plots
from ..surgery.quantize import linear_inputs
from ..vision.export import hf_processor, llava_compatible, to_llava
from ..vision.graft import is_vlm
from .atomic import atomic_folder
from .compressed import compressed_state, quantization_config
from .gguf_export import export_gguf
from .sources import DTYPES

log = logging.getLogger(__name__)

EXPORT_FILES = ("config.json", "README.md", "report.json", "recipe.yaml")


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse, before any work, a target that exists (unless overwriting) or cannot be created."""
    if target.exists() and not overwrite:
        raise ExportError(f"{target} already exists (pass --overwrite, or set export.overwrite: true)")
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} exists and is not a folder")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ExportError(f"cannot write under {parent}")


def export_model(
    model,
    tokenizer,
    target: Path,
    *,
    report: dict,
    recipe_text: str,
    dtype: str | None = None,
    overwrite: bool = False,
    quantization=None,
    gguf: list[str] = (),
    name: str = "",
) -> Path:
    """Write everything into a temporary sibling, then rename it to `target` (atomic on POSIX).
    `quantization` (a quantize step's recipe.patient.Quantization): those Linears are written as
    compressed-tensors."""
    check_target(target, overwrite)
    with atomic_folder(target) as tmp:
        processor = None
        if is_vlm(model):
            processor = hf_processor(model.config, tokenizer)
            if llava_compatible(model.config):
                model = to_llava(model)
        state = _converted_state(model, DTYPES[dtype]) if dtype else None
        if quantization is not None:
            state = compressed_state(state if state is not None else model.state_dict(), quantization)
        model.save_pretrained(tmp, state_dict=state)
        config_updates = {"dtype": dtype} if dtype else {}  # save_pretrained records the in-memory dtype
        if quantization is not None:
            config_updates["quantization_config"] = quantization_config(quantization, list(linear_inputs(model)))
        if config_updates:
            config_file = tmp / "config.json"
            config = {**json.loads(config_file.read_text()), **config_updates}
            config_file.write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        for kind in gguf:  # exported from the model in memory: what the card measured
            export_gguf(model, tokenizer, tmp / f"{name or target.name}.{kind}.gguf", kind, name or target.name)
        (tmp / "recipe.yaml").write_text(recipe_text, encoding="utf-8")
        report = {**report, "export_class": type(model).__name__}
        (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        plots = report_plots(report)
        for name, png in plots.items():
            (tmp / name).write_bytes(png)
        (tmp / "README.md").write_text(render_card(report, recipe_text, sorted(plots)), encoding="utf-8")
    log.info("exported to %s", target)
    return target


def _converted_state(model, dtype: torch.dtype) -> dict:
    """The state dict in `dtype`, keeping tied tensors tied (converted once, shared again)."""
    converted: dict[int, torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key not in converted:
            converted[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        state[name] = converted[key]
    return state


def push_folder(folder: Path, repo_id: str, private: bool = False) -> str:
    """Upload an export to the Hub. Fails, changing nothing, without a token or a reachable Hub."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(folder)
    missing = [name for name in EXPORT_FILES if not (folder / name).is_file()]
    if missing:
        raise ExportError(f"{folder} is not a surgeon export (missing {', '.join(missing)})")
    token = get_token()
    if not token:
        raise ExportError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (nothing was uploaded)")
    api = HfApi(token=token)
    try:
        user = api.whoami()
    except HfHubHTTPError as exc:
        raise ExportError(f"the Hub refused the token ({exc}); nothing was uploaded") from None
    except Exception as exc:  # network errors come in many types (requests, httpx, OSError)
        raise ExportError(
            f"cannot reach the Hugging Face Hub ({type(exc).__name__}: {exc}); nothing was uploaded"
        ) from None
    log.info("uploading %s to %s as %s", folder, repo_id, user.get("name", "?"))
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload model made with model-surgeon",
        )
    except Exception as exc:
        raise ExportError(f"upload to {repo_id} failed: {type(exc).__name__}: {exc}") from None
    return str(url)
