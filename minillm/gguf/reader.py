"""A GGUF file read the way a runtime reads it: parse the header once, map the tensor data, copy nothing.

The `gguf` package builds numpy views of every field part, ~5 s for SmolLM2's tokenizer arrays; here the metadata is
parsed with struct in one pass (a string array is decoded when read: StringArray) and each tensor is a zero-copy
view of one read-only memory map, so the OS pages weights in as they are touched. The layout is in GGUFFile's
docstring; tests/test_weights.py checks every field and tensor against the `gguf` package's reader.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
# value type -> struct format of a scalar (8: string, 9: array are handled apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
         10: np.uint64, 11: np.int64, 12: np.float64}
# ggml tensor type -> (name, weights per block, bytes per block): the types minillm reads
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
              30: ("BF16", 1, 2)}


class GGUFError(ValueError):
    """The file is not a GGUF file minillm can read; the message says what was found and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, slowest first: (out, in) for a weight matrix, as nn.Linear holds it
    ggml_type: int
    type_name: str
    data: np.ndarray  # float32 / float16 (shape) for float types; uint8 (rows, bytes per row) for block types


class GGUFFile:
    """`metadata` (key -> str, int, float, bool or list) and `tensors` (name -> TensorInfo) of one GGUF file:

        "GGUF", version (u32), tensor count (u64), key/value count (u64)
        key/value pairs: key (string), value type (u32), value   -- a string is a u64 length + UTF-8 bytes; an array
                                                                    an element type (u32), a count (u64), the items
        tensor infos: name, n_dims (u32), dims (u64 each, fastest-varying first), ggml type (u32), offset (u64)
        padding to `general.alignment` (32 by default), then each tensor's bytes at its offset
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._map
        self._bytes = memoryview(buf)
        if len(buf) < 24 or bytes(buf[:4]) != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF'): "
                            f"delete it and fetch it again")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version}; minillm reads versions 2 and 3")
        self._pos = 24
        try:
            self.metadata = {}
            for _ in range(n_kv):
                key = self._string()
                self.metadata[key] = self._value(self._u32())
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path} ends or breaks inside its header at byte {self._pos} ({e}): the file is "
                            f"truncated or corrupt; delete it and fetch it again") from None
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {}
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in GGML_TYPES:
                raise GGUFError(f"{self.path}: tensor {name} has ggml type {ggml_type}, which minillm does not read "
                                f"(it reads {', '.join(t[0] for t in GGML_TYPES.values())})")
            type_name, per_block, block_bytes = GGML_TYPES[ggml_type]
            shape = tuple(reversed(dims))  # GGUF lists dims fastest-first
            n = int(np.prod(shape, dtype=np.int64))
            nbytes = n // per_block * block_bytes
            begin = start + offset
            if begin + nbytes > len(buf):
                raise GGUFError(f"{self.path}: tensor {name} needs bytes {begin}..{begin + nbytes} but the file has "
                                f"{len(buf)}: it is truncated; delete it and fetch it again")
            raw = buf[begin:begin + nbytes]
            if per_block == 1:
                data = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[type_name]).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], shape[-1] // per_block * block_bytes)
            self.tensors[name] = TensorInfo(name, shape, ggml_type, type_name, data)
        release_pages(buf[:start])  # the header (SmolLM2: 13 MiB, mostly the vocabulary) is parsed: out of memory

    # ------------------------------------------------------------------------------------------------ the header

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._map, self._pos)
        self._pos += 4
        return v

    def _u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self._map, self._pos)
        self._pos += 8
        return v

    def _string(self) -> str:
        n = self._u64()
        # through a memoryview: slicing the memmap itself builds a numpy subarray per string (~3 us each, and the
        # tokenizer's vocabulary and merges are ~98,000 strings)
        raw = bytes(self._bytes[self._pos:self._pos + n])
        if len(raw) != n:
            raise IndexError(f"a string of {n} bytes runs past the end")
        self._pos += n
        return raw.decode("utf-8", "replace")

    def _strings(self, count: int) -> StringArray:
        # where each string starts and ends, no string built: one struct call per string (~0.03 s for SmolLM2's
        # 98,000, where decoding them all took ~0.3 s and ~13 MiB at every load)
        starts, ends, pos, view, unpack = array("Q"), array("Q"), self._pos, self._bytes, struct.unpack_from
        for _ in range(count):
            (n,) = unpack("<Q", view, pos)
            starts.append(pos + 8)
            pos += 8 + n
            ends.append(pos)
        if pos > len(view):
            raise IndexError(f"a string array of {count} runs past the end")
        self._pos = pos
        return StringArray(view, starts, ends)

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, count = self._u32(), self._u64()
            if item == 8:
                return self._strings(count)
            if item in NUMPY:  # a numeric array in one read
                dtype = np.dtype(NUMPY[item])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        if kind not in SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {self._pos}")
        (v,) = struct.unpack_from(SCALARS[kind], self._map, self._pos)
        self._pos += struct.calcsize(SCALARS[kind])
        return v

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._u64() for _ in range(self._u32())]
        return name, dims, self._u32(), self._u64()


class StringArray(Sequence):
    """A metadata array of strings, each decoded (UTF-8, invalid bytes replaced) when it is read: a load whose
    tokenizer comes from its cache (minillm.gguf.tokenizer_cache) reads none of SmolLM2's 98,000. Equal to a list
    of the same strings."""

    def __init__(self, data: memoryview, starts: array, ends: array):
        self._data, self._starts, self._ends = data, starts, ends

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return bytes(self._data[self._starts[i]:self._ends[i]]).decode("utf-8", "replace")

    def __iter__(self):
        data = self._data
        for a, b in zip(self._starts, self._ends):
            yield bytes(data[a:b]).decode("utf-8", "replace")

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, StringArray)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # a sequence that equals a list is not hashable either

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings: {self[:3]!r}...)"


def release_pages(view: np.ndarray) -> None:
    """Tell the OS that a tensor read from a GGUFFile is no longer needed in memory (madvise DONTNEED on the whole
    pages it spans): a loader that converts tensor by tensor then holds one tensor of the file at a time instead of
    all of it beside the converted weights (~94 MiB of SmolLM2's peak). The data stays valid: the file's pages are
    read back from the page cache if touched again. A view of anything but a file map is left alone."""
    mm = getattr(view, "_mmap", None)
    if mm is None or view.nbytes == 0:
        return
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    start = view.ctypes.data - base
    page = mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + view.nbytes) // page * page  # whole pages inside the view
    if end > first:
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)
