"""An on-disk cache of the teacher's top-k logits per training window, reused across epochs and runs.

Per position: the k largest logits, their token ids, and the log-sum-exp over the whole
vocabulary, which is what the bucketed KL needs (see distill_loss). Keyed by the teacher's
fingerprint, the exact training windows and k, one small safetensors file per window.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoints.atomic import atomic_file
from ..checkpoints.cache import cache_dir
from ..surgery.architecture import output_logits
from .distill_loss import TopKTeacher


class TeacherCache:
    def __init__(self, teacher, fingerprint: str, windows_digest: str, top_k: int):
        key = hashlib.sha256(f"{fingerprint}|{windows_digest}|{top_k}".encode()).hexdigest()[:24]
        self.folder = cache_dir("teacher_topk") / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.teacher, self.top_k = teacher, top_k

    def _file(self, window: int) -> Path:
        return self.folder / f"w{window:06d}.safetensors"

    def targets(self, window_indices: list[int], ids: torch.Tensor, mask: torch.Tensor) -> TopKTeacher:
        """Top-k teacher targets for the masked positions of these windows (computed once, then read)."""
        parts = []
        for row, window in enumerate(window_indices):
            path = self._file(window)
            if not path.is_file():
                self._compute(window, ids[row : row + 1], path)
            parts.append(load_file(str(path)))
        selected = mask.bool()
        return TopKTeacher(
            indices=torch.stack([p["indices"] for p in parts])[selected].long().to(ids.device),
            logits=torch.stack([p["logits"] for p in parts])[selected].to(ids.device),
            logsumexp=torch.stack([p["logsumexp"] for p in parts])[selected].to(ids.device),
        )

    @torch.inference_mode()
    def _compute(self, window: int, ids: torch.Tensor, path: Path) -> None:
        hidden = self.teacher.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
        logits = output_logits(self.teacher, hidden)
        values, indices = logits.topk(self.top_k, dim=-1)
        with atomic_file(path) as tmp:
            save_file(
                {
                    "indices": indices.int().cpu(),
                    "logits": values.float().cpu(),
                    "logsumexp": logits.logsumexp(-1).float().cpu(),
                },
                str(tmp),
            )
