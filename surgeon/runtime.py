"""Process-wide settings for long CPU runs, applied once by the CLI."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def limit_heap_fragmentation(threshold_bytes: int = 4 * 2**20) -> bool:
    """Serve allocations above `threshold_bytes` with mmap, returned to the OS when freed.

    glibc raises its mmap threshold each time a large block is freed, after which tens-of-MB
    activation and logits buffers land in the heap, which fragments and never shrinks: peak memory
    of an evaluation then grows by ~80 MB per window. A fixed threshold keeps it flat.
    Returns whether the setting was applied (glibc only; elsewhere nothing is done).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False
