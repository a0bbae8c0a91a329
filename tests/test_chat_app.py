"""The Gradio app of `surgeon chat`, launched in-process and driven through gradio_client."""

from __future__ import annotations

import asyncio
import socket
import textwrap
import threading
import time
from pathlib import Path

import gradio as gr
import pytest
import torch
from PIL import Image

gradio_client = pytest.importorskip("gradio_client")

from surgeon.demos.chat import build_demo  # noqa: E402
from surgeon.demos.model_choice import ModelChoice, choose_model  # noqa: E402
from surgeon.demos.session import ChatSession  # noqa: E402
from surgeon.demos.studio import open_export, plan_text  # noqa: E402
from surgeon.engine import SamplingParams  # noqa: E402

ENGINE = {"kv_cache_tokens": 1024}
GREEDY = (0, 1, 0)  # temperature, top-p, top-k
GREEDY_PARAMS = SamplingParams(temperature=0, max_tokens=4)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def served():
    """served(model) -> a gradio_client.Client talking to the app on a free port; closed afterwards."""
    demos = []

    def serve(model):
        demo = build_demo(str(model), engine_options=ENGINE)
        demos.append(demo)
        port = _free_port()
        demo.launch(prevent_thread_lock=True, server_port=port, quiet=True)
        return gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)

    yield serve
    for demo in demos:
        demo.close()
        demo.session.close()


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _speaks_ascii(model, tokenizer, speakable=_printable_ascii, lift: float = 1.0) -> None:
    """A random model's greedy tokens are mostly stray bytes, which never decode to text (the engine
    holds back partial UTF-8), so nothing would stream. Zeroing every other token's embedding row
    (tied to the LM head) gives those logit 0, below the best `speakable` token's. That holds for
    greedy decoding; `lift` scales the speakable rows so the best of them stands far above 0 and
    sampling (temperature, top-p) never reaches a silent token either."""
    special = set(tokenizer.all_special_ids)
    printable = [i for i in range(len(tokenizer)) if i not in special and (s := tokenizer.decode([i])) and speakable(s)]
    weight = model.get_input_embeddings().weight
    silent = torch.ones(weight.shape[0], dtype=torch.bool)
    silent[printable] = False
    with torch.no_grad():
        weight[silent] = 0
        weight[~silent] *= lift


