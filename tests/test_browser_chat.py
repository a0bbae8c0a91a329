"""The chat app in a real headless Chromium: upload an image, ask about it, see the answer stream in."""

from __future__ import annotations

import os
import shutil
import struct

import pytest
from PIL import Image

pytest.importorskip("playwright", reason="Playwright for Python is not installed (pip install -e '.[dev]')")
if shutil.which("chromium") is None:
    # .ci/run installs Chromium, so in CI a missing browser is a broken set-up, never a pass.
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but no Chromium binary: .ci/run should have installed Debian's chromium")
    pytest.skip("no Chromium binary (Debian: apt install chromium; .ci/run installs it)", allow_module_level=True)

from test_chat_app import chatty_vlm  # noqa: F401  (a fixture: a tiny VLM whose replies are printable)

from surgeon.demos.browser import CHROMIUM, ask, free_port
from surgeon.demos.chat import build_demo


def test_the_browser_uploads_an_image_and_sees_the_streamed_answer(chatty_vlm, tmp_path):  # noqa: F811
    png = tmp_path / "blue.png"
    Image.new("RGB", (64, 64), (20, 40, 230)).save(png)
    demo = build_demo(str(chatty_vlm), engine_options={"kv_cache_tokens": 1024})
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True)
    try:
        shot = tmp_path / "chat.png"
        answer, seen = ask(f"http://127.0.0.1:{port}/", "What colour is this?", png, shot, chromium=CHROMIUM)
    finally:
        demo.close()
        demo.session.close()
    assert answer and seen and seen[-1] == answer
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))  # it only grew
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1280, 900)
