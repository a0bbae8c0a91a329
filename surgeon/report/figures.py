"""The analysis plots, one PNG per measure. Each returns a Figure that counts the curves it drew, so
callers (and tests) know what a PNG shows without decoding it. Used by `surgeon analyze` and by
model cards of runs that computed the same measures."""

from __future__ import annotations

from dataclasses import dataclass

from .canvas import plt, png_bytes

_COLOURS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#8C8C8C")


@dataclass
class Figure:
    name: str  # file name, e.g. "angular-distance.png"
    title: str
    png: bytes
    curves: int


def angular_distance(angular: dict[int, list[float]], sizes: list[int], chosen: list[int] | None = None) -> Figure:
    """One curve per block size n: the angular distance of block [l, l+n) against its first layer l."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for colour, n in zip(_COLOURS, sizes):
        ax.plot(range(len(angular[n])), angular[n], "o-", markersize=3, linewidth=1.2, color=colour, label=f"n = {n}")
    if chosen:  # the block a suggestion or a drop_layers step picked, shaded (not a curve)
        ax.axvspan(chosen[0] - 0.4, chosen[0] + 0.4, color="#C44E52", alpha=0.15, label="chosen block start")
    ax.set_xlabel("first layer l of the block [l, l+n)")
    ax.set_ylabel("angular distance / pi")
    ax.set_title("Angular distance between a block's input and output (last token)")
    return _finish(fig, ax, "angular-distance.png")


def block_influence(influence: list[float], dropped: list[int] | None = None) -> Figure:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.plot(
        range(len(influence)),
        influence,
        "o-",
        markersize=3,
        linewidth=1.2,
        color=_COLOURS[0],
        label="1 - cos(input, output)",
    )
    if dropped:
        ax.scatter(
            dropped,
            [influence[i] for i in dropped],
            s=40,
            facecolors="none",
            edgecolors="#C44E52",
            label="dropped",
            zorder=3,
        )
    ax.set_yscale("log")  # the first layer's influence is often 10-100x the others'
    ax.set_xlabel("layer")
    ax.set_ylabel("block influence")
    ax.set_title("Block influence per layer (ShortGPT)")
    return _finish(fig, ax, "block-influence.png")


def kv_similarity(similarity: dict[str, list[float]], merge_loss: dict[int, dict[str, list[float]]]) -> Figure:
    """Mean pairwise cosine of the KV heads' outputs, and the energy an svd merge to t heads keeps."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for colour, kind in zip(_COLOURS, ("k", "v")):
        ax.plot(similarity[kind], "o-", markersize=3, linewidth=1.2, color=colour, label=f"{kind.upper()} head cosine")
    for colour, (target, loss) in zip(_COLOURS[2:], sorted(merge_loss.items())):
        for style, kind in (("--", "k"), (":", "v")):
            ax.plot(
                [1 - x for x in loss[kind]],
                style,
                linewidth=1.2,
                color=colour,
                label=f"{kind.upper()} energy kept, svd merge to {target}",
            )
    ax.axhline(0, color="#444444", linewidth=0.6, gid="guide")  # not a curve
    ax.set_ylim(min(-0.3, ax.get_ylim()[0]), 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine / share of energy")
    ax.set_title("KV heads: how alike they are, how well they merge")
    return _finish(fig, ax, "kv-head-similarity.png", legend_size=7)


def indexer_recall(series: dict[str, dict[int, float]]) -> Figure:
    """One curve per labelled measurement (e.g. at init and after warm-up): recall per sparse layer."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for colour, (label, recall) in zip(_COLOURS, series.items()):
        layers = sorted(recall, key=int)
        ax.plot(
            [int(i) for i in layers],
            [recall[i] for i in layers],
            "o-",
            markersize=4,
            linewidth=1.2,
            color=colour,
            label=label,
        )
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of dense attention mass kept")
    ax.set_title("Sparse attention: indexer recall per layer")
    return _finish(fig, ax, "indexer-recall.png")


def _finish(fig, ax, name: str, legend_size: int = 8) -> Figure:
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=legend_size)
    curves = len(ax.get_lines()) - sum(1 for line in ax.get_lines() if line.get_gid() == "guide")
    return Figure(name, ax.get_title(), png_bytes(fig), curves)
