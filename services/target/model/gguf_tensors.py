"""The tensors of a GGUF file (name, block type, raw bytes), read without its metadata values.

`gguf.GGUFReader` parses every metadata value into numpy views, element by element: the default
model's file carries a 262,144-entry vocabulary (tokens, scores, token types), and that parse took
~9 of the 25 s a `--weights gguf` target spent loading (py-spy of `Engine.load`, 2-core Xeon). The
weights need only the tensor index, so this reader steps over the metadata (a fixed-size array in
one jump, a string array by its lengths) and maps each tensor's bytes as GGUFReader does: float
types as their elements, block types as uint8 rows (`gguf.quant_shape_to_byte_shape`). The
format's constants come from the gguf package; only the walk is ours.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf import quant_shape_to_byte_shape

_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first (numpy order), in elements
    data: np.ndarray  # read-only view of the file: elements, or uint8 [rows, bytes a row] for block types


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path.name}: the GGUF file ends inside its header (truncated?)")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        return bytes(self.advance(self.take("<Q"))).decode("utf-8")

    def advance(self, n: int) -> memoryview:
        """The next n bytes (a view), stepping past them."""
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path.name}: the GGUF file ends inside its header (truncated?)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def skip_value(self, value_type: int) -> int | None:
        """Steps over one metadata value; returns it if it is a uint32 (general.alignment is one), else None."""
        kind = GGUFValueType(value_type)
        if kind in _SCALAR_BYTES:
            raw = self.advance(_SCALAR_BYTES[kind])
            return int.from_bytes(raw, "little") if kind == GGUFValueType.UINT32 else None
        if kind == GGUFValueType.STRING:
            self.advance(self.take("<Q"))
            return None
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {value_type}")
        item_type, count = self.take("<IQ")
        item = GGUFValueType(item_type)
        if item in _SCALAR_BYTES:
            self.advance(count * _SCALAR_BYTES[item])
        elif item == GGUFValueType.STRING:  # a vocabulary: the hot loop, kept to lengths and offsets
            buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
            try:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            except struct.error:  # a length past the end
                pos = len(buf) + 1
            if pos > len(buf):
                raise ValueError(f"{self.path.name}: the GGUF file ends inside its header (truncated?)")
            self.pos = pos
        else:
            for _ in range(count):
                self.skip_value(item_type)
        return None


def read_tensors(path: Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF file at `path` by its GGUF name; ValueError for a file that is not
    a GGUF of version 2 or 3, or that ends early."""
    path = Path(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    magic, version = cursor.take("<II")
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file (magic {magic:#x})")
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_fields = cursor.take("<QQ")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key = cursor.string()
        value = cursor.skip_value(cursor.take("<I"))
        if key == "general.alignment" and value:
            alignment = value
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        infos.append((name, GGMLQuantizationType(cursor.take("<I")), dims, cursor.take("<Q")))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        shape = tuple(reversed(dims))
        n_elements = int(np.prod(dims))
        block, type_bytes = GGML_QUANT_SIZES[kind]
        start, n_bytes = data_start + offset, n_elements * type_bytes // block
        if start + n_bytes > len(mapped):
            raise ValueError(f"{path.name}: tensor {name} runs past the end of the file (truncated?)")
        raw = mapped[start:start + n_bytes]
        if kind in _ELEMENT_DTYPES:
            data = raw.view(_ELEMENT_DTYPES[kind]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors[name] = GGUFTensor(name, kind, shape, data)
    return tensors
