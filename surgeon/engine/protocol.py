"""OpenAI request bodies, checked, and turned into the engine's inputs.

The bodies are pydantic models: a wrong type is a 400 that names the field. Fields the engine
cannot honour (n > 1, logprobs, presence/frequency penalties) are refused rather than ignored;
fields it has no use for (user, metadata, ...) are ignored. `top_k`, `repetition_penalty` and
`ignore_eos` come as extras (the openai client's extra_body).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .images import ImageError, ImageLimits, decode_data_url


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status (4xx: the client's mistake)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def too_large(message: str) -> APIError:
    return APIError(413, message, code="request_too_large")


# ---- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extra_body
    repetition_penalty: float | None = None  # extra_body
    ignore_eos: bool | None = None  # extra_body
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n}: this server returns one choice per request (n must be 1)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; use repetition_penalty (extra_body)", param=name)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # as OpenAI: text or token ids, one or a batch
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("logprobs", "echo", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], int):
            return  # one prompt as token ids
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request (got a list of {len(self.prompt)})", param="prompt")

    def one_prompt(self) -> str | list[int]:
        """The request's prompt: text or token ids."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return self.prompt[0]
        return self.prompt


UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _union_tag(part) -> bool:
    return str(part) in UNION_TAGS or str(part).startswith(("list[", "function-"))


async def parse(request: Request, model: type[Sampling]) -> Sampling:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)

        # Drop the union members pydantic names in locations ("content.str", "content.list[...]"), so
        # a union's alternatives read as one problem: "content: Input should be ... or ...".
        def where(error):
            return ".".join(str(part) for part in error["loc"] if not _union_tag(part)) or "body"

        first = where(errors[0])
        alternatives = [e["msg"] for e in errors if where(e) == first]
        more = len(errors) - len(alternatives)
        more = f" (and {more} more problems)" if more else ""
        raise APIError(400, f"{first}: {' or '.join(alternatives)}{more}", param=first) from None
    body.refuse_unsupported()
    return body


def sampling_params(body: Sampling, max_tokens: int | None):
    from . import SamplingParams

    # As OpenAI: without max_tokens, generate until a stop or the end of the context; with one that
    # cannot fit beside the prompt, the engine refuses the request (400).
    given = dict(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
    kwargs = {name: value for name, value in given.items() if value is not None or name == "max_tokens"}
    kwargs["refuse_overflow"] = max_tokens is not None
    if body.stop is not None:
        kwargs["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None


# ---- chat messages -> the engine's message format


def count_images(messages: list[Message]) -> int:
    return sum(isinstance(part, ImagePart) for m in messages if isinstance(m.content, list) for part in m.content)


def engine_messages(messages: list[Message]) -> tuple[list[dict], list[str]]:
    """(messages with {"type": "image"} parts, the image URLs in order)."""
    converted, urls = [], []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        if not isinstance(message.content, list):
            converted.append({"role": role, "content": message.content or ""})
            continue
        parts = []
        for part in message.content:
            if isinstance(part, ImagePart):
                urls.append(part.image_url.url)
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        converted.append({"role": role, "content": parts})
    return converted, urls


def decode_images(urls: list[str], limits: ImageLimits) -> list:
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(decode_data_url(url, limits))
        except ImageError as exc:
            raise APIError(
                exc.status, f"image {i}: {exc}", code="image_too_large" if exc.status == 413 else None, param="messages"
            ) from None
    return images
