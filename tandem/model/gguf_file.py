"""The table of a GGUF file: its metadata and tensor index, read in milliseconds.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array: on a model
whose vocabulary is ~50k strings (plus as many merges) that is seconds of Python on each start
of each stage. This reader walks the same header with `struct`, keeps large arrays undecoded
until asked for, and maps the tensor data exactly as GGUFReader does (`data` is a read-only
memory map in torch order; block-quantized types as bytes per row), so everything downstream
is unchanged. Little-endian files only (what llama.cpp writes); `open_gguf` hands anything
else to GGUFReader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types GGUFReader maps as typed elements; every other type is bytes, per row.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class UnreadableGGUF(ValueError):
    """The header is not one this reader walks (big-endian, an unknown version or type)."""


@dataclass
class Field:
    """One metadata value. Arrays are decoded on first use (`contents`)."""

    _buf: Any
    _offset: int  # of the first item
    type: GGUFValueType
    item_type: GGUFValueType | None = None  # arrays only
    count: int = 1
    _value: Any = None

    def contents(self) -> Any:
        if self._value is None:
            self._value, _ = _read_value(self._buf, self._offset, self.type, self.item_type)
        return self._value


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order (innermost first), as GGUFReader gives it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """`fields` (key -> Field) and `tensors` (in file order) of the GGUF file at `path`."""

    def __init__(self, path: str) -> None:
        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        if bytes(buf[:4]) != _MAGIC:
            raise UnreadableGGUF("not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise UnreadableGGUF(f"GGUF version {version}")
        offs = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, offs = _read_str(buf, offs)
            (vtype,) = struct.unpack_from("<I", buf, offs)
            offs += 4
            field, offs = _read_field(buf, offs, _value_type(vtype))
            self.fields[key] = field
        infos = []
        for _ in range(n_tensors):
            name, offs = _read_str(buf, offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
            raw_type, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, rel))
        align = self.fields.get("general.alignment")
        alignment = int(align.contents()) if align is not None else 32
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("invalid general.alignment: must be a power of two")
        start = -(-offs // alignment) * alignment
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, start + rel))

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> Tensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise UnreadableGGUF(f"tensor {name!r} has unknown type {raw_type}") from e
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        item = _ELEMENT_TYPES.get(ggml_type)
        if item is None:
            item, count = np.uint8, n_bytes
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
        else:
            count = n_elems
        end = offset + count * np.dtype(item).itemsize
        if end > len(self.data):
            raise ValueError(
                f"tensor {name!r} needs bytes up to {end} but the file has {len(self.data)}"
            )
        data = self.data[offset:end].view(item).reshape(np_dims)
        return Tensor(
            name, ggml_type, np.array(dims, dtype=np.uint64), n_elems, n_bytes, offset, data
        )


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError as e:
        raise UnreadableGGUF(f"unknown metadata type {raw}") from e


def _read_str(buf: Any, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offs)
    return bytes(buf[offs + 8 : offs + 8 + n]).decode("utf-8"), offs + 8 + n


def _read_field(buf: Any, offs: int, vtype: GGUFValueType) -> tuple[Field, int]:
    """The field at `offs` (just after its type) and the offset after it; arrays are skipped
    over without decoding their items."""
    if vtype != GGUFValueType.ARRAY:
        value, end = _read_value(buf, offs, vtype)
        return Field(buf, offs, vtype, _value=value), end
    item_raw, count = struct.unpack_from("<IQ", buf, offs)
    item = _value_type(item_raw)
    first = offs + 12
    if item == GGUFValueType.STRING:
        end = first
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, end)
            end += 8 + n
    elif item in _SCALARS:
        end = first + count * struct.calcsize(_SCALARS[item])
    else:
        raise UnreadableGGUF(f"arrays of {item.name} are not supported")
    return Field(buf, first, vtype, item, count), end


def _read_value(
    buf: Any, offs: int, vtype: GGUFValueType, item: GGUFValueType | None = None
) -> tuple[Any, int]:
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, offs)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, offs)[0], offs + struct.calcsize(fmt)
    if vtype == GGUFValueType.ARRAY and item is not None:
        # `offs` is the first item's (the Field keeps it); the count sits 8 bytes before it.
        (count,) = struct.unpack_from("<Q", buf, offs - 8)
        if item == GGUFValueType.STRING:
            out = []
            for _ in range(count):
                s, offs = _read_str(buf, offs)
                out.append(s)
            return out, offs
        fmt = _SCALARS[item]
        return list(
            struct.unpack_from(f"<{count}{fmt[1]}", buf, offs)
        ), offs + count * struct.calcsize(fmt)
    raise UnreadableGGUF(f"cannot read a value of type {vtype.name}")


def open_gguf(path: str) -> Any:
    """The GGUF file at `path` through this reader, or GGUFReader for what it does not walk."""
    try:
        return GGUFFile(path)
    except UnreadableGGUF:
        import gguf

        return gguf.GGUFReader(path)
