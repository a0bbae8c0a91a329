"""Peak memory of a merge as the number of merged models grows: surgeon's merge step (row blocks read
from each source's safetensors) against the plain approach (every model loaded with
`from_pretrained`, state dicts combined), each in a fresh process so the peaks do not mix.

The sources are N folders that each link to one export's files (SmolLM2-135M, fp32, 513 MiB), so
the disk holds one copy; every process still reads all N as separate models.

    python benchmarks/merge_memory.py [--source out/smollm2-ft-austen] [--counts 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

SURGEON = """
import json, resource, sys, time
from surgeon.recipe.plan import plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe
recipe = load_recipe(sys.argv[1])
expected = plan_recipe(recipe).contexts[0].facts["expected_bytes"]
started = time.perf_counter()
result = run_recipe(recipe, out=sys.argv[2])
entry = result.report["provenance"][0]["details"]
# the peak when the merge step ended (the export after it serialises the model once more)
print(json.dumps({"peak": entry["peak_rss_bytes"], "expected": expected,
                  "merge_s": entry["seconds"], "total_s": time.perf_counter() - started}))
"""

BASE_ONLY = """
import json, resource
from pathlib import Path

import yaml
from surgeon.checkpoints.sources import resolve_source
from surgeon.recipe.patient import Patient
patient = Patient.from_source(resolve_source("smollm2-135m-instruct", Path.cwd()))
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

PLAIN = """
import json, resource, sys, time
import torch
from transformers import AutoModelForCausalLM
started = time.perf_counter()
folders = sys.argv[1:]
models = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32) for f in folders]
base, others = models[0].state_dict(), [m.state_dict() for m in models[1:]]
with torch.no_grad():
    for name, tensor in base.items():
        tensor += sum(o[name] - tensor for o in others)  # task arithmetic, weight 1 each
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "total_s": time.perf_counter() - started}))
"""


def linked_copies(source: Path, count: int, root: Path) -> list[Path]:
    folders = []
    for index in range(count):
        folder = root / f"copy{index}"
        folder.mkdir()
        for file in source.iterdir():
            if file.is_file():
                (folder / file.name).symlink_to(file.resolve())
        folders.append(folder)
    return folders


def recipe_for(folders: list[Path], root: Path, method: str) -> Path:
    merge = {"method": method, "models": [{"model": f"m{i}", "weight": 1.0} for i in range(len(folders))]}
    if method == "ties":
        merge["density"] = 0.5
    recipe = {
        "name": "memory-bench",
        "base": "smollm2-135m-instruct",
        "sources": {f"m{i}": str(folder) for i, folder in enumerate(folders)},
        "steps": [{"merge": merge}],
    }
    path = root / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="out/smollm2-ft-austen", help="an export folder to merge copies of")
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8], help="models merged onto the base")
    parser.add_argument("--methods", nargs="+", default=["task_arithmetic", "ties"], help="surgeon's methods to time")
    args = parser.parse_args()
    source = Path(args.source)
    model_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    loaded = run(BASE_ONLY)["peak"]
    print(f"one model: {model_bytes / 2**20:.0f} MiB of safetensors ({source})")
    print(
        f"a process holding only the loaded base (what `surgeon run` starts from): {loaded / 2**20:,.0f} MiB; "
        "the base's weights are paged in from the cache as a merge reads them (another 513 MiB)"
    )
    print("| models | method | surgeon peak | plan: result + working | merge s | plain peak | plain / surgeon |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for count in args.counts:
        with tempfile.TemporaryDirectory(prefix="merge-bench-") as tmp:
            root = Path(tmp)
            folders = linked_copies(source, count, root)
            plain = run(PLAIN, str(source), *map(str, folders))  # base + N models, all loaded
            for method in args.methods:
                ours = run(SURGEON, str(recipe_for(folders, root, method)), str(root / f"out-{method}"))
                print(
                    f"| {count} | {method} | {ours['peak'] / 2**20:,.0f} MiB | "
                    f"{ours['expected'] / 2**20:,.0f} MiB | {ours['merge_s']:.1f} | {plain['peak'] / 2**20:,.0f} MiB | "
                    f"{plain['peak'] / ours['peak']:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
