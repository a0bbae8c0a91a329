"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint holds the trainable tensors, the optimizer and scheduler state, the RNG states, the
step and the training log, which is all a resumed run needs to continue bit for bit (the data
order is a function of the seed and the step). Checkpoints are written to a temporary folder and
renamed, so a kill during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoints.atomic import atomic_folder
from ..errors import SurgeonError

KEEP = 2  # the newest checkpoints kept; older ones are deleted after a successful save


def save_checkpoint(
    folder: Path, step: int, trainable: dict[str, torch.Tensor], optimizer, scheduler, extra: dict
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"step-{step:06d}"
    with atomic_folder(target) as tmp:
        tensors = {f"param.{name}": t.detach().contiguous() for name, t in trainable.items()}
        opt_state = optimizer.state_dict()
        scalars: dict = {}
        for index, state in opt_state["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    tensors[f"optim.{index}.{key}"] = value.contiguous()
                else:
                    scalars[f"{index}.{key}"] = value
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for device, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{device}"] = state
        save_file(tensors, str(tmp / "state.safetensors"))
        meta = {
            "step": step,
            "param_groups": opt_state["param_groups"],
            "optimizer_scalars": scalars,
            "scheduler": scheduler.state_dict(),
            "python_rng": _encode_random_state(random.getstate()),
            **extra,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=_json_default))
    for old in sorted(folder.glob("step-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(folder: Path) -> Path | None:
    done = sorted(p for p in folder.glob("step-*") if (p / "meta.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, trainable: dict[str, torch.Tensor], optimizer, scheduler) -> dict:
    """Restore tensors, optimizer, scheduler and RNG from `path`; return its metadata."""
    tensors = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "meta.json").read_text())
    missing = [name for name in trainable if f"param.{name}" not in tensors]
    if missing:
        raise SurgeonError(f"checkpoint {path} does not match this run (no tensor for {missing[0]})")
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(tensors[f"param.{name}"])
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for key, value in meta["optimizer_scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in tensors]
        )
    random.setstate(_decode_random_state(meta["python_rng"]))
    return meta


def _encode_random_state(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_random_state(state):
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _json_default(value):
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint")
