"""A second way to draw synthetic scenes, for measurement only: a model trained on surgeon's own
drawings should still count, name and colour shapes drawn by other code.

Written apart from synthetic.py on purpose: shapes are rasterised here from signed distances with
numpy (3x supersampled), not by PIL's ImageDraw; canvases come in other sizes and aspect ratios;
colours are a little off (hue, saturation and value moved in HSV); squares are rounded and turned,
triangles turned; backgrounds are gradients with noise; some shapes cast a soft shadow. The scene
(what is drawn and the answer) is the same Scene the first renderer draws, so questions and answers
do not change. Heal refuses this renderer as training data (see vision_heal.py).
"""

from __future__ import annotations

import colorsys
import math
import random

import numpy as np
from PIL import Image

CANVASES = ((320, 200), (200, 320), (288, 288), (384, 256), (180, 240), (256, 352))
SUPERSAMPLE = 3


def render_second(scene, size: int, colours: dict) -> Image.Image:
    """`scene` (a synthetic.Scene) was laid out on a `size` x `size` square; draw it on another canvas,
    another way. `colours` is synthetic's colour table, passed in so this module imports nothing back."""
    if scene.word is not None:
        raise ValueError("the second renderer draws shapes only: leave 'word' out of its kinds")
    rng = random.Random(f"surgeon-second-renderer:{scene.key}")
    width, height = rng.choice(CANVASES)
    sx, sy = width / size, height / size
    s = SUPERSAMPLE
    ys, xs = np.mgrid[0 : height * s, 0 : width * s].astype(np.float32)
    xs, ys = (xs + 0.5) / s, (ys + 0.5) / s  # pixel centres in output coordinates
    canvas = _background(rng, xs, ys, width, height)
    shadow = rng.random() < 0.5
    scale = math.sqrt(sx * sy)  # shapes keep their area as the canvas stretches
    for item in scene.items:
        cx, cy, r = item["x"] * sx, item["y"] * sy, item["r"] * scale
        angle = rng.uniform(-40, 40) if item["shape"] != "circle" else 0.0
        if shadow:
            inside = _coverage(item["shape"], xs - cx - 0.12 * r, ys - cy - 0.12 * r, r, angle, blur=0.25 * r)
            canvas *= 1 - 0.18 * inside[..., None]
        inside = _coverage(item["shape"], xs - cx, ys - cy, r, angle, blur=0.6)
        colour = _nearby_colour(rng, colours[item["colour"]])
        canvas = canvas * (1 - inside[..., None]) + colour * inside[..., None]
    pixels = canvas.reshape(height, s, width, s, 3).mean(axis=(1, 3))
    pixels += np.random.default_rng(rng.getrandbits(32)).normal(0, 3.0, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _background(rng: random.Random, xs: np.ndarray, ys: np.ndarray, width: int, height: int) -> np.ndarray:
    """A two-colour linear gradient at a random angle, both ends light."""
    a = np.array([rng.uniform(205, 255) for _ in range(3)], np.float32)
    b = np.array([rng.uniform(205, 255) for _ in range(3)], np.float32)
    theta = rng.uniform(0, 2 * math.pi)
    t = (xs * math.cos(theta) + ys * math.sin(theta)) / (abs(width * math.cos(theta)) + abs(height * math.sin(theta)))
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    return a * (1 - t[..., None]) + b * t[..., None]


def _coverage(shape: str, dx: np.ndarray, dy: np.ndarray, r: float, angle: float, blur: float) -> np.ndarray:
    """0..1 per sample: inside the shape, with an edge `blur` pixels wide."""
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    u, v = c * dx + s * dy, -s * dx + c * dy  # into the shape's own frame
    if shape == "circle":
        distance = np.hypot(u, v) - r
    elif shape == "square":
        half, corner = 0.85 * r, 0.18 * r  # rounded corners
        qx, qy = np.abs(u) - (half - corner), np.abs(v) - (half - corner)
        distance = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0)) + np.minimum(np.maximum(qx, qy), 0) - corner
    else:  # an upward triangle of circumradius r, as three half-planes
        distance = np.full_like(u, -np.inf)
        for k in range(3):
            normal = math.radians(90 + 120 * k)
            distance = np.maximum(distance, u * math.cos(normal) - v * math.sin(normal) - 0.5 * r)
    return np.clip(0.5 - distance / max(blur, 1e-3), 0.0, 1.0)


def _nearby_colour(rng: random.Random, rgb: tuple[int, int, int]) -> np.ndarray:
    """The named colour, a little off (still nearer its own name than any other of the palette): hue
    within +-0.015 of a turn, saturation and value moved."""
    h, sat, val = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    h = (h + rng.uniform(-0.015, 0.015)) % 1.0
    sat = min(1.0, sat * rng.uniform(0.8, 1.05))
    val = min(1.0, val * rng.uniform(0.85, 1.05))
    return np.array(colorsys.hsv_to_rgb(h, sat, val), np.float32) * 255
