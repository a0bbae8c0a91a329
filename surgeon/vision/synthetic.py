"""Seeded synthetic image questions, so a vision graft can be trained and measured with no files.

Each example is one rendered image and one question with a one-word answer:
colour ("What colour is the shape?"), shape, count (1-5 identical shapes), position (which side a
named shape is on) and a short rendered word. Example i of a split is a pure function of
(seed, split, i); train and held-out draw from different streams, so their scenes differ
(positions and sizes are continuous; `examples` refuses an image it has already produced).

Styles draw the same scene three ways: `plain` (a square canvas, flat colours, upright shapes),
`varied` (for training: other canvas sizes and aspect ratios, colours jittered, shapes turned and
sometimes outlined, gradient, white or tinted backgrounds, a little blur or pixel noise) and
`second` (second_renderer.py: other drawing code, for measurement only), so a graft can be
trained on variety and judged on drawings it never saw.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from .second_renderer import render_second

COLOURS = {
    "red": (215, 38, 38),
    "green": (34, 160, 64),
    "blue": (35, 85, 220),
    "yellow": (240, 200, 20),
    "purple": (135, 55, 185),
    "orange": (245, 130, 15),
}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "dog", "sun", "tree", "book", "fish", "car", "hat", "cup", "box", "map", "key")
COUNT_WORDS = ("one", "two", "three", "four", "five")
KINDS = ("colour", "shape", "count", "position", "word")
STYLES = ("plain", "varied", "second")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is this?",
    "count": "How many shapes are there?",
    "position": "Is the {shape} on the left or the right?",
    "word": "What word is written in the image?",
}


@dataclass
class Scene:
    """What is drawn: enough to redraw the image and to check its answer."""

    kind: str
    answer: str
    question: str
    items: list[dict] = field(default_factory=list)  # shape, colour, centre (x, y), radius
    word: str | None = None
    word_xy: tuple[int, int] | None = None
    word_colour: str | None = None
    background: tuple[int, int, int] = (255, 255, 255)
    key: str = ""  # seed:split:index, which seeds how a style draws it


class SyntheticQuestions:
    """`examples(split, n)` -> records {"images", "messages", "answer", "kind"} in the chat format
    the vision data loader reads; `scene(split, i)` is the drawn content behind record i."""

    def __init__(self, seed: int = 0, size: int = 224, kinds: tuple[str, ...] = KINDS, style: str = "plain"):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown question kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; choose from {', '.join(STYLES)}")
        self.seed, self.size, self.kinds, self.style = seed, size, tuple(kinds), style

    def scene(self, split: str, index: int) -> Scene:
        scene = self._layout(split, index)
        scene.key = f"{self.seed}:{split}:{index}"
        return scene

    def _layout(self, split: str, index: int) -> Scene:
        rng = random.Random(f"surgeon-synthetic:{self.seed}:{split}:{index}")
        kind = self.kinds[rng.randrange(len(self.kinds))]
        shade = rng.randint(225, 255)
        background = (shade, shade, rng.randint(225, 255))
        s = self.size
        if kind in ("colour", "shape"):
            item = self._item(rng, radius=rng.uniform(0.12, 0.3) * s)
            answer = item["colour"] if kind == "colour" else item["shape"]
            return Scene(kind, answer, QUESTIONS[kind], [item], background=background)
        if kind == "count":
            n = rng.randint(1, 5)
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            items = self._spread(rng, n, radius=0.08 * s, shape=shape, colour=colour)
            return Scene(kind, COUNT_WORDS[n - 1], QUESTIONS[kind], items, background=background)
        if kind == "position":
            first, second = rng.sample(SHAPES, 2)
            radius = rng.uniform(0.1, 0.16) * s
            left = self._item(rng, radius, shape=first, x_range=(0.0, 0.5))
            right = self._item(rng, radius, shape=second, x_range=(0.5, 1.0))
            asked = rng.choice([left, right])
            answer = "left" if asked is left else "right"
            return Scene(
                kind, answer, QUESTIONS[kind].format(shape=asked["shape"]), [left, right], background=background
            )
        word = rng.choice(WORDS)
        xy = (int(rng.uniform(0.05, 0.45) * s), int(rng.uniform(0.1, 0.6) * s))
        colour = rng.choice(["red", "blue", "green", "purple"])
        return Scene(kind, word, QUESTIONS[kind], word=word, word_xy=xy, word_colour=colour, background=background)

    def _item(
        self,
        rng: random.Random,
        radius: float,
        shape: str | None = None,
        colour: str | None = None,
        x_range: tuple[float, float] = (0.0, 1.0),
    ) -> dict:
        s = self.size
        lo, hi = x_range[0] * s + radius, x_range[1] * s - radius  # the whole shape inside the range
        return {
            "shape": shape or rng.choice(SHAPES),
            "colour": colour or rng.choice(list(COLOURS)),
            "x": rng.uniform(lo, hi),
            "y": rng.uniform(radius, s - radius),
            "r": radius,
        }

    def _spread(self, rng: random.Random, n: int, radius: float, shape: str, colour: str) -> list[dict]:
        """n non-overlapping items (rejection sampling; the canvas has room for far more than 5)."""
        items: list[dict] = []
        while len(items) < n:
            item = self._item(rng, radius * rng.uniform(0.8, 1.2), shape=shape, colour=colour)
            if all(
                (item["x"] - o["x"]) ** 2 + (item["y"] - o["y"]) ** 2 > (item["r"] + o["r"] + 4) ** 2 for o in items
            ):
                items.append(item)
        return items

    def render(self, scene: Scene) -> Image.Image:
        if self.style == "varied":
            return _render_varied(scene, self.size)
        if self.style == "second":
            return render_second(scene, self.size, COLOURS)
        image = Image.new("RGB", (self.size, self.size), scene.background)
        draw = ImageDraw.Draw(image)
        for item in scene.items:
            _draw_shape(draw, item)
        if scene.word is not None:
            font = ImageFont.load_default(size=max(12, self.size // 6))
            draw.text(scene.word_xy, scene.word, fill=COLOURS[scene.word_colour], font=font)
        return image

    def examples(self, split: str, n: int, start: int = 0) -> Iterator[dict]:
        seen: set[str] = set()
        for index in range(start, start + n):
            scene = self.scene(split, index)
            image = self.render(scene)
            digest = hashlib.sha256(image.tobytes()).hexdigest()
            if digest in seen:
                raise RuntimeError(f"synthetic {split} example {index} repeats an earlier image")
            seen.add(digest)
            yield chat_record(image, scene.question, scene.answer, kind=scene.kind)


def chat_record(image: Image.Image, question: str, answer: str, kind: str = "") -> dict:
    """One image question in the structured chat format transformers' VLM templates use."""
    return {
        "images": [image],
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "answer": answer,
        "kind": kind,
    }


