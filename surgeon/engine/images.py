"""`data:image/...;base64,...` URLs -> PIL images, with bounds checked before any pixel is decoded.

The server fetches nothing: a URL that is not a data: URL is refused. The encoded size is checked
before base64 decoding, and the pixel count from the image header before the pixels are decoded,
so a small file that claims 20000x20000 pixels (a decompression bomb) costs nothing to refuse.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


class ImageError(ValueError):
    """An image the server will not decode; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 * 1024 * 1024  # decoded file size
    max_pixels: int = 4096 * 4096  # width x height from the header


def decode_data_url(url: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The RGB image in a base64 data: URL, or ImageError (400 malformed, 413 too large)."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise ImageError(
            f"image_url must be a data: URL (data:image/png;base64,...); got {shown!r}: this server does not fetch URLs"
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[len("data:") :].startswith("image/"):
        raise ImageError(f"image_url: expected data:image/<type>;base64,<data>; got {header[:60]!r}")
    # 4 base64 characters carry 3 bytes: refuse before decoding anything.
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ImageError(
            f"image of ~{len(payload) * 3 // 4:,} bytes exceeds the limit of {limits.max_bytes:,} bytes", status=413
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url: the base64 data is malformed") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data):,} bytes exceeds the limit of {limits.max_bytes:,} bytes", status=413)
    return _open_bounded(data, limits)


def _open_bounded(data: bytes, limits: ImageLimits) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # PIL warns (and past twice its own limit raises) on huge headers; ours is lower.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # lazy: reads the header only
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image refused as a decompression bomb: {exc}", status=413) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError(f"image_url: not a readable image (formats: {', '.join(FORMATS)})") from None
    if image.format not in FORMATS:
        raise ImageError(f"image format {image.format} is not accepted (formats: {', '.join(FORMATS)})")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"image of {width}x{height} = {width * height:,} pixels exceeds the limit of {limits.max_pixels:,} pixels",
            status=413,
        )
    if width == 0 or height == 0:
        raise ImageError("image_url: the image is empty (0 pixels)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()  # the first frame of an animation only
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"image_url: the image data is corrupt ({exc})") from None
