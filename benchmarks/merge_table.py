"""The fine-tune-and-merge table of the README, from the exports' report.json files.

Run the recipes in recipes/merge/ first (the two fine-tunes, then the merges); this reads what they
measured and prints perplexity on held-out Austen and Shakespeare, the share of each fine-tune's
gain a merge keeps, the instruction check, and each merge's time and peak memory.

    python benchmarks/merge_table.py [--out out]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FINETUNES = {"austen": "smollm2-ft-austen", "shakespeare": "smollm2-ft-shakespeare"}
MERGES = (
    "smollm2-merge-linear",
    "smollm2-merge-task-arithmetic",
    "smollm2-merge-ties",
    "smollm2-merge-dare-ties",
    "smollm2-merge-regmean",
)
DOMAINS = {"austen": "held-out Austen", "shakespeare": "held-out Shakespeare"}


def measured(report: dict) -> dict:
    stages = {s["name"]: s for s in report["stages"]}
    out = {domain: stages[name]["metrics"] for domain, name in DOMAINS.items()}
    checks = [s for s in report["stages"] if s.get("kind") == "instructions"]
    out["instructions"] = checks[-1]["metrics"] if checks else None
    merge = next((p for p in report["provenance"] if p["op"] == "merge"), None)
    out["merge"] = merge["details"] if merge else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="the folder the recipes exported into")
    args = parser.parse_args()
    root = Path(args.out)
    rows = {}
    for name in (*FINETUNES.values(), *MERGES):
        report = root / name / "report.json"
        if report.is_file():
            rows[name] = measured(json.loads(report.read_text()))
    if not all(ft in rows for ft in FINETUNES.values()):
        raise SystemExit(f"run recipes/merge/finetune-*.yaml first (no reports under {root})")
    first = rows[FINETUNES["austen"]]
    parent = {domain: first[domain]["ppl_parent"] for domain in DOMAINS}
    instructions = first["instructions"]
    gains = {domain: parent[domain] - rows[FINETUNES[domain]][domain]["ppl"] for domain in DOMAINS}
    print("| model | ppl Austen | ppl Shakespeare | Austen kept | Shakespeare kept | instructions | merge s | peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    parent_check = f"{instructions['parent_correct']}/{instructions['total']}" if instructions else "—"
    print(f"| parent | {parent['austen']:.2f} | {parent['shakespeare']:.2f} | | | {parent_check} | | |")
    for name, row in rows.items():
        kept = [(parent[d] - row[d]["ppl"]) / gains[d] for d in DOMAINS]
        check = f"{row['instructions']['correct']}/{row['instructions']['total']}" if row["instructions"] else "—"
        seconds = f"{row['merge']['seconds']:.1f}" if row["merge"] else ""
        # the process's peak when the merge finished: the loaded parent, the sources' rows, the result
        peak = f"{row['merge']['peak_rss_bytes'] / 2**20:,.0f} MiB" if row["merge"] else ""
        print(
            f"| {name} | {row['austen']['ppl']:.2f} | {row['shakespeare']['ppl']:.2f} | "
            f"{kept[0]:.0%} | {kept[1]:.0%} | {check} | {seconds} | {peak} |"
        )


if __name__ == "__main__":
    main()
