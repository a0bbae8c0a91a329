"""PNG plots for the report and model card: healing curves and KL to the parent per stage."""

from __future__ import annotations

from .canvas import plt, png_bytes
from .provenance_plots import provenance_plots


def report_plots(report: dict) -> dict[str, bytes]:
    """{file name: PNG bytes} for whatever the report has to show (possibly nothing)."""
    plots = {}
    for number, entry in enumerate(report["provenance"], start=1):
        if entry["op"] == "heal" and entry["details"].get("curve"):
            plots[f"healing-{number}.png"] = _healing_curve(entry)
    plots.update(provenance_plots(report))  # the `surgeon analyze` plots of what the steps measured
    kl_stages = [s for s in report["stages"] if s.get("kind", "kl") == "kl"]
    if kl_stages:
        plots["kl-by-stage.png"] = _stages(kl_stages)
    return plots


def _healing_curve(entry: dict) -> bytes:
    curve, heldout = entry["details"]["curve"], entry["details"].get("heldout", [])
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    steps = [c["step"] for c in curve]
    ax.plot(steps, [c["loss"] for c in curve], label="training loss", color="#4C72B0", linewidth=1.2)
    if any(c.get("kl") for c in curve):
        ax.plot(steps, [c["kl"] for c in curve], label="training KL", color="#55A868", linewidth=1.0, alpha=0.8)
    vision = bool(heldout) and "exact" in heldout[0]
    if heldout:
        key, label = ("loss", "held-out answer loss") if vision else ("kl_mean", "held-out KL")
        ax.plot(
            [h["step"] for h in heldout],
            [h[key] for h in heldout],
            "o-",
            label=label,
            color="#C44E52",
            linewidth=1.5,
            markersize=4,
        )
    if vision:  # the share of held-out questions answered exactly, on its own axis
        right = ax.twinx()
        right.plot(
            [h["step"] for h in heldout],
            [h["exact"] for h in heldout],
            "s--",
            color="#8172B2",
            label="held-out exact answers",
            markersize=3,
        )
        right.set_ylim(0, 1)
        right.set_ylabel("exact answers")
        right.legend(frameon=False, loc="center right")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats per token")
    ax.set_title("Training the projector on image questions" if vision else "Healing: distillation from the parent")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    return png_bytes(fig)


def _stages(stages: list[dict]) -> bytes:
    """One panel per evaluation text: KL to the parent at each stage, annotated with top-1 and ppl."""
    by_data: dict[str, list[dict]] = {}
    for stage in stages:
        by_data.setdefault(stage["data"], []).append(stage)
    fig, axes = plt.subplots(1, len(by_data), figsize=(4.2 * len(by_data) + 1, 3.6), dpi=110, squeeze=False)
    for ax, (data, group) in zip(axes[0], by_data.items(), strict=True):
        kls = [s["metrics"]["kl_mean"] for s in group]
        bars = ax.bar(range(len(group)), kls, color="#4C72B0")
        for bar, stage in zip(bars, group, strict=True):
            m = stage["metrics"]
            ax.annotate(
                f"KL {m['kl_mean']:.3f}\ntop-1 {m['top1_agreement']:.2f}\nppl {m['ppl']:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(group)), [s["name"] for s in group], fontsize=8)
        ax.set_ylim(0, max(kls + [0.01]) * 1.5)
        ax.set_title(data if len(data) < 40 else data[:37] + "...", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("mean KL(parent || model)")
    return png_bytes(fig)
