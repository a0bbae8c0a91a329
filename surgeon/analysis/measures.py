"""Per-layer measures on calibration text: what `surgeon analyze` plots and what its suggestion reads.

- angular distance of every contiguous block, for every block size (layer_scores.py, Gromov et al.);
- block influence per layer (layer_scores.py, ShortGPT);
- KV-head similarity per layer: the mean pairwise cosine between the K (and V) head outputs over the
  calibration tokens, i.e. <W_i x, W_j x> summed over tokens, normalised. It says how well a group
  merges by averaging: with equal norms, the mean merge loses (1 - cos) / 2 of each head's energy;
- merge loss per layer and candidate head count: the share of the K and V outputs' energy the svd
  merge of reduce_kv_heads loses (kv_heads.py, same inits), which is what a reduction starts from;
- indexer recall per sparse layer (training/indexer.py): the share of dense attention mass the
  selection keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.sparse_attention import sparse_modules
from ..surgery.kv_merge import key_input_covariance, kv_head_similarity, svd_merge_loss
from ..surgery.layer_scores import angular_distances, boundary_statistics
from ..training.indexer import measure_recall


@dataclass
class LayerMeasures:
    layers: int
    kv_heads: int
    angular: dict[int, list[float]]  # block size n -> distance of block [l, l+n) for l = 0..L-n
    influence: list[float]  # per layer
    kv_similarity: dict[str, list[float]] | None  # {"k", "v"} -> per layer; None with a single KV head
    merge_loss: dict[int, dict[str, list[float]]]  # kept heads -> {"k", "v"} -> per layer
    recall: dict[int, float] | None  # sparse layer -> recall; None for a dense model

    def as_dict(self) -> dict:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "angular_distance": {str(n): d for n, d in self.angular.items()},
            "block_influence": self.influence,
            "kv_head_similarity": self.kv_similarity,
            "kv_merge_energy_lost": {str(t): m for t, m in self.merge_loss.items()},
            "indexer_recall": None if self.recall is None else {str(k): v for k, v in self.recall.items()},
        }


def measure(model, windows: torch.Tensor) -> LayerMeasures:
    config = model.config
    n = config.num_hidden_layers
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    with key_input_covariance(model, enabled=kv > 1) as sigmas:  # filled during the one pass below
        stats = boundary_statistics(model, windows)
    angular = {size: angular_distances(stats["last"], size) for size in range(1, n)}
    similarity, merge_loss = None, {}
    if kv > 1:
        similarity = kv_head_similarity(model, sigmas)
        merge_loss = {t: svd_merge_loss(model, sigmas, t) for t in range(1, kv) if kv % t == 0}
        del sigmas
    recall = None
    if sparse_modules(model):
        recall = _recall(model, windows)
    return LayerMeasures(n, kv, angular, stats["influence"].tolist(), similarity, merge_loss, recall)


def _recall(model, windows: torch.Tensor) -> dict[int, float]:
    return {int(k): float(v) for k, v in measure_recall(model, windows).items()}
