"""The chat app in a real headless Chromium: upload an image, ask about it, see the answer stream in."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("playwright", reason="Playwright for Python is not installed (pip install -e '.[dev]')")
if shutil.which("chromium") is None:
    # .ci/run installs Chromium, so in CI a missing browser is a broken set-up, never a pass.
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but no Chromium binary: .ci/run should have installed Debian's chromium")
    pytest.skip("no Chromium binary (Debian: apt install chromium; .ci/run installs it)", allow_module_level=True)

from test_chat_app import _speaks_ascii

from surgeon.demos.browser import CHROMIUM, ask, free_port
from surgeon.demos.chat import build_demo

MARKDOWN_SIGNS = set("*_~`#<>[]()!|&\\-+=:")


def _renders_as_itself(text: str) -> bool:
    return text.isascii() and text.isprintable() and not MARKDOWN_SIGNS & set(text)


@pytest.fixture(scope="module")
def plain_spoken_vlm(tmp_path_factory, tokenizer_dir):
    """A tiny VLM whose replies hold no Markdown signs, even when sampled (the page's default is
    temperature 0.7, top-p 0.9). The page renders replies as Markdown, so a sampled `_` or `*` could
    turn an earlier prefix into emphasis and the rendered text would not grow by appending; these
    replies render as themselves."""
    from test_engine import _tiny_vlm_export

    folder = tmp_path_factory.mktemp("plain-spoken-vlm")
    model, tokenizer = _tiny_vlm_export(folder, tokenizer_dir)
    _speaks_ascii(model, tokenizer, speakable=_renders_as_itself, lift=8.0)
    model.save_pretrained(folder)
    return folder


def _with_a_model_card(model: Path, folder: Path) -> Path:
    """A copy of `model` with the card an export carries: KL stages and image questions."""
    from surgeon.report.card import render_card

    shutil.copytree(model, folder)
    kl = {"kl_mean": 0.3524, "kl_median": 0.2389, "kl_p99": 2.0355, "top1_agreement": 0.6666}
    kl |= {"ppl": 46.31, "ppl_parent": 39.31, "tokens": 4088}
    stages = [
        {"name": name, "data": "persuasion.txt", "kind": "kl", "metrics": kl}
        for name in ("after drop_layers", "after heal", "reduce_kv_heads init svd")
    ]
    vision = {"synthetic_accuracy": 0.967, "synthetic_shuffled_accuracy": 0.192, "synthetic_chance": 0.272}
    for kind, right in (("colour", 0.964), ("count", 0.94), ("shape", 0.995)):
        vision |= {f"synthetic_accuracy_{kind}": right, f"synthetic_shuffled_accuracy_{kind}": 0.2}
        vision |= {f"synthetic_examples_{kind}": 200}
    vision |= {"mnist_accuracy": 0.934, "mnist_accuracy_mnist": 0.934, "mnist_shuffled_accuracy": 0.087}
    stages.append({"name": "after heal", "data": "synthetic, mnist", "kind": "vision", "metrics": vision})
    shape = {"layers": 24, "heads": 9, "kv_heads": 3, "params": 113_300_000}
    report = {
        "name": "card-test",
        "base": {"label": "smollm2-135m-instruct"},
        "stages": stages,
        "shape": {"before": shape, "after": shape},
        "provenance": [],
    }
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "README.md").write_text(render_card(report, "name: card-test", []))
    return folder


def test_the_browser_uploads_an_image_and_sees_the_streamed_answer(plain_spoken_vlm, tmp_path):
    png = tmp_path / "blue.png"
    Image.new("RGB", (64, 64), (20, 40, 230)).save(png)
    model = _with_a_model_card(plain_spoken_vlm, tmp_path / "with-card")
    demo = build_demo(str(model), engine_options={"kv_cache_tokens": 1024})
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True)
    try:
        shot = tmp_path / "chat.png"
        answer, seen, wrapped, cells = ask(
            f"http://127.0.0.1:{port}/", "What colour is this?", png, shot, chromium=CHROMIUM
        )
    finally:
        demo.close()
        demo.session.close()
    assert answer and seen and seen[-1] == answer
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:])), seen  # it only grew
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1280, 900)
    # The card panel's metrics table reads at 1280 px: no header or number broken over lines.
    assert cells >= 4 * 4 + 3 * 6 and wrapped == [], wrapped
