"""Drive the chat app in a real headless Chromium: upload an image, ask, read the streamed answer,
save a screenshot. Used by the browser test and to make the README's screenshot:

    python -m surgeon.demos.browser out/smollm2-eyes picture.png "What shape is this?" docs/chat.png

Needs Playwright for Python (a dev dependency) and a Chromium binary (Debian: apt install chromium);
Playwright's own browser download is not used.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"]


# Cells of the model card's tables whose text takes more than one line (a squeezed column).
CARD_CELLS = "#model-card-text table th, #model-card-text table td"
WRAPPED_CELLS_JS = """() => Array.from(document.querySelectorAll('CELLS'))
  .filter(cell => {
    const range = document.createRange();
    range.selectNodeContents(cell);
    return new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top))).size > 1;
  })
  .map(cell => cell.innerText.trim())""".replace("CELLS", CARD_CELLS)


class Visit(NamedTuple):
    answer: str  # the final answer
    seen: list[str]  # every distinct answer text seen while it streamed
    wrapped_cells: list[str]  # model-card table cells that wrapped at this viewport
    card_cells: int  # model-card table cells on the page


def bot_text(page) -> str:
    replies = page.locator("#chatbot [data-testid=bot]")
    return replies.last.inner_text().strip() if replies.count() else ""


def ask(
    url: str,
    question: str,
    image: Path | None,
    screenshot: Path,
    timeout: float = 120.0,
    settle: float = 3.0,
    chromium: str = CHROMIUM,
) -> Visit:
    """Ask at a 1280 x 900 viewport; the answer is final once it has not changed for `settle` seconds."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.wait_for_selector("#chat-input textarea", timeout=timeout * 1000)
            if image is not None:
                page.locator("#chat-input input[type=file]").set_input_files(str(image))
                page.wait_for_selector("#chat-input img", timeout=timeout * 1000)  # the upload's preview
            page.fill("#chat-input textarea", question)
            page.press("#chat-input textarea", "Enter")
            seen, deadline, changed = [], time.monotonic() + timeout, time.monotonic()
            while time.monotonic() < deadline:
                text = bot_text(page)
                if text and (not seen or seen[-1] != text):
                    seen.append(text)
                    changed = time.monotonic()
                if seen and time.monotonic() - changed > settle:
                    break  # the answer has stopped growing
                time.sleep(0.05)
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(screenshot))
            cells = page.locator(CARD_CELLS).count()
            return Visit(bot_text(page), seen, page.evaluate(WRAPPED_CELLS_JS), cells)
        finally:
            browser.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str]) -> None:
    from .chat import build_demo

    model, image, question, screenshot = argv
    demo = build_demo(model)
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_port=port, quiet=True)
    try:
        visit = ask(f"http://127.0.0.1:{port}/", question, Path(image), Path(screenshot))
        print(f"answer: {visit.answer!r}; screenshot: {screenshot}")
        if visit.wrapped_cells:
            print(f"model-card cells that wrap at 1280 px: {visit.wrapped_cells}")
    finally:
        demo.close()
        demo.session.close()


if __name__ == "__main__":
    main(sys.argv[1:])
