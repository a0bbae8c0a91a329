"""Read a checkpoint a block of rows at a time: from its safetensors files (nothing read until
asked) or from a model already in memory. The merge step reads N sources this way, so
merging N models costs about one model of RAM, not N."""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from ..errors import SourceError
from ..surgery.selection import select
from .sources import Source


class StateTensors:
    """A model in memory (the patient, the base): rows are views, nothing is copied until used."""

    def __init__(self, label: str, state: dict[str, torch.Tensor]):
        self.label = label
        self._state = state

    def names(self) -> list[str]:
        return list(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        tensor = self._state[name]
        return (tensor.reshape(1) if tensor.dim() == 0 else tensor)[start:stop].float()

    def close(self) -> None:
        pass


class SafetensorsTensors:
    """A source's safetensors files, read with positioned reads rather than a memory map: rows
    read are the only memory used (mapped file pages would count against the process and pile up
    over a whole checkpoint per source)."""

    def __init__(self, source: Source):
        self.label = source.label
        self._entries: dict[str, tuple[int, torch.dtype, tuple[int, ...], int]] = {}  # fd, dtype, shape, offset
        self._fds: list[int] = []
        try:
            for file in source.weight_files():
                fd = os.open(file, os.O_RDONLY)
                self._fds.append(fd)
                for name, (dtype, shape, offset) in read_header(fd, file).items():
                    self._entries[name] = (fd, dtype, shape, offset)
        except OSError as exc:
            self.close()
            raise SourceError(f"source '{self.label}': cannot read its weights: {exc}") from None
        except BaseException:
            self.close()
            raise
        self._names = select(self._entries, source.modules) if source.modules else list(self._entries)

    def names(self) -> list[str]:
        return list(self._names)

    def _entry(self, name: str):
        if name not in self._entries:
            raise SourceError(f"source '{self.label}' has no tensor {name}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        fd, dtype, shape, offset = self._entry(name)
        row_values = math.prod(shape[1:]) if len(shape) > 1 else 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(((stop - start) * row_values,), dtype=dtype)
        view = memoryview(out.numpy() if dtype != torch.bfloat16 else out.view(torch.int16).numpy()).cast("B")
        wanted, read = len(view), 0
        while read < wanted:
            n = os.preadv(fd, [view[read:]], offset + start * row_values * itemsize + read)
            if n <= 0:
                raise SourceError(f"source '{self.label}': {name} is cut short in its file")
            read += n
        return out.view((stop - start, *shape[1:])).float()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(fd: int, file) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """{name: (dtype, shape, absolute byte offset)} from a safetensors file's JSON header."""
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > 100 * 2**20:
        raise SourceError(f"{file}: a safetensors header of {length} bytes is not plausible")
    header = json.loads(os.pread(fd, length, 8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise SourceError(f"{file}: {name} has dtype {info['dtype']}, which a merge cannot read")
        out[name] = (_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + info["data_offsets"][0])
    return out
