"""A GGUF file's header, checked against the file's size and read in one pass (`read_header`).

Every length and count (strings, arrays, key/value pairs, tensor infos, tensor dimensions) is checked
against the bytes that could hold it before anything it sizes is built; a bad one is a CheckpointError
naming the field. (The gguf package's reader trusts every count: a metadata array claiming 2**61 entries
made it build lists for minutes, gigabytes deep. It also makes a numpy view of every string of every
array: Gemma 3's 262k-token vocabulary took it ~10 s and ~600 MB. Here the values are read with
`struct` and `numpy.frombuffer`, and each tensor is a view of one read-only memory map, laid out as the
gguf reader lays it out, so its `gguf.quants.dequantize` applies.) Little-endian files only (what
llama.cpp writes)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_FORMAT = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass
class TensorInfo:
    """One tensor as the gguf reader describes it: `shape` in ggml's order (fastest dimension first),
    `tensor_type` a gguf.GGMLQuantizationType, `data` a read-only view of its bytes (float types as
    their numpy dtype, block types as uint8 rows of bytes), shaped as the gguf reader shapes it."""
    name: str
    shape: np.ndarray
    tensor_type: object
    data: np.ndarray


@dataclass
class Header:
    """The metadata (key -> value: ints, floats, bools; strings as bytes, arrays as lists) and the tensors."""
    fields: dict
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.at, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file ({what}; the file has {self.size} bytes: "
                               "truncated or corrupt)")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.at + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")
        at, self.at = self.at, self.at + n
        return at

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        if n > self.size - self.at:
            raise self.fail(f"{what} claims a string of {n} bytes")
        return bytes(self.buf[self.take(n, what): self.at])

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR:
            return np.frombuffer(self.buf, _FORMAT[vtype], 1, self.take(_SCALAR[vtype], what))[0].item()
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < 2:
            etype, count = self.u32(what), self.u64(what)
            least = _SCALAR.get(etype, 8 if etype == _STRING else 12 if etype == _ARRAY else None)
            if least is None:
                raise self.fail(f"metadata field {what!r}: unknown array element type {etype}")
            if count > (self.size - self.at) // least:
                raise self.fail(f"metadata field {what!r} claims {count} entries")
            if etype in _SCALAR:
                return np.frombuffer(self.buf, _FORMAT[etype], count, self.take(count * least, what)).tolist()
            return [self.value(etype, what, depth + 1) for _ in range(count)]
        raise self.fail(f"metadata field {what!r}: unknown value type {vtype}")


def read_header(path: Path) -> Header:
    """The checked header of `path` (CheckpointError naming the field if any count or length in it cannot be
    true), its tensors as views of a read-only memory map of the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            fields, infos, start = _check(_Cursor(buf, path), GGML_QUANT_SIZES, GGMLQuantizationType)
    except ValueError as e:  # an empty file cannot be mapped
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    data = np.memmap(path, np.uint8, mode="r")
    out = []
    for name, dims, t, offset, nbytes in infos:
        qt = GGMLQuantizationType(t)
        item = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}.get(qt.name)
        raw = data[start + offset: start + offset + nbytes]
        shape = tuple(int(d) for d in reversed(dims))
        if item is not None:
            view = raw.view(item).reshape(shape)
        else:  # block types: rows of bytes, as gguf's quant_shape_to_byte_shape
            block, size = GGML_QUANT_SIZES[qt]
            view = raw.reshape(shape[:-1] + (shape[-1] // block * size,))
        out.append(TensorInfo(name, np.array(dims, np.uint64), qt, view))
    return Header(fields, out)


def _check(c: _Cursor, sizes, qtype) -> tuple[dict, list, int]:
    if c.size < 24 or bytes(c.buf[:4]) != b"GGUF":
        raise c.fail("no GGUF magic")
    c.take(4, "magic")
    version = c.u32("version")
    if version not in (2, 3):
        raise c.fail(f"GGUF version {version} (2 and 3 are read)")
    n_tensors, n_kv = c.u64("tensor_count"), c.u64("kv_count")
    if n_kv > (c.size - c.at) // 12:
        raise c.fail(f"kv_count {n_kv} key/value pairs")
    if n_tensors > (c.size - c.at) // 24:
        raise c.fail(f"tensor_count {n_tensors} tensors")
    align = 32  # GGUF_DEFAULT_ALIGNMENT
    fields = {}
    for _ in range(n_kv):
        key = c.string("a metadata key").decode("utf-8", "replace")
        vtype = c.u32(f"{key}'s type")
        if key == "general.alignment" and vtype == 4 and c.at + 4 <= c.size:
            align = struct.unpack_from("<I", c.buf, c.at)[0]
        if key in fields:
            raise c.fail(f"metadata field {key!r} appears twice")
        fields[key] = c.value(vtype, key)
    if not 1 <= align <= 1 << 20:
        raise c.fail(f"metadata field 'general.alignment' is {align}")
    data = []  # (name, offset, bytes) of each tensor
    for _ in range(n_tensors):
        name = c.string("a tensor name").decode("utf-8", "replace")
        n_dims = c.u32(f"tensor {name!r}'s n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r}: {n_dims} dimensions")
        dims = [c.u64(f"tensor {name!r}'s shape") for _ in range(n_dims)]
        elements = 1
        for d in dims:
            elements *= d
        t = c.u32(f"tensor {name!r}'s type")
        try:
            block, nbytes = sizes[qtype(t)]
        except (ValueError, KeyError):
            raise c.fail(f"tensor {name!r}: unknown type {t}") from None
        if dims[0] % block:
            raise c.fail(f"tensor {name!r}: rows of {dims[0]} values are not whole {qtype(t).name} blocks of {block}")
        size = elements // block * nbytes
        if size > c.size:
            raise c.fail(f"tensor {name!r} claims {elements} elements")
        data.append((name, c.u64(f"tensor {name!r}'s offset"), size, dims, t))
    start = -(-c.at // align) * align  # the tensor data, aligned after the header
    for name, offset, nbytes, _, _ in data:
        if offset % align:  # llama.cpp refuses it too: every tensor starts on the file's alignment
            raise c.fail(f"tensor {name!r}: data offset {offset} is not a multiple of general.alignment ({align})")
        if start + offset + nbytes > c.size:
            raise c.fail(f"tensor {name!r}: its {nbytes} bytes at data offset {offset} run past the end of the file")
    if len({d[0] for d in data}) != len(data):
        dup = next(n for i, (n, *_) in enumerate(data) if n in {d[0] for d in data[:i]})
        raise c.fail(f"tensor {dup!r} appears twice")
    return fields, [(name, dims, t, offset, nbytes) for name, offset, nbytes, dims, t in data], start