def _draw_shape(draw: ImageDraw.ImageDraw, item: dict) -> None:
    x, y, r, fill = item["x"], item["y"], item["r"], COLOURS[item["colour"]]
    if item["shape"] == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif item["shape"] == "square":
        side = r * 0.85  # a square of the same visual weight as the circle
        draw.rectangle([x - side, y - side, x + side, y + side], fill=fill)
    else:
        draw.polygon([(x, y - r), (x - r * 0.95, y + r * 0.75), (x + r * 0.95, y + r * 0.75)], fill=fill)


def _render_varied(scene: Scene, size: int) -> Image.Image:
    """The scene with its look varied (for training): the canvas stretched to another size and
    aspect ratio, a vertical gradient behind (or flat white, or any light tint), colours jittered,
    squares and triangles turned, some shapes outlined, some images softened, some noisy."""
    rng = random.Random(f"surgeon-varied:{scene.key}")
    width, height = (int(size * rng.uniform(0.7, 1.45)) for _ in range(2))
    sx, sy = width / size, height / size
    backdrop = rng.random()
    if backdrop < 0.25:  # pure white
        top = bottom = (255, 255, 255)
    elif backdrop < 0.5:  # any light tint, not only the plain style's
        top, bottom = (tuple(rng.randint(200, 255) for _ in range(3)) for _ in range(2))
    else:
        top, bottom = scene.background, tuple(min(255, max(190, c + rng.randint(-30, 15))) for c in scene.background)
    image = Image.linear_gradient("L").resize((width, height))
    image = Image.merge("RGB", [image.point(lambda v, a=a, b=b: a + (b - a) * v / 255) for a, b in zip(top, bottom)])
    draw = ImageDraw.Draw(image)
    outline = rng.random() < 0.35
    for item in scene.items:
        fill = tuple(min(255, max(0, c + rng.randint(-16, 16))) for c in COLOURS[item["colour"]])
        x, y, r = item["x"] * sx, item["y"] * sy, item["r"] * (sx * sy) ** 0.5
        angle = rng.uniform(-35, 35)
        edge = tuple(int(c * 0.6) for c in fill) if outline else None
        width_px = rng.randint(1, 3) if outline else 0
        if item["shape"] == "circle":
            draw.ellipse([x - r, y - r, x + r, y + r], fill=fill, outline=edge, width=width_px)
        else:
            corners = (45, 135, 225, 315) if item["shape"] == "square" else (-90, 30, 150)
            reach = r * (0.85 * 2**0.5 if item["shape"] == "square" else 1.0)
            points = [
                (x + reach * math.cos(math.radians(a + angle)), y + reach * math.sin(math.radians(a + angle)))
                for a in corners
            ]
            draw.polygon(points, fill=fill, outline=edge, width=width_px)
    if scene.word is not None:
        font = ImageFont.load_default(size=max(12, int(min(width, height) / 6 * rng.uniform(0.8, 1.2))))
        xy = (scene.word_xy[0] * sx, scene.word_xy[1] * sy)
        draw.text(xy, scene.word, fill=COLOURS[scene.word_colour], font=font)
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 1.0)))
    if rng.random() < 0.5:  # sensor-like noise: a frozen CNN's features move with it more than one expects
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0, rng.uniform(1.0, 6.0), (height, width, 3))
        image = Image.fromarray(np.clip(np.asarray(image, np.float32) + noise, 0, 255).astype(np.uint8), "RGB")
    return image
