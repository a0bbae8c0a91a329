"""The OpenAI-compatible server on the real engine (tiny random models), driven by the official
`openai` client over loopback: chat and completions, streamed and not, images as data: URLs, and
the bounds: body size, decompression bombs, bad parameters, a full queue, timeouts, disconnects."""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from PIL import Image

from surgeon.engine import LLM
from surgeon.engine.images import ImageLimits
from surgeon.engine.loop import EngineLoop
from surgeon.engine.server import ServerLimits, create_app

LIMITS = ServerLimits(
    max_body_bytes=64 * 1024,
    max_images=2,
    request_timeout=60,
    image=ImageLimits(max_bytes=32 * 1024, max_pixels=512 * 512),
)


@contextmanager
def running_server(llm, limits: ServerLimits = LIMITS, max_pending: int = 8):
    """The app on a free loopback port, in a background thread; yields (base URL, engine loop)."""
    engine = EngineLoop(llm, max_pending=max_pending)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, limits), log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not engine.alive, "the engine thread outlived the server"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)


def wait_idle(engine: EngineLoop, timeout: float = 10) -> None:
    """Until the engine holds no request (aborts are applied by its thread, a moment later)."""
    deadline = time.monotonic() + timeout
    while engine.active or engine.llm.has_unfinished():
        assert time.monotonic() < deadline, f"{engine.active} requests still in the engine"
        time.sleep(0.02)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def llama(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", max_num_seqs=4, kv_cache_tokens=4096)
    with running_server(llm) as (url, engine):
        yield url, engine


# ---- the happy paths


def test_models_and_health(llama):
    url, engine = llama
    models = client(url).models.list().data
    assert [m.id for m in models] == [engine.llm.model_name]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["requests_in_flight"] == 0


def test_chat_streamed_and_not_give_the_same_greedy_text(llama):
    url, engine = llama
    api = client(url)
    messages = user("the house of the garden")
    whole = api.chat.completions.create(model=engine.llm.model_name, messages=messages, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        api.chat.completions.create(
            model=engine.llm.model_name,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    wait_idle(engine)


def test_text_parts_and_sampling_parameters(llama):
    url, engine = llama
    api = client(url)
    parts = [{"type": "text", "text": "the house "}, {"type": "text", "text": "of the garden"}]
    as_parts = api.chat.completions.create(
        model=engine.llm.model_name, messages=user(parts), max_tokens=6, temperature=0
    )
    as_string = api.chat.completions.create(
        model=engine.llm.model_name, messages=user("the house of the garden"), max_tokens=6, temperature=0
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content

    def sampled(seed):
        return (
            api.chat.completions.create(
                model=engine.llm.model_name,
                messages=user("a letter"),
                max_completion_tokens=12,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
                extra_body={"top_k": 20, "repetition_penalty": 1.1},
            )
            .choices[0]
            .message.content
        )

    assert sampled(7) == sampled(7)


def test_completions_streamed_and_not_with_a_stop_string(llama):
    url, engine = llama
    api = client(url)
    request = dict(
        model=engine.llm.model_name,
        prompt="She said that the",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = api.completions.create(**request)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    text = whole.choices[0].text
    assert "".join(c.choices[0].text for c in api.completions.create(**request, stream=True)) == text
    stop = text.strip()[1]  # the output's own second character: the text ends just before it
    cut = api.completions.create(**request, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    wait_idle(engine)


def test_a_loop_is_stop_for_openai_and_loop_in_the_surgeon_extension(llama):
    """OpenAI clients see "stop"; a client that asks can tell a degenerate loop from an end."""
    url, engine = llama
    api = client(url)
    seen = set()
    for prompt in ("the house of the garden", "of", "garden garden", "the"):
        whole = api.completions.create(model=engine.llm.model_name, prompt=prompt, max_tokens=300, temperature=0)
        choice = whole.choices[0]
        real = choice.model_extra["surgeon"]["finish_reason"]
        assert choice.finish_reason == {"loop": "stop"}.get(real, real)
        seen.add(real)
        chunks = list(
            api.completions.create(
                model=engine.llm.model_name, prompt=prompt, max_tokens=300, temperature=0, stream=True
            )
        )
        last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        assert last.finish_reason == choice.finish_reason and last.model_extra["surgeon"]["finish_reason"] == real
    assert "loop" in seen, seen  # a tiny random model under greedy decoding falls into a loop


def test_completions_take_a_prompt_as_token_ids(llama):
    """As OpenAI's API allows: token ids, alone or as a batch of one, give the text prompt's answer."""
    url, engine = llama
    api, name = client(url), engine.llm.model_name
    ids = engine.llm.tokenizer("the house of the garden")["input_ids"]
    as_text = api.completions.create(model=name, prompt="the house of the garden", max_tokens=6, temperature=0)
    for prompt in (ids, [ids]):
        as_ids = api.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage.prompt_tokens == len(ids)
    for prompt, fragment in (([10**9], "outside the vocabulary"), ([ids, ids], "one prompt per request")):
        with pytest.raises(openai.BadRequestError, match=fragment):
            api.completions.create(model=name, prompt=prompt, max_tokens=2)


def test_max_tokens_is_bounded_by_the_context_not_by_waiting(llama):
    """Without max_tokens: until a stop or the context's end; with one too big: 400 at once."""
    url, engine = llama
    api, name = client(url), engine.llm.model_name
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        api.completions.create(model=name, prompt="the house", max_tokens=1_000_000_000_000)
    assert time.monotonic() - started < 5
    fits = engine.llm.max_model_len - len(engine.llm.tokenizer("the house")["input_ids"])
    answer = api.completions.create(model=name, prompt="the house", max_tokens=fits, temperature=0)
    assert answer.usage.completion_tokens <= fits


# ---- mistakes: JSON errors with 4xx statuses


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"n": 2}, "n must be 1"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        ({"messages": user(5)}, "messages.0.content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])}, "text-only"),
        ({"messages": user("word " * 3000)}, "prompt has"),
        ({"max_tokens": 1_000_000_000_000}, "max_tokens=1000000000000 does not fit"),
        ({"max_tokens": None, "max_completion_tokens": 5000}, "at most"),
    ],
)
def test_bad_requests_get_400_with_a_json_error(llama, kwargs, fragment):
    url, engine = llama
    request = {"model": engine.llm.model_name, "messages": user("hello"), "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(**request)
    error = caught.value.body
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_unknown_routes_and_models(llama):
    url, engine = llama
    for body in (b"{not json", b"[1, 2]", b'{"messages": []}'):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        assert response.status_code == 400 and "message" in response.json()["error"]
    response = httpx.get(url + "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(url).completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_a_body_over_the_limit_gets_413(llama):
    url, engine = llama
    with pytest.raises(openai.APIStatusError) as caught:
        client(url).chat.completions.create(model=engine.llm.model_name, messages=user("x" * 100_000), max_tokens=2)
    assert caught.value.status_code == 413 and "exceeds the limit" in caught.value.body["message"]

    def chunked():  # no Content-Length: the real size is what counts
        for _ in range(100):
            yield b" " * 1024

    response = httpx.post(url + "/v1/completions", content=chunked())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url + "/health").status_code == 200


def test_concurrent_clients_all_get_answers(llama):
    url, engine = llama

    async def run():
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def one(i):
            reply = await api.completions.create(
                model=engine.llm.model_name, prompt=f"the {i} letter", max_tokens=4, temperature=0
            )
            return reply.usage.completion_tokens

        return await asyncio.gather(*(one(i) for i in range(12)))

    assert all(1 <= n <= 4 for n in asyncio.run(run()))
    wait_idle(engine)


# ---- a slowed engine: disconnects, a full queue, timeouts, a failing step


class SlowLLM:
    """The real engine, but each step takes `delay` seconds longer; `fail_next_step` makes one raise."""

    def __init__(self, llm, delay: float):
        self.llm, self.delay, self.fail_next_step, self.steps = llm, delay, False, 0

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def step(self):
        self.steps += 1
        time.sleep(self.delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        return self.llm.step()


@pytest.fixture(scope="module")
def slow_llm(tiny_llama):
    """One running sequence at a time, 50 ms a step: 200 tokens take 10 s, so a request that is
    gone from the engine within a second was aborted, not finished."""
    return SlowLLM(LLM(str(tiny_llama), device="cpu", max_num_seqs=1, kv_cache_tokens=2048), delay=0.05)


def long_request(model: str, stream: bool = True) -> dict:
    return {"model": model, "messages": user("the evening"), "stream": stream, "max_tokens": 200, "ignore_eos": True}


def test_a_client_leaving_frees_its_request(slow_llm):
    with running_server(slow_llm) as (url, engine):
        body = long_request(slow_llm.model_name)
        for _ in range(2):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(lines).startswith("data: ") and next(lines) == ""
            # the connection closes here, seconds before the 200 tokens would be done
            wait_idle(engine, timeout=1.5)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request abandoned by its client
            httpx.post(url + "/v1/chat/completions", json=long_request(slow_llm.model_name, stream=False), timeout=0.3)
        wait_idle(engine, timeout=1.5)
        reply = client(url).chat.completions.create(model=slow_llm.model_name, messages=user("hi"), max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(url + "/health").json()["requests_in_flight"] == 0
        steps = slow_llm.steps
        time.sleep(0.3)
        assert slow_llm.steps == steps, "an idle engine thread should sleep, not step"


def test_a_full_queue_gets_503(slow_llm):
    with running_server(slow_llm, max_pending=1) as (url, engine):
        body = long_request(slow_llm.model_name)
        with (
            httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as first,
            httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as second,
        ):
            assert first.status_code == second.status_code == 200  # one running, one queued
            with pytest.raises(openai.InternalServerError) as caught:
                client(url).chat.completions.create(model=slow_llm.model_name, messages=user("one more"), max_tokens=2)
            assert caught.value.status_code == 503 and caught.value.body["code"] == "server_busy"
            assert caught.value.response.headers["retry-after"] == "1"
        wait_idle(engine, timeout=1.5)


def test_timeouts_get_504_or_end_the_stream_with_an_error(slow_llm):
    with running_server(slow_llm, ServerLimits(request_timeout=0.5)) as (url, engine):
        api = client(url)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            api.completions.create(
                model=slow_llm.model_name, prompt="the garden", max_tokens=200, extra_body={"ignore_eos": True}
            )
        assert caught.value.status_code == 504 and caught.value.body["type"] == "timeout"
        assert time.monotonic() - started < 3
        wait_idle(engine, timeout=1.5)
        with pytest.raises(openai.APIError, match="timed out"):  # the status line went out already
            for _ in api.completions.create(
                model=slow_llm.model_name,
                prompt="the garden",
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass
        wait_idle(engine, timeout=1.5)


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(slow_llm):
    with running_server(slow_llm) as (url, engine):
        api = client(url)
        slow_llm.fail_next_step = True
        with pytest.raises(openai.InternalServerError, match="injected step failure"):
            api.completions.create(model=slow_llm.model_name, prompt="the garden", max_tokens=3)
        assert engine.alive
        wait_idle(engine)
        reply = api.completions.create(model=slow_llm.model_name, prompt="the garden", max_tokens=3)
        assert reply.usage.completion_tokens >= 1


# ---- a VLM: images as data: URLs, and image bounds


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, tokenizer_dir):
    from test_vlm import tiny_vlm
    from transformers import AutoTokenizer

    from surgeon.vision.processor import add_image_token

    folder = tmp_path_factory.mktemp("vlm") / "tiny-vlm"
    model = tiny_vlm()
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert add_image_token(tokenizer) == model.config.image_token_id
    tokenizer.save_pretrained(folder)
    llm = LLM(str(folder), device="cpu", max_num_seqs=2, kv_cache_tokens=2048)
    with running_server(llm) as (url, engine):
        yield url, engine


def picture(seed: int, size=(48, 40)) -> Image.Image:
    return Image.frombytes("RGB", size, bytes((seed * 37 + i * 11) % 256 for i in range(size[0] * size[1] * 3)))


def test_an_image_as_a_data_url_reaches_the_vision_tower(vlm):
    url, engine = vlm
    api = client(url)

    def ask(image):
        content = [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": data_url(image)}},
        ]
        reply = api.chat.completions.create(
            model=engine.llm.model_name, messages=user(content), max_tokens=4, temperature=0
        )
        return reply

    before = engine.llm.vision.encoded
    first = ask(picture(1))
    assert engine.llm.vision.encoded == before + 1
    assert first.usage.prompt_tokens > engine.llm.vision.tokens_per_image
    ask(picture(1).convert("RGB"))  # the same picture again: its features are cached
    assert engine.llm.vision.encoded == before + 1
    ask(picture(2))
    assert engine.llm.vision.encoded == before + 2
    # Text only works on a VLM too.
    assert api.chat.completions.create(model=engine.llm.model_name, messages=user("hello"), max_tokens=2).choices
    wait_idle(engine)


def test_typed_image_placeholders_are_text_not_image_slots(vlm):
    """A user's "<image>" is text: with one image part it is still one image; without, no image."""
    url, engine = vlm
    api, name = client(url), engine.llm.model_name
    typed = "what is <image> here? <image>"
    content = [{"type": "text", "text": typed}, {"type": "image_url", "image_url": {"url": data_url(picture(3))}}]
    assert api.chat.completions.create(model=name, messages=user(content), max_tokens=2, temperature=0).choices
    assert api.chat.completions.create(model=name, messages=user(typed), max_tokens=2, temperature=0).choices
    assert api.completions.create(model=name, prompt=typed, max_tokens=2, temperature=0).choices
    wait_idle(engine)


def bomb_png(width: int, height: int) -> str:
    """A 1x1 PNG whose header is rewritten to claim width x height: a few dozen bytes that would
    decode to width*height pixels, were anyone to decode them."""
    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    png = bytearray(buffer.getvalue())
    png[16:24] = struct.pack(">II", width, height)  # IHDR data starts after the signature, length, type
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # the IHDR chunk's CRC
    return "data:image/png;base64," + base64.b64encode(bytes(png)).decode()


@pytest.mark.parametrize(
    "url_of,status,fragment",
    [
        (lambda: bomb_png(20000, 20000), 413, "decompression bomb"),  # past PIL's own limit
        (lambda: bomb_png(2000, 2000), 413, "exceeds the limit of 262,144 pixels"),  # past ours
        (lambda: data_url(picture(3, (120, 120)), "BMP"), 413, "bytes exceeds the limit"),
        (lambda: "https://example.com/cat.png", 400, "does not fetch URLs"),
        (lambda: "data:image/png;base64,!!!!", 400, "base64 data is malformed"),
        (lambda: "data:image/png;base64," + base64.b64encode(b"not an image").decode(), 400, "not a readable image"),
        (lambda: "data:text/plain;base64,aGk=", 400, "expected data:image"),
    ],
)
def test_bad_images_are_refused_before_decoding(vlm, url_of, status, fragment):
    url, engine = vlm
    content = [{"type": "image_url", "image_url": {"url": url_of()}}, {"type": "text", "text": "what"}]
    with pytest.raises(openai.APIStatusError) as caught:
        client(url).chat.completions.create(model=engine.llm.model_name, messages=user(content), max_tokens=2)
    assert caught.value.status_code == status and fragment in caught.value.body["message"]


def test_too_many_images_and_mismatched_prompts(vlm):
    url, engine = vlm
    image = {"type": "image_url", "image_url": {"url": data_url(picture(4))}}
    with pytest.raises(openai.BadRequestError, match="the limit is 2"):
        client(url).chat.completions.create(model=engine.llm.model_name, messages=user([image] * 3), max_tokens=2)
    # Placeholder token ids with no image: refused. (Typed "<image>" text is text: see the test above.)
    placeholders = [engine.llm.vision.image_token_id] * 16
    with pytest.raises(openai.BadRequestError, match="image"):
        client(url).completions.create(model=engine.llm.model_name, prompt=placeholders, max_tokens=2)
    wait_idle(engine)


# ---- the command


def test_surgeon_serve_command(tiny_llama, tmp_path, capsys):
    from surgeon.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["serve", str(tiny_llama), "--batch-invariant"]) == 2
    assert "--batch-invariant needs --compile" in capsys.readouterr().err

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "surgeon",
            "-q",
            "serve",
            str(tiny_llama),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-num-seqs",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "surgeon serve did not come up in 60 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        reply = client(url).completions.create(model=tiny_llama.name, prompt="the garden", max_tokens=3)
        assert reply.model == tiny_llama.name and reply.usage.completion_tokens >= 1
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 0