@pytest.fixture(scope="module")
def chatty_llama(tmp_path_factory, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    _speaks_ascii(model, tokenizer)
    folder = tmp_path_factory.mktemp("chatty-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chatty_vlm(tmp_path_factory, tokenizer_dir):
    from test_engine import _tiny_vlm_export

    folder = tmp_path_factory.mktemp("chatty-vlm")
    model, tokenizer = _tiny_vlm_export(folder, tokenizer_dir)
    _speaks_ascii(model, tokenizer)
    model.save_pretrained(folder)
    return folder


def test_text_turn_streams_the_reply(served, chatty_llama):
    client = served(chatty_llama)
    job = client.submit({"text": "Hello there", "files": []}, *GREEDY, 12, api_name="/chat")
    outputs = list(job)
    replies = [out[0] if isinstance(out, (list, tuple)) else out for out in outputs]
    assert len(replies) > 1, "the reply came in one piece, not streamed"
    assert all(isinstance(r, str) for r in replies) and replies[-1]
    assert all(replies[i + 1].startswith(replies[i]) for i in range(len(replies) - 1))  # each extends the last


def test_image_turn_on_a_vlm_depends_on_the_image(served, chatty_vlm, tmp_path):
    client = served(chatty_vlm)
    replies = []
    for name, colour in (("red", (220, 30, 30)), ("blue", (20, 40, 230))):
        png = tmp_path / f"{name}.png"
        Image.new("RGB", (40, 40), colour).save(png)
        message = {"text": "What colour is this?", "files": [gradio_client.handle_file(str(png))]}
        replies.append(client.predict(message, *GREEDY, 12, api_name="/chat"))
    assert all(isinstance(r, str) and r for r in replies)
    assert replies[0] != replies[1]


def test_typed_image_placeholders_in_the_chat_box_are_text(served, chatty_vlm, tmp_path):
    client = served(chatty_vlm)
    png = tmp_path / "green.png"
    Image.new("RGB", (40, 40), (30, 200, 60)).save(png)
    typed = "Is <image> a tag?"
    with_image = {"text": typed, "files": [gradio_client.handle_file(str(png))]}
    for message in (with_image, {"text": typed, "files": []}):
        reply = client.predict(message, *GREEDY, 8, api_name="/chat")
        assert isinstance(reply, str) and reply and "error" not in reply.lower(), reply


def test_an_image_to_a_text_model_is_refused_with_the_reason(served, tiny_llama, tmp_path):
    client = served(tiny_llama)
    png = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (220, 30, 30)).save(png)
    with pytest.raises(Exception, match="text-only model"):
        client.predict(
            {"text": "What is this?", "files": [gradio_client.handle_file(str(png))]}, *GREEDY, 4, api_name="/chat"
        )


def test_default_model_is_the_vision_export_else_the_base(tmp_path, monkeypatch):
    recipe = tmp_path / "eyes.yaml"
    recipe.write_text("name: eyes\nbase: smollm2-135m-instruct\nsteps: []\n")
    monkeypatch.chdir(tmp_path)
    choice = choose_model(None, recipe)
    assert choice.path == "smollm2-135m-instruct" and "no export" in choice.why
    (tmp_path / "out" / "eyes").mkdir(parents=True)
    (tmp_path / "out" / "eyes" / "config.json").write_text("{}")
    choice = choose_model(None, recipe)
    assert choice.path == str(tmp_path / "out" / "eyes") and "vision recipe" in choice.why
    assert choose_model("out/other").path == "out/other"


def test_studio_shows_errors_with_lines_and_plans_a_valid_recipe(tiny_llama, tmp_path):
    path = str(tmp_path / "studio.yaml")
    broken = textwrap.dedent(f"""\
        name: broken
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [2, 31]}}
        """)
    assert plan_text(path, broken).splitlines() == [
        f"error: {path}:4: steps[0].drop_layers.layers: index 31 out of range (model has 6 layers)"
    ]
    fine = broken.replace("[2, 31]", "[2, 3]")
    shown = plan_text(path, fine)
    assert "error" not in shown and shown.splitlines()[0].split()[:2] == ["step", "layers"]


def test_studio_run_streams_loss_and_exports(tiny_llama, text_dir, tmp_path, monkeypatch):
    from surgeon.demos.studio import run_studio_recipe

    monkeypatch.chdir(tmp_path)  # the export goes to out/NAME under the current folder
    recipe = textwrap.dedent(f"""\
        name: studio-heal
        base: {tiny_llama}
        steps:
          - drop_layers: {{layers: [3]}}
          - heal:
              data: {{sources: [{{text: {text_dir}/calibration.txt}}], window: 64, heldout_windows: 0}}
              train: {{params: ["model.layers.[2-3]"]}}
              steps: 4
              batch_size: 2
              precision: fp32
              log_every: 1
        """)
    updates = list(run_studio_recipe(str(tmp_path / "studio.yaml"), recipe, False))
    tables = [table for _, table, _, _ in updates]
    assert [len(t) for t in tables[1:5]] == [1, 2, 3, 4]  # one loss point per step, shown as it comes
    assert list(tables[-1]["step"]) == [1, 2, 3, 4] and tables[-1]["loss"].notna().all()
    status, _, _, target = updates[-1]
    assert status.startswith(f"exported {tmp_path / 'out' / 'studio-heal'}") and target
    assert (tmp_path / "out" / "studio-heal" / "model.safetensors").is_file()

    # "Open the result in the chat": the chat's engine now serves the export and answers from it.
    session = ChatSession(ModelChoice(str(tiny_llama), "the base model"), ENGINE)
    try:
        before = session.name
        open_export(session, target)
        assert session.choice.path == target and session.choice.why == "the export the studio just made"
        assert session.name != before and session.name == Path(target).name

        async def reply():
            return "".join([p async for p in session.stream([{"role": "user", "content": "hi"}], [], GREEDY_PARAMS)])

        assert isinstance(asyncio.run(reply()), str)
        with pytest.raises(gr.Error, match="run a recipe first"):
            open_export(session, None)
    finally:
        session.close()


def test_studio_stop_ends_the_run_at_the_next_step_and_exports_nothing(tiny_llama, text_dir, tmp_path, monkeypatch):
    from surgeon.demos.studio import run_studio_recipe

    monkeypatch.chdir(tmp_path)
    recipe = textwrap.dedent(f"""\
        name: studio-stop
        base: {tiny_llama}
        steps:
          - heal:
              data: {{sources: [{{text: {text_dir}/calibration.txt}}], window: 64, heldout_windows: 0}}
              train: {{params: ["model.layers.[2-3]"]}}
              steps: 200
              batch_size: 2
              precision: fp32
              log_every: 1
          - evaluate: {{data: {{text: {text_dir}/heldout.txt, tokens: 128, window: 64}}}}
        """)
    stop = threading.Event()
    updates = []
    for update in run_studio_recipe(str(tmp_path / "studio.yaml"), recipe, False, stop=stop):
        updates.append(update)
        if len(update[1]) == 2:  # two loss points in: press Stop
            stop.set()
    status, table, _, target = updates[-1]
    assert status.startswith("stopped: cancelled at") and "nothing exported" in status, status
    assert 2 <= len(table) < 10 and target is None
    assert not (tmp_path / "out" / "studio-stop").exists()
    # The heal's checkpoint is kept, so `surgeon run --resume` continues where Stop left it.
    assert any((tmp_path / "out").glob("studio-stop*checkpoints*"))

    # A page that goes away closes the generator: the run stops too, rather than running on unseen.
    run = run_studio_recipe(str(tmp_path / "studio.yaml"), recipe, True)
    for update in run:
        if len(update[1]) == 2:
            break
    run.close()
    deadline = time.monotonic() + 60
    while any(t.name == "studio-run" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the studio's run outlived its page"
        time.sleep(0.1)
    assert not (tmp_path / "out" / "studio-stop").exists()
