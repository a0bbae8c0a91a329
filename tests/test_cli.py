"""The `surgeon` command: exit codes, messages without tracebacks, and each subcommand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from surgeon.cli import main


def surgeon_process(*args, env=None) -> subprocess.CompletedProcess:
    """A real `python -m surgeon` process: its exit status and streams as a user sees them."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "surgeon", *map(str, args)], capture_output=True, text=True, env=full_env
    )


@pytest.fixture
def surgeon(capsys):
    """Run the CLI in this process (importing torch once, not per call)."""

    def run(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run


def test_broken_recipe_exits_2_with_file_line_and_writes_nothing(write_recipe, tiny_llama, tmp_path, surgeon):
    path = write_recipe(f"""
        name: broken
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [2, 31]}}
        """)
    out = tmp_path / "out"
    result = surgeon_process("run", path, "--out", out / "broken")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {path}:4: steps[0].drop_layers.layers: index 31 out of range (model has 6 layers)"
    )
    assert "Traceback" not in result.stderr
    assert not out.exists()

    debug = surgeon_process("--debug", "validate", path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert surgeon("validate", path).returncode == 2


def test_validate_and_plan(write_recipe, tiny_llama, text_dir, surgeon):
    path = write_recipe(f"""
        name: plan-me
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: ["1-2"]}}
          - stack: {{slices: [{{layers: ["0-3"]}}, {{layers: ["2-3"]}}]}}
        """)
    result = surgeon("validate", path)
    assert result.returncode == 0 and "ok (2 steps)" in result.stdout

    result = surgeon("plan", path)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].split()[:6] == ["step", "layers", "heads", "kv_heads", "params", "bytes"]
    assert [line.split()[1] for line in lines[1:]] == ["6", "4", "6"]

    rows = json.loads(surgeon("plan", "--json", path).stdout)["rows"]
    assert [row["layers"] for row in rows] == [6, 4, 6]
    assert rows[0]["params"] > rows[1]["params"] and rows[0]["bytes"] == rows[0]["params"] * 4
    assert rows[1]["kv_heads"] == 2 and rows[1]["heads"] == 4


def test_run_then_eval(write_recipe, tiny_llama, text_dir, tmp_path, surgeon):
    path = write_recipe(f"""
        name: cli-run
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [4]}}
          - evaluate: {{data: {{text: {text_dir}/heldout.txt, tokens: 256, window: 128}}}}
          - check_instructions: {{max_new_tokens: 4}}
        """)
    out = tmp_path / "cli-run"
    result = surgeon("run", path, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "after drop_layers on heldout.txt: kl_mean" in result.stdout and (out / "model.safetensors").is_file()
    assert "drop_layers: dropped layer 4 (1 of 6)" in result.stdout
    assert re.search(r"after drop_layers: instructions \d+/26 right \(parent \d+/26\)", result.stdout)

    again = surgeon("run", path, "--out", out)
    assert again.returncode == 2 and "already exists" in again.stderr

    result = surgeon(
        "eval",
        out,
        "--parent",
        tiny_llama,
        "--data",
        text_dir / "heldout.txt",
        "--tokens",
        256,
        "--window",
        128,
        "--json",
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    report = json.loads((out / "report.json").read_text())["stages"][0]["metrics"]
    for name in ("kl_mean", "top1_agreement", "ppl", "ppl_parent", "tokens"):
        assert metrics[name] == pytest.approx(report[name], rel=1e-6), name

    missing = surgeon("eval", out, "--parent", tiny_llama, "--data", tmp_path / "nope.txt")
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_push_without_token_fails_clearly(tiny_llama, text_dir, write_recipe, tmp_path, surgeon):
    path = write_recipe(f"""
        name: push-me
        base: {tiny_llama}
        steps: []
        """)
    out = tmp_path / "push-me"
    assert surgeon("run", path, "--out", out).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    result = surgeon_process("push", out, "--repo-id", "someone/push-me", env=env)
    assert result.returncode == 2
    assert "no Hugging Face token" in result.stderr and "nothing was uploaded" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == before

    result = surgeon("push", tmp_path, "--repo-id", "someone/x")
    assert result.returncode == 2 and "is not a surgeon export" in result.stderr


def test_models_lists_every_alias(surgeon):
    result = surgeon("models")
    assert result.returncode == 0
    assert "smollm2-135m-instruct [default]" in result.stdout and "gemma3-270m" in result.stdout
    assert "installed" in result.stdout
