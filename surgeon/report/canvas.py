"""The one place matplotlib is set up (Agg: files only, never a window) and the one way a figure
becomes PNG bytes. Every plot in the package draws with `plt` from here and ends in `png_bytes`."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

__all__ = ["plt", "png_bytes"]


def png_bytes(fig) -> bytes:
    """The figure as PNG (laid out tight), closed afterwards so long runs do not hold figures."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
