"""The rows of an evaluate_vision stage's metrics, read one way by the card, the run summary and the
chat's card panel. Keys are `{source}_accuracy[_{kind}]`, `{source}_shuffled_accuracy[_{kind}]`,
`{source}_examples[_{kind}]` and `{source}_chance`; a source with a single kind named as itself
(mnist) has only its "all" row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionRow:
    source: str
    kind: str  # "" for all of the source's questions
    accuracy: float
    shuffled: float | None
    chance: float | None  # on the source's "all" row only
    examples: int | None


def vision_rows(m: dict) -> list[VisionRow]:
    rows = []
    sources = sorted({k.removesuffix("_accuracy") for k in m if k.endswith("_accuracy") and "_shuffled" not in k})
    for source in sources:
        kinds = sorted(k.removeprefix(f"{source}_accuracy_") for k in m if k.startswith(f"{source}_accuracy_"))
        for kind in ["", *([] if kinds == [source] else kinds)]:
            suffix = f"_{kind}" if kind else ""
            rows.append(
                VisionRow(
                    source,
                    kind,
                    m[f"{source}_accuracy{suffix}"],
                    m.get(f"{source}_shuffled_accuracy{suffix}"),
                    None if kind else m.get(f"{source}_chance"),
                    m.get(f"{source}_examples{suffix}"),
                )
            )
    return rows
