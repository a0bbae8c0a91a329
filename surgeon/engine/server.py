"""An OpenAI-compatible HTTP server for the embedded engine.

POST /v1/chat/completions (streamed or not; images as data: URLs), POST /v1/completions,
GET /v1/models, GET /health. Every error is JSON, {"error": {"message", "type", "code", "param"}},
with a 4xx status for the client's mistakes. Bounds: request body bytes, images per request, image
bytes and pixels (checked before decoding), requests in flight (EngineBusy -> 503), a per-request
timeout (504, or an error chunk once a stream has started). A client that disconnects has its
request aborted, so its KV blocks are freed at once.

    surgeon serve out/smollm2-drop6 --port 8000
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .images import ImageLimits
from .loop import EngineBusy, EngineLoop, EngineStopped
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    count_images,
    decode_images,
    engine_messages,
    parse,
    sampling_params,
    too_large,
)

log = logging.getLogger(__name__)

# OpenAI's finish_reason knows stop and length; the engine's own reason ("loop": degenerate
# repetition cut short) travels beside it in the choice's `surgeon` extension field.
FINISH_REASONS = {"stop": "stop", "length": "length", "loop": "stop"}


def finish_fields(reason: str | None) -> dict:
    """A choice's finish fields: OpenAI's value, plus surgeon's real reason once there is one."""
    fields = {"finish_reason": FINISH_REASONS.get(reason, reason)}
    if reason is not None:
        fields["surgeon"] = {"finish_reason": reason}
    return fields


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_images: int = 8  # per request
    image: ImageLimits = field(default_factory=ImageLimits)
    request_timeout: float = 600.0  # seconds from arrival to the last token


# ---- the app


class BodyLimit:
    """Refuses request bodies over `max_bytes` with a JSON 413, whatever Content-Length claims.

    The body is read here (so its real size is known) and replayed to the app; later receive()
    calls go straight through, so the app still hears about a client disconnecting. Past the limit
    the rest of the body is read and dropped, up to 4x the limit: a client still busy writing its
    body cannot read the 413; beyond that the answer is sent at once."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        size = int(declared) if declared.isdigit() else 0
        body = bytearray()
        more = size <= 4 * self.max_bytes
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size = max(size, len(body) + len(message.get("body", b"")))
            if size <= self.max_bytes:
                body += message.get("body", b"")
            more = message.get("more_body", False) and size <= 4 * self.max_bytes
        if size > self.max_bytes:
            response = too_large(f"request body exceeds the limit of {self.max_bytes:,} bytes").response()
            return await response(scope, receive, send)

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(engine: EngineLoop, limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The ASGI app; it starts the engine's thread on startup and stops it on shutdown."""
    llm = engine.llm
    name = llm.model_name
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="surgeon", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, f"the engine is not running ({engine.error or 'stopped'})", "server_error")
        return {"status": "ok", "model": name, "requests_in_flight": engine.active}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "surgeon",
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check_model(body: Sampling) -> None:
        if body.model is not None and body.model != name:
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this server serves {name!r}",
                "not_found_error",
                "model_not_found",
                "model",
            )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body: ChatRequest = await parse(request, ChatRequest)
        check_model(body)
        limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        params = sampling_params(body, limit)
        n_images = count_images(body.messages)
        if n_images and not llm.is_vlm:
            raise APIError(400, f"model {name!r} is text-only: it does not accept images", param="messages")
        if n_images > limits.max_images:
            raise APIError(400, f"{n_images} images in one request; the limit is {limits.max_images}", param="messages")
        messages, urls = engine_messages(body.messages)
        images = await asyncio.to_thread(decode_images, urls, limits.image) if urls else None
        return await respond(request, body, messages, params, images, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse(request, CompletionRequest)
        check_model(body)
        params = sampling_params(body, body.max_tokens)
        return await respond(request, body, body.one_prompt(), params, None, chat=False)

    async def respond(request: Request, body: Sampling, prompt, params, images, chat: bool):
        deadline = asyncio.get_running_loop().time() + limits.request_timeout
        try:
            handle = await engine.submit(prompt, params, images)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except EngineBusy as exc:
            raise APIError(503, str(exc), "server_busy", "server_busy") from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), "server_error") from None
        except Exception as exc:  # the engine failed on this input: a bug, but this request's alone
            log.exception("the engine refused a request")
            raise APIError(
                500, f"the engine failed this request: {type(exc).__name__}: {exc}", "server_error"
            ) from None
        reply = Reply(name, chat, handle, deadline)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                reply.stream(usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        collect = asyncio.ensure_future(reply.collect())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            handle.abort()  # a no-op once finished; frees the blocks of a timed-out or abandoned request
            for task in (collect, gone):
                task.cancel()
        if collect not in done:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        return JSONResponse(collect.result())

    return app


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """One request's answer, as a whole JSON object or as server-sent events."""

    def __init__(self, model: str, chat: bool, handle, deadline: float):
        self.model, self.chat, self.handle, self.deadline = model, chat, handle, deadline
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

    async def outputs(self):
        """The engine's outputs; APIError 504 at the deadline, 500 if the engine fails the request."""
        while True:
            remaining = self.deadline - asyncio.get_running_loop().time()
            try:
                out = await self.handle.next(timeout=max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise APIError(504, "request timed out before it finished", "timeout", "timeout") from None
            except Exception as exc:
                raise APIError(500, f"the engine failed this request: {exc}", "server_error") from None
            if out is None:
                return
            self.usage = {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
            }
            if out.speculation is not None:  # an extension field, as finish_reason's is
                self.usage["surgeon"] = {"speculation": speculation_usage(out.speculation, out.completion_tokens)}
            yield out

    async def collect(self) -> dict:
        text, finish = [], None
        async for out in self.outputs():
            text.append(out.text)
            finish = out.finish_reason
        choice = {"index": 0, **finish_fields(finish)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
            choice["logprobs"] = None
        else:
            choice.update(text="".join(text), logprobs=None)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, **finish_fields(finish), "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", **finish_fields(finish), "logprobs": None}
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    async def stream(self, include_usage: bool):
        try:
            if self.chat:
                yield self.chunk(None, role=True)
            async for out in self.outputs():
                if out.text or out.finish_reason:
                    yield self.chunk(out.text, out.finish_reason)
            if include_usage:
                yield sse(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.usage,
                    }
                )
        except APIError as exc:  # the status line is sent already: the error travels as a chunk
            yield sse(exc.body())
        finally:
            # Runs on normal end, on error and when the client disconnects (the task is cancelled).
            self.handle.abort()
        yield "data: [DONE]\n\n"


def speculation_usage(stats: dict, completion_tokens: int) -> dict:
    """What speculative decoding did for a request: draft tokens proposed and accepted, and the
    completion tokens each target forward produced on average."""
    steps = stats["target_steps"]
    return {**stats, "tokens_per_target_step": round(completion_tokens / steps, 3) if steps else None}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def serve(
    path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_num_seqs: int = 16,
    max_pending: int = 256,
    limits: ServerLimits = ServerLimits(),
    log_level: str = "info",
    **llm_kwargs,
) -> None:
    """Load the model at `path` and serve it until interrupted."""
    import uvicorn

    from . import LLM

    llm = LLM(path, max_num_seqs=max_num_seqs, **llm_kwargs)
    llm.warm_up()  # with --compile: the first requests would otherwise wait for compiles
    app = create_app(EngineLoop(llm, max_pending=max_pending), limits)
    log.info("serving %s on http://%s:%d/v1", llm.model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
