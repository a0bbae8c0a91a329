"""Image-question data for a grafted VLM: synthetic scenes, MNIST digits and jsonl records.

Images are loaded lazily (each example holds a function that produces its PIL image), so a set of
thousands of examples costs token ids, not pixels; a frozen tower's outputs are computed once by
the training loop instead. jsonl records look like

    {"image": "cat.png", "messages": [{"role": "user", "content": "What is this?"},
                                      {"role": "assistant", "content": "A cat."}]}

(`images: [...]` for several; paths relative to the jsonl file). When the messages hold no image
parts, the images go before the text of the first user turn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import DataError
from ..paths import PathRefused, user_path
from ..text import read_jsonl
from ..training.heal_data import DataSource, HealData, MnistDigits, SyntheticImages
from .mnist import QUESTION as MNIST_QUESTION
from .mnist import read_mnist
from .processor import VLMProcessor
from .synthetic import SyntheticQuestions, chat_record

HELDOUT_SHARE = 0.2


@dataclass
class VisionExample:
    ids: list[int]
    mask: list[bool]  # answer tokens (the training targets)
    images: list[Callable[[], Image.Image]]
    kind: str = ""
    answer: str = ""
    key: str = ""  # identifies the example's content (for digests)


@dataclass
class VisionSet:
    train: list[VisionExample]
    heldout: list[VisionExample]

    def digest(self) -> str:
        h = hashlib.sha256()
        for example in self.train + [None] + self.heldout:
            h.update(b"|" if example is None else f"{example.key}:{example.ids}".encode())
        return h.hexdigest()[:16]


def mnist_rows(labels: np.ndarray, spec: MnistDigits) -> list[int]:
    """Rows for a split. Per digit, not by position: files are often sorted by label (the shared
    mnist_5k.csv.gz is: its last 1,000 rows are all 8s and 9s), so a positional split would hold
    digits out entirely."""
    if spec.rows:
        start, stop = (int(x) for x in spec.rows.split("-"))
        if stop >= len(labels):
            raise DataError(f"{spec.path}: rows {spec.rows} asked, the file has {len(labels)}")
        rows = list(range(start, stop + 1))
    elif spec.split == "all":
        rows = list(range(len(labels)))
    else:
        rows = []
        for digit in range(10):
            where = np.flatnonzero(labels == digit)
            cut = int(round(len(where) * (1 - HELDOUT_SHARE)))
            rows.extend((where[:cut] if spec.split == "train" else where[cut:]).tolist())
        rows.sort()
    if spec.examples and spec.examples < len(rows):
        # Evenly spread over the rows, so a sorted file still gives every digit.
        rows = [rows[int(i * len(rows) / spec.examples)] for i in range(spec.examples)]
    return rows


def source_records(source: DataSource, files: list[Path]) -> list[dict]:
    """Records {"images": [loader, ...], "messages", "answer", "kind", "key"} of one image source."""
    if source.kind == "synthetic":
        return _synthetic(source.synthetic)
    if source.kind == "mnist":
        return _mnist(source.mnist, files[0])
    if source.kind == "jsonl":
        return [record for path in files for record in _jsonl(path)]
    raise DataError(
        f"a {source.kind} source holds no images: a grafted VLM trains on synthetic, mnist or jsonl image records"
    )


def _synthetic(spec: SyntheticImages) -> list[dict]:
    generator = SyntheticQuestions(seed=spec.seed, kinds=tuple(spec.kinds), style=spec.style)
    records = []
    for index in range(spec.examples):
        scene = generator.scene(spec.split, index)
        record = chat_record(None, scene.question, scene.answer, kind=scene.kind)
        record["images"] = [partial(generator.render, scene)]
        record["key"] = f"synthetic:{spec.style}:{spec.seed}:{spec.split}:{index}"
        records.append(record)
    return records


def _mnist(spec: MnistDigits, path: Path) -> list[dict]:
    images, labels = read_mnist(path)
    records = []
    for row in mnist_rows(labels, spec):
        record = chat_record(None, MNIST_QUESTION, str(int(labels[row])), kind="mnist")
        record["images"] = [partial(_digit_image, images[row])]
        record["key"] = f"mnist:{path.name}:{row}"
        records.append(record)
    return records


def _digit_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels).convert("RGB")


def _jsonl(path: Path) -> list[dict]:
    records = []
    for record, where, line in read_jsonl([path]):
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise DataError(f"{where}: expected an object with 'messages' (and 'image' or 'images')")
        names = record.get("images", [record["image"]] if "image" in record else [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DataError(f"{where}: 'images' must be a list of paths")
        loaders = []
        for name in names:
            try:
                file = user_path(name, path.parent)
            except PathRefused as exc:
                raise DataError(f"{where}: image {exc}") from None
            if not file.is_file():
                raise DataError(f"{where}: image {name} not found (looked for {file})")
            loaders.append(partial(_open_image, file, where))
        messages = _with_image_parts(record["messages"], len(loaders), where)
        answer = next(
            (
                m["content"]
                for m in reversed(messages)
                if m.get("role") == "assistant" and isinstance(m.get("content"), str)
            ),
            "",
        )
        records.append(
            {
                "images": loaders,
                "messages": messages,
                "answer": answer,
                "kind": "jsonl",
                "key": f"{where}:{hashlib.sha256(line.encode()).hexdigest()[:12]}",
            }
        )
    return records


def _open_image(file: Path, where: str) -> Image.Image:
    try:
        with Image.open(file) as image:
            return image.convert("RGB")
    except (OSError, Image.DecompressionBombError) as exc:
        raise DataError(f"{where}: cannot read image {file}: {exc}") from None


def _with_image_parts(messages: list, images: int, where: str) -> list:
    has_parts = any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
        for m in messages
        if isinstance(m, dict)
    )
    if has_parts or not images:
        return messages
    out = [dict(m) for m in messages]
    first = next((m for m in out if m.get("role") == "user"), None)
    if first is None:
        raise DataError(f"{where}: images given but no user turn to put them in")
    text = first["content"] if isinstance(first["content"], str) else ""
    first["content"] = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return out


def encode_records(records: list[dict], processor: VLMProcessor, assistant_only: bool = True) -> list[VisionExample]:
    """Token ids and answer masks; records with the same messages are tokenized once."""
    memo: dict[str, tuple[list[int], list[bool]]] = {}
    examples = []
    for record in records:
        key = json.dumps(record["messages"], sort_keys=True)
        if key not in memo:
            memo[key] = processor.encode_text(
                record["messages"], len(record["images"]), assistant_only, record.get("key", "record")
            )
        ids, mask = memo[key]
        examples.append(
            VisionExample(
                ids, mask, record["images"], record.get("kind", ""), record.get("answer", ""), record.get("key", "")
            )
        )
    return examples


def build_vision_set(data: HealData, files: dict[int, list[Path]], processor: VLMProcessor) -> VisionSet:
    records = []
    for index, source in enumerate(data.sources):
        try:
            records.extend(source_records(source, files.get(index, [])))
        except DataError as exc:
            raise DataError(f"data.sources[{index}] ({source.kind}): {exc}") from None
    if not records:
        raise DataError("the image sources hold no records")
    # Chat data trains on the answers: a VLM's targets are what the assistant says about the image.
    examples = encode_records(records, processor, assistant_only=True)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(data.seed)).tolist()
    held = min(data.heldout_examples, max(0, len(examples) - 1))
    return VisionSet([examples[i] for i in order[held:]], [examples[i] for i in order[:held]])


def describe_source(source: DataSource) -> str:
    """An image source in a few words, for plans and model cards."""
    if source.kind == "synthetic":
        spec = source.synthetic
        style = "" if spec.style == "plain" else f", drawn {spec.style}"
        return f"{spec.examples} synthetic {spec.split} ({', '.join(spec.kinds)}{style})"
    if source.kind == "mnist":
        return f"MNIST {source.mnist.rows or source.mnist.split}" + (
            f" ({source.mnist.examples})" if source.mnist.examples else ""
        )
    return f"jsonl {source.jsonl}"
