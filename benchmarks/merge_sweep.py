"""Merge settings tried on the two fine-tunes of recipes/merge/: perplexity on held-out Austen and
Shakespeare and the share of each fine-tune's gain kept, one `surgeon run` per setting (merge and
two evaluations, no export kept).

    python benchmarks/merge_sweep.py [--out out] [--only ties-d0.5-norm ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "text"
HELD_OUT = {
    "austen": {"text": str(TEXT / "austen" / "persuasion.txt"), "tokens": 8192},
    "shakespeare": {
        "text": [
            str(TEXT / "shakespeare" / f"{p}.txt") for p in ("hamlet", "macbeth", "othello", "lear", "romeo_and_juliet")
        ],
        "tokens": 8192,
    },
}
BOTH = ({"model": "austen"}, {"model": "shakespeare"})


def _trained_on(domain: str) -> list[str]:
    """The books recipes/merge/finetune-DOMAIN.yaml trains on: RegMean's calibration, never held out."""
    recipe = ROOT / "recipes" / "merge" / f"finetune-{domain}.yaml"
    text = yaml.safe_load(recipe.read_text())["steps"][0]["heal"]["data"]["sources"][0]["text"]
    return [str((recipe.parent / t).resolve()) for t in ([text] if isinstance(text, str) else text)]


def _models(**values) -> list[dict]:
    return [{**m, **values} for m in BOTH]


def _regmean(alpha: float, tokens: int) -> dict:
    models = [{**m, "data": {"text": _trained_on(m["model"]), "tokens": tokens}} for m in BOTH]
    return {"method": "regmean", "alpha": alpha, "models": models}


SETTINGS = {
    "linear": {"method": "linear", "models": _models(weight=0.5)},
    "slerp-t0.5": {"method": "slerp", "base": "austen", "models": [{"model": "shakespeare"}], "t": 0.5},
    "task_arithmetic-w1": {"method": "task_arithmetic", "models": _models(weight=1.0)},
    "task_arithmetic-w0.4": {"method": "task_arithmetic", "models": _models(weight=0.4)},
    "task_arithmetic-w0.6": {"method": "task_arithmetic", "models": _models(weight=0.6)},
    "task_arithmetic-w0.7": {"method": "task_arithmetic", "models": _models(weight=0.7)},
    "task_arithmetic-mlp1-rest0.5": {
        "method": "task_arithmetic",
        "models": _models(weight=[{"filter": "mlp", "value": 1.0}, {"value": 0.5}]),
    },
    "task_arithmetic-attn1-rest0.5": {
        "method": "task_arithmetic",
        "models": _models(weight=[{"filter": "self_attn", "value": 1.0}, {"value": 0.5}]),
    },
    "ties-d0.5-sum": {"method": "ties", "models": _models(weight=1.0, density=0.5), "normalize": False},
    "ties-d0.3-norm": {"method": "ties", "models": _models(weight=1.0, density=0.3)},
    "ties-d0.5-norm": {"method": "ties", "models": _models(weight=1.0, density=0.5)},
    "ties-d0.7-norm": {"method": "ties", "models": _models(weight=1.0, density=0.7)},
    "ties-d1.0-norm": {"method": "ties", "models": _models(weight=1.0, density=1.0)},
    "dare_ties-d0.5-sum": {"method": "dare_ties", "models": _models(weight=1.0, density=0.5)},
    "dare_ties-d0.5-norm": {"method": "dare_ties", "models": _models(weight=1.0, density=0.5), "normalize": True},
    "dare_linear-d0.5-w0.5": {"method": "dare_linear", "models": _models(weight=0.5, density=0.5)},
    "regmean-a0.5": _regmean(0.5, 16384),
    "regmean-a0.9": _regmean(0.9, 16384),
    "regmean-a1.0": _regmean(1.0, 16384),
    "regmean-a0.9-4k": _regmean(0.9, 4096),
}


def task_vector_cosine(out: Path) -> float:
    """cos(austen - parent, shakespeare - parent) over every weight: how much the fine-tunes moved alike."""
    from surgeon.checkpoints.lazy_tensors import SafetensorsTensors
    from surgeon.checkpoints.sources import resolve_source

    readers = [SafetensorsTensors(resolve_source(str(out / f"smollm2-ft-{d}"), Path.cwd())) for d in HELD_OUT] + [
        SafetensorsTensors(resolve_source("smollm2-135m-instruct", Path.cwd()))
    ]
    dot = norm_a = norm_b = 0.0
    for name in readers[2].names():
        rows = readers[2].shape(name)[0]
        base = readers[2].rows(name, 0, rows).double()
        a, b = (r.rows(name, 0, rows).double() - base for r in readers[:2])
        dot, norm_a, norm_b = (
            dot + float((a * b).sum()),
            norm_a + float(a.square().sum()),
            norm_b + float(b.square().sum()),
        )
    for reader in readers:
        reader.close()
    return dot / (norm_a * norm_b) ** 0.5


def run_setting(name: str, merge: dict, out: Path, work: Path) -> dict:
    recipe = {
        "name": f"sweep-{name}",
        "base": "smollm2-135m-instruct",
        "sources": {domain: str((out / f"smollm2-ft-{domain}").resolve()) for domain in HELD_OUT},
        "steps": [{"merge": merge}] + [{"evaluate": {"name": d, "data": data}} for d, data in HELD_OUT.items()],
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = run_recipe(load_recipe(path), out=work / name, overwrite=True)
    ppl = {s["name"]: s["metrics"]["ppl"] for s in result.report["stages"]}
    parent = {s["name"]: s["metrics"]["ppl_parent"] for s in result.report["stages"]}
    return {"ppl": ppl, "parent": parent, "seconds": result.report["provenance"][0]["details"]["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="where recipes/merge/finetune-*.yaml exported")
    parser.add_argument("--only", nargs="+", choices=sorted(SETTINGS), help="these settings only")
    args = parser.parse_args()
    out = Path(args.out)
    finetuned = {}
    for domain in HELD_OUT:
        report = json.loads((out / f"smollm2-ft-{domain}" / "report.json").read_text())
        finetuned[domain] = next(
            s["metrics"]["ppl"] for s in report["stages"] if s["name"] == f"held-out {domain.title()}"
        )
    print(f"cosine of the two task vectors (fine-tune minus parent, all weights): {task_vector_cosine(out):.3f}")
    print("| setting | ppl Austen | ppl Shakespeare | Austen gain kept | Shakespeare gain kept | merge s |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="merge-sweep-") as tmp:
        for name in args.only or SETTINGS:
            row = run_setting(name, SETTINGS[name], out, Path(tmp))
            kept = [(row["parent"][d] - row["ppl"][d]) / (row["parent"][d] - finetuned[d]) for d in HELD_OUT]
            print(
                f"| {name} | {row['ppl']['austen']:.2f} | {row['ppl']['shakespeare']:.2f} | "
                f"{kept[0]:.0%} | {kept[1]:.0%} | {row['seconds']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
