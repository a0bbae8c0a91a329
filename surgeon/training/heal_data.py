"""What a heal step's `data:` section may hold: the source kinds (text, jsonl, local datasets,
self-distillation, image questions) and the packing settings. Schemas only, so the text and image
data builders (training/text_set.py, vision/image_set.py) and the ops share them cheaply."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..answers import AnswerSettings
from ..errors import ParamError
from ..prompts import PromptSources
from ..text import resolve_files


class SelfDistill(PromptSources, AnswerSettings):
    """Prompts answered by the teacher itself through surgeon's engine (greedy unless
    `temperature` > 0; `samples` answers per prompt), so healing needs no data files. Answers are
    cached per teacher, prompts and settings (surgeon/answers.py)."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(1, gt=0, le=64)

    def settings(self) -> AnswerSettings:
        return AnswerSettings(**self.model_dump(include=set(AnswerSettings.model_fields)))


class SyntheticImages(BaseModel):
    """Rendered image questions (surgeon.vision.synthetic): `examples` of the train stream.
    `style`: how scenes are drawn (plain, varied, or second: another renderer, measurement only)."""

    model_config = ConfigDict(extra="forbid")

    examples: int = Field(gt=0, le=1_000_000)
    kinds: list[Literal["colour", "shape", "count", "position", "word"]] = [
        "colour",
        "shape",
        "count",
        "position",
        "word",
    ]
    seed: int = 0
    split: Literal["train", "heldout"] = "train"
    style: Literal["plain", "varied", "second"] = "plain"

    @model_validator(mode="after")
    def _second_draws_shapes(self):
        if self.style == "second" and "word" in self.kinds:
            raise ValueError("the second renderer draws shapes only: leave 'word' out of kinds")
        return self


class MnistDigits(BaseModel):
    """ "Which digit is this?" on a CSV of MNIST rows (784 pixels, then the label). `split`: `train`
    (per digit, the first 80% of its rows), `heldout` (the last 20%), or `rows` ("0-3999")."""

    model_config = ConfigDict(extra="forbid")

    path: str
    split: Literal["train", "heldout", "all"] = "train"
    rows: str | None = Field(None, pattern=r"^\d+-\d+$")
    examples: int | None = Field(None, gt=0)


class DataSource(BaseModel):
    """Exactly one of: `text` (files/globs), `jsonl` (records with `text` or chat `messages`; with
    `image`/`images` paths for a grafted VLM), `dataset` (a local file read by the `datasets`
    library: json, csv, parquet or text), `self_distill`, or for a VLM `synthetic` / `mnist`
    image questions. `tokens` caps what a text source contributes."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    jsonl: str | list[str] | None = None
    dataset: str | None = None
    data_files: str | list[str] | None = None
    split: str = "train"
    field: str = "text"
    self_distill: SelfDistill | None = None
    synthetic: SyntheticImages | None = None
    mnist: MnistDigits | None = None
    tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"each source needs exactly one of {', '.join(SOURCE_KINDS)}")
        if self.dataset is not None and self.data_files is None:
            raise ValueError("`dataset` needs `data_files` (local files; nothing is downloaded)")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in SOURCE_KINDS if getattr(self, k) is not None)


SOURCE_KINDS = ("text", "jsonl", "dataset", "self_distill", "synthetic", "mnist")
IMAGE_KINDS = ("synthetic", "mnist")  # jsonl may hold image records too


class HealData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[DataSource] = Field(min_length=1)
    window: int = Field(256, ge=16, le=32768)
    tokens: int | None = Field(None, gt=0)  # training-token budget over all sources
    heldout_windows: int = Field(8, ge=0)
    assistant_only: bool = False  # chat records train on assistant turns only (plain text: on everything)
    heldout_examples: int = Field(64, ge=0)  # image data: records kept out of training for held-out loss
    seed: int = 0


def check_sources(sources: list[DataSource], base_dir: Path, at: tuple = ("data", "sources")) -> dict[int, list[Path]]:
    """Files each source names, checked now (ParamError pointing at the source, under `at`). A
    self_distill source's entry is a dict: its prompt files by field (prompts_file, from_text)."""
    files: dict = {}
    for index, source in enumerate(sources):
        where = (*at, index)
        if source.kind == "self_distill":
            try:
                files[index] = source.self_distill.check_files(base_dir)
            except ParamError as exc:
                raise exc.under((*where, "self_distill")) from None
            continue
        patterns = {
            "text": source.text,
            "jsonl": source.jsonl,
            "dataset": source.data_files,
            "mnist": source.mnist.path if source.mnist else None,
        }.get(source.kind)
        if patterns is None:
            continue
        field = {"text": "text", "jsonl": "jsonl", "dataset": "data_files", "mnist": "mnist"}[source.kind]
        try:
            files[index] = resolve_files(patterns, base_dir, field)
        except ParamError as exc:
            raise exc.under(where) from None
    return files
