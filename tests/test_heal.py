"""The heal step on tiny models: it heals, it resumes exactly, LoRA merges, data formats work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from surgeon.checkpoints.sources import resolve_source
from surgeon.errors import ExportError, RecipeError
from surgeon.recipe.plan import format_plan, plan_recipe
from surgeon.recipe.run import run_recipe
from surgeon.recipe.schema import load_recipe
from surgeon.surgery.architecture import keep_layers
from surgeon.training.forward import StudentBody, shared_prefix_length, teacher_forward
from surgeon.training.trainable import TrainSpec, first_trainable_layer, prepare_student


def heal_recipe(write_recipe, model, text_dir, name: str = "recipe.yaml", **heal) -> Path:
    """drop layers 2-3 of a tiny model, evaluate, heal (defaults below, overridden by `heal`), evaluate."""
    evaluate = {"evaluate": {"data": {"text": f"{text_dir}/heldout.txt", "tokens": 512, "window": 128}}}
    step = {
        "data": {"sources": [{"text": f"{text_dir}/calibration.txt"}], "window": 64, "heldout_windows": 4},
        "train": {"params": ["model.layers.[2-3]"]},
        "steps": 8,
        "batch_size": 4,
        "precision": "fp32",
        "log_every": 1,
        "checkpoint_every": 2,
        "eval": {"every": 4},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        **heal,
    }
    recipe = {
        "name": "tiny-heal",
        "base": str(model),
        "steps": [{"drop_layers": {"layers": [2, 3]}}, evaluate, {"heal": step}, evaluate],
    }
    return write_recipe(yaml.safe_dump(recipe, sort_keys=False), name=name)


def test_heal_reduces_kl_and_reports_it(write_recipe, tiny_llama, text_dir, tmp_path):
    result = run_recipe(load_recipe(heal_recipe(write_recipe, tiny_llama, text_dir, steps=16)), out=tmp_path / "x")
    before, after = (s["metrics"] for s in result.report["stages"])
    assert after["kl_mean"] < 0.8 * before["kl_mean"], (before, after)
    entry = result.report["provenance"][-1]
    assert entry["op"] == "heal" and " on calibration.txt; held-out KL " in entry["why"]
    heldout = entry["details"]["heldout"]
    assert heldout[0]["step"] == 0 and heldout[-1]["kl_mean"] < heldout[0]["kl_mean"]
    assert entry["details"]["training"]["shared_prefix_layers"] == 2  # layers 0-1 came from the teacher
    assert len(entry["details"]["curve"]) == 16
    # Plots are numbered by provenance entry: 1 is the drop, 2 the heal.
    assert (result.target / "healing-2.png").is_file() and (result.target / "kl-by-stage.png").is_file()
    card = (result.target / "README.md").read_text()
    assert "## Healing" in card and "![healing-2](healing-2.png)" in card
    assert not (tmp_path / "x.checkpoints").exists()  # removed once the export is written
    # The parent (teacher) was not trained: the export's untrained layers equal the parent's.
    parent = resolve_source(str(tiny_llama), Path.cwd()).load_model()
    assert torch.equal(
        result.patient.model.model.layers[0].mlp.up_proj.weight, parent.model.layers[0].mlp.up_proj.weight
    )
    assert not torch.equal(
        result.patient.model.model.layers[2].mlp.up_proj.weight, parent.model.layers[4].mlp.up_proj.weight
    )


def test_cross_entropy_alone_fine_tunes_without_running_the_teacher(
    write_recipe, tiny_llama, text_dir, tmp_path, monkeypatch
):
    def no_teacher(*_args, **_kwargs):
        raise AssertionError("a cross-entropy fine-tune ran the teacher")

    monkeypatch.setattr("surgeon.training.loop.teacher_forward", no_teacher)
    recipe = heal_recipe(write_recipe, tiny_llama, text_dir, steps=12, loss={"kl": 0, "ce": 1})
    plan = format_plan(plan_recipe(load_recipe(recipe)))
    assert "cross-entropy, no teacher" in plan
    result = run_recipe(load_recipe(recipe), out=tmp_path / "ft")
    entry = result.report["provenance"][-1]
    assert entry["why"].startswith("fine-tuning on the text (cross-entropy x1.0, no teacher)")
    assert entry["details"]["training"]["shared_prefix_layers"] == 0
    curve = [point["ce"] for point in entry["details"]["curve"]]
    assert sum(curve[-3:]) < sum(curve[:3]), curve  # it learned the text


def test_plan_shows_trainable_parameters_and_checks_them(write_recipe, tiny_llama, text_dir):
    plan = plan_recipe(load_recipe(heal_recipe(write_recipe, tiny_llama, text_dir)))
    row = plan.rows[3]
    assert row.step == "steps[2].heal" and "train " in row.note and "%" in row.note
    assert "steps[2].heal" in format_plan(plan) and "`model.layers.[2-3]`" in row.note
    bad = heal_recipe(write_recipe, tiny_llama, text_dir, train={"params": ["model.layer.*"]}, name="bad.yaml")
    with pytest.raises(RecipeError) as info:
        plan_recipe(load_recipe(bad))
    assert "steps[2].heal.train.params: ['model.layer.*'] match no parameter" in info.value.problems[0]


def test_report_names_every_data_source(write_recipe, tiny_llama, text_dir, tmp_path):
    data = {
        "sources": [
            {"self_distill": {"prompts": ["the garden", "a letter"], "max_new_tokens": 40}},
            {"text": f"{text_dir}/calibration.txt", "tokens": 512},
        ],
        "window": 32,
        "heldout_windows": 2,
    }
    path = heal_recipe(write_recipe, tiny_llama, text_dir, data=data, steps=2, eval={"every": 1})
    why = run_recipe(load_recipe(path), out=tmp_path / "x").report["provenance"][-1]["why"]
    assert " on the teacher's answers to 2 prompts + calibration.txt; held-out KL " in why


def test_prefix_sharing_gives_the_students_own_forward(tiny_llama):
    teacher = resolve_source(str(tiny_llama), Path.cwd()).load_model()
    student, _ = prepare_student(keep_layers(teacher, [0, 1, 4, 5]), TrainSpec(params=["model.layers.[2-3]"]))
    first = first_trainable_layer(student)
    assert first == 2 and shared_prefix_length(student, teacher, first) == 2
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    out = teacher_forward(teacher, ids, 2, [])
    shared, _ = StudentBody(student)(ids, out.boundary, 2)
    with torch.no_grad():
        plain = student.model(input_ids=ids).last_hidden_state
    assert torch.allclose(shared, plain, atol=1e-6)
    other = resolve_source(str(tiny_llama), Path.cwd()).load_model()  # same values, other tensors
    assert shared_prefix_length(student, other, first) == 0


def test_lora_merges_into_a_plain_checkpoint(write_recipe, tiny_llama, text_dir, tmp_path):
    from test_export import plain_transformers_logits

    lora = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "layers": ["2-3"]}}
    result = run_recipe(load_recipe(heal_recipe(write_recipe, tiny_llama, text_dir, train=lora)), out=tmp_path / "lora")
    folder = result.target
    names = load_file(str(folder / "model.safetensors")).keys()
    assert not any("lora" in n for n in names)
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(2))
    from safetensors.torch import save_file

    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    plain_transformers_logits(folder, tmp_path / "ids.safetensors", tmp_path / "logits.safetensors")
    with torch.no_grad():
        expected = result.patient.model(input_ids=ids).logits
    assert (load_file(str(tmp_path / "logits.safetensors"))["logits"] - expected).abs().max() <= 1e-4
    counts = result.report["provenance"][-1]["params"]["trainable"]
    assert counts["trainable"] == 2 * 4 * ((64 + 64) + (64 + 32) + (128 + 64))  # r (in + out) per adapted Linear
    before = result.report["stages"][0]["metrics"]["kl_mean"]
    assert result.report["stages"][1]["metrics"]["kl_mean"] < before


def _final_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_killed_run_resumes_to_the_same_result(write_recipe, tiny_llama, text_dir, tmp_path, caplog):
    path = heal_recipe(write_recipe, tiny_llama, text_dir, steps=200)
    reference = run_recipe(load_recipe(path), out=tmp_path / "straight").target

    target = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "surgeon", "-q", "run", str(path), "--out", str(target)],
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints = tmp_path / "killed.checkpoints" / "heal-step2"
    deadline = time.time() + 300
    while not list(checkpoints.glob("step-0000[1-9]?")) + list(checkpoints.glob("step-00000[4-9]")):
        if process.poll() is not None:
            pytest.fail(f"the run ended before it could be killed: {process.stderr.read()[-2000:]}")
        if time.time() > deadline:
            process.kill()
            pytest.fail("no checkpoint appeared")
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not target.exists(), "a killed run must not leave an export"
    killed_at = max(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))
    assert 4 <= killed_at < 200

    with pytest.raises(ExportError, match="--resume"):  # without --resume: refused, nothing lost
        run_recipe(load_recipe(path), out=target)
    with caplog.at_level("INFO", logger="surgeon.training.driver"):
        resumed = run_recipe(load_recipe(path), out=target, resume=True)
    assert f"resuming at step {killed_at} of 200" in caplog.text
    expected, got = _final_weights(reference), _final_weights(resumed.target)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ"
    straight = json.loads((reference / "report.json").read_text())["provenance"][-1]["details"]["curve"]
    again = resumed.report["provenance"][-1]["details"]["curve"]
    assert [c["loss"] for c in again] == [c["loss"] for c in straight]


def test_teacher_cache_is_reused_across_runs(write_recipe, tiny_llama, text_dir, tmp_path, monkeypatch):
    from surgeon.training import teacher_cache

    path = heal_recipe(write_recipe, tiny_llama, text_dir, teacher_cache={"top_k": 16}, steps=6)
    computed = []
    original = teacher_cache.TeacherCache._compute
    monkeypatch.setattr(
        teacher_cache.TeacherCache, "_compute", lambda self, *a: (computed.append(a[0]), original(self, *a))[1]
    )
    first = run_recipe(load_recipe(path), out=tmp_path / "one")
    assert computed, "the first run computes the teacher's top-k"
    windows = len(set(computed))
    computed.clear()
    second = run_recipe(load_recipe(path), out=tmp_path / "two")
    assert computed == [], "the second run reads every window from the cache"
    assert windows <= 6 * 4
    a, b = _final_weights(first.target), _final_weights(second.target)
    assert all(torch.equal(a[k], b[k]) for k in a)
    before, after = (s["metrics"]["kl_mean"] for s in second.report["stages"])
    assert after < before


def test_early_stop_keeps_the_best_weights(write_recipe, tiny_llama, text_dir, tmp_path):
    # A learning rate far too high: held-out KL gets worse, training stops, the best step is kept.
    path = heal_recipe(
        write_recipe,
        tiny_llama,
        text_dir,
        steps=30,
        eval={"every": 1, "patience": 2},
        optimizer={"lr": 3.0, "warmup_steps": 0},
    )
    result = run_recipe(load_recipe(path), out=tmp_path / "early")
    training = result.report["provenance"][-1]["details"]["training"]
    assert training["stopped_early"] and training["steps"] < 30
    heldout = result.report["provenance"][-1]["details"]["heldout"]
    best = min(h["kl_mean"] for h in heldout)  # step 0, the untrained student, is a candidate too
    assert training["best_step"] == next(h["step"] for h in heldout if h["kl_mean"] == best)
    before, after = (s["metrics"]["kl_mean"] for s in result.report["stages"])
    assert after <= before * 1.01  # the weights kept are the best seen, not the last ones


def test_two_process_ddp_run_matches_one_process(write_recipe, tiny_llama, text_dir, tmp_path):
    """`accelerate launch -m surgeon run`: every process runs the recipe, the batch is split, one exports."""
    path = heal_recipe(write_recipe, tiny_llama, text_dir, steps=6)
    single = run_recipe(load_recipe(path), out=tmp_path / "single").target
    launcher = Path(sys.executable).with_name("accelerate")
    config = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "ddp-cpu.yaml"
    command = [
        str(launcher),
        "launch",
        "--config_file",
        str(config),
        "-m",
        "surgeon",
        "-q",
        "run",
        str(path),
        "--out",
        str(tmp_path / "ddp"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _final_weights(single), _final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-4, worst
