"""MNIST digits from a CSV (784 pixel columns 0-255, then the label), as image questions.

The workplace copy is ../shared/data/images/mnist_5k.csv.gz (rows 0-3999 train, 4000-4999 held
out); any file in that layout works, gzipped or not.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import DataError
from .synthetic import chat_record

QUESTION = "Which digit is this?"


def read_mnist(path: Path, rows: range | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, 28, 28), labels int64 (n,)) for `rows` of the file (all when None)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"MNIST file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 785:
        raise DataError(f"{path}: expected 785 columns (784 pixels, then the label), got {table.shape[-1]}")
    if rows is not None:
        if rows.stop > table.shape[0]:
            raise DataError(f"{path}: rows {rows.start}-{rows.stop - 1} asked, the file has {table.shape[0]}")
        table = table[rows.start : rows.stop : rows.step]
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path}: pixels must be 0-255 and labels 0-9")
    return pixels.reshape(-1, 28, 28).astype(np.uint8), labels


def mnist_examples(path: Path, rows: range | None = None) -> Iterator[dict]:
    """One chat record per digit: the image (RGB, white digit on black as in MNIST) and its label."""
    images, labels = read_mnist(path, rows)
    for pixels, label in zip(images, labels):
        yield chat_record(Image.fromarray(pixels).convert("RGB"), QUESTION, str(int(label)), kind="mnist")
