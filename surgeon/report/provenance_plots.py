"""The analysis plots a model card can show from what its run already measured: drop_layers records
every block's angular distance and every layer's block influence, reduce_kv_heads (with calibration
text) how alike each layer's KV heads are and what the svd merge loses, sparse_attention the indexer
recall per layer. Named after the step (`angular-distance-1.png`) so two such steps do not collide."""

from __future__ import annotations

from . import figures

CARD_PREFIXES = ("angular-distance", "block-influence", "indexer-recall", "kv-head-similarity")


def provenance_plots(report: dict) -> dict[str, bytes]:
    plots = {}
    for number, entry in enumerate(report["provenance"], start=1):
        details, drawn = entry.get("details") or {}, []
        if entry["op"] == "drop_layers" and "angular_distance_by_block_start" in details:
            dropped = entry["params"]["layers"]
            angular = {len(dropped): details["angular_distance_by_block_start"]}
            contiguous = dropped == list(range(dropped[0], dropped[0] + len(dropped)))
            drawn += [
                figures.angular_distance(angular, [len(dropped)], dropped if contiguous else None),
                figures.block_influence(details["block_influence_by_layer"], dropped),
            ]
        if entry["op"] == "sparse_attention" and details.get("recall"):
            series = {"after the indexer warm-up": details["recall"]}
            if details.get("recall_at_init"):
                series = {"at initialisation": details["recall_at_init"], **series}
            drawn.append(figures.indexer_recall(series))
        if entry["op"] == "reduce_kv_heads" and details.get("kv_head_similarity"):
            lost = {int(t): loss for t, loss in (details.get("kv_merge_energy_lost") or {}).items()}
            drawn.append(figures.kv_similarity(details["kv_head_similarity"], lost))
        for figure in drawn:
            plots[f"{figure.name.removesuffix('.png')}-{number}.png"] = figure.png
    return plots
