"""Tensors of a safetensors file as views of just their bytes, mapped copy-on-write.

A safetensors file is an 8-byte header length, a JSON header (per tensor: dtype, shape,
``data_offsets``), then the tensors' bytes in row-major order. :func:`box_view` maps the
bytes that one box of a tensor spans (``tensor[a0:b0, a1:b1, ...]``) with a private
``mmap`` of that range only, and returns them as a tensor with the file's strides:
contiguous for rows (``S(0)``) or a whole tensor, strided for columns (``S(1)``).
Nothing is read until an element is used; the page-cache pages then become this
process's, with no copy.

One mapping per view, not one per file: the kernel maps a file's large folios (up to a
few MiB) whole when they fit in the mapping, so a view of part of a file-wide mapping can
make much more than its own bytes resident, and a file-wide mapping stays as long as any
view lives. A mapping of exactly a view's bytes maps no page outside them (but the two
it starts and ends in), and is unmapped when the last tensor over it is freed. The
mapping is made with libc's ``mmap`` rather than Python's ``mmap`` module, which keeps a
duplicated file descriptor open per mapping (hundreds of parameter views would hold
hundreds of descriptors).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DTYPES", "StoredTensor", "box_view", "read_header"]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names and torch's dtypes (safetensors stores little-endian)."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a safetensors file: its dtype name, shape and first byte."""

    dtype_name: str
    shape: tuple[int, ...]
    start: int  # offset of element 0 in the file

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype_name)


def read_header(fd: int) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file open as ``fd`` and where it lies (the file is assumed valid)."""
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, length, 8))
    header.pop("__metadata__", None)
    return {
        key: StoredTensor(entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
        for key, entry in header.items()
    }


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, offset: int, length: int) -> ctypes.Array:
    """A private, writable (copy-on-write) mapping of ``length`` bytes of ``fd`` from the page-aligned
    ``offset``, as a buffer that unmaps itself when the last object holding it (a tensor) is freed."""
    address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, f"mmap of {length} bytes at {offset}: {os.strerror(error)}")

    class Mapping(ctypes.c_char * length):
        def __del__(self) -> None:
            _libc.munmap(address, length)

    return Mapping.from_address(address)


def box_view(fd: int, stored: StoredTensor, index: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``tensor[index]`` (``[start, stop)`` per dim, all of it for ``()``) of the file open as ``fd``,
    as a view of a mapping of only the bytes it spans: strided like the file, not contiguous
    unless the box is. ``stored.dtype`` must be a torch dtype."""
    shape = stored.shape
    index = tuple(index) or tuple((0, n) for n in shape)
    sizes = [b - a for a, b in index]
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    dtype = stored.dtype
    if any(n == 0 for n in sizes):
        return torch.empty(sizes, dtype=dtype)
    first = sum(a * s for (a, _), s in zip(index, strides))
    last = sum((b - 1) * s for (_, b), s in zip(index, strides))
    item = dtype.itemsize
    begin, end = stored.start + first * item, stored.start + (last + 1) * item
    offset = begin - begin % mmap.PAGESIZE
    mapping = _map(fd, offset, end - offset)
    flat = torch.frombuffer(mapping, dtype=dtype, count=last + 1 - first, offset=begin - offset)
    return flat.as_strided(sizes, strides)
