"""A GGUF file's metadata and tensor directory, read in one pass over its header.

The `gguf` package's reader builds a numpy view per value of every metadata array, which for a
tokenizer of 49,152 tokens and as many merges is most of a verifier's start; this reader walks
the header with `struct` and `numpy.frombuffer` instead and reads a tensor's bytes only when it is
asked for (`GGUFFile.array`), with a plain read rather than through a memory map that would keep
every page it touched counted in the process's memory. Dequantization stays the `gguf` package's.

Layout (little-endian, version 2 or 3): "GGUF", version u32, tensor count u64, metadata count
u64; each metadata entry is a string key, a u32 value type and the value (an array is an element
type u32, a count u64 and the elements; a string is a u64 length and UTF-8 bytes); each tensor
entry is a string name, a u32 dimension count, that many u64 dimensions (innermost first), a u32
ggml type and a u64 offset into the data section, which starts at the first multiple of
`general.alignment` (32 when absent) after the header.

>>> import tempfile, gguf as g, numpy as np
>>> path = tempfile.mkdtemp() + "/tiny.gguf"
>>> writer = g.GGUFWriter(path, "llama")
>>> writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
>>> writer.add_tensor("norm", np.arange(6, dtype=np.float32).reshape(2, 3))
>>> for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
...     step()
>>> writer.close()
>>> file = GGUFFile(path)
>>> file.fields["general.architecture"], file.fields["tokenizer.ggml.tokens"]
('llama', ['a', 'b'])
>>> file.tensors["norm"].shape, file.array("norm").tolist()
((2, 3), [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from pardec.runtime.errors import ConfigError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Metadata value types with a fixed width: numpy dtype (little-endian).
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
# ggml tensor types stored as plain numbers (the others are blocks the gguf package dequantizes).
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # outermost first, as torch and numpy want it
    ggml_type: int
    offset: int  # from the file's start
    nbytes: int


class GGUFFile:
    """`fields`: metadata by key (str, int, float, bool, or a list of them); `tensors`: entries by
    name, in file order; `array(name)`: the stored values, read into memory of their own
    (numbers for plain types, rows of raw block bytes for quantized ones)."""

    def __init__(self, path: str):
        self.path = path
        header_map = np.memmap(path, dtype=np.uint8, mode="r")
        buffer = memoryview(header_map)
        if bytes(buffer[:4]) != _MAGIC:
            raise ConfigError(f"{path} is not a GGUF file")
        version, tensor_count, field_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in (2, 3):
            raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        self._buffer, self._at = buffer, 24
        try:
            self.fields = {}
            for _ in range(field_count):
                key = self._string()
                (value_type,) = self._unpack("<I")
                self.fields[key] = self._value(value_type)
            entries = []
            for _ in range(tensor_count):
                name = self._string()
                (dims,) = self._unpack("<I")
                shape = self._unpack(f"<{dims}Q")
                ggml_type, offset = self._unpack("<IQ")
                entries.append((name, tuple(int(d) for d in reversed(shape)), ggml_type, offset))
        except (struct.error, IndexError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: the GGUF header is cut short or damaged ({error})") from None
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._at // alignment) * alignment
        self.tensors = {}
        for name, shape, ggml_type, offset in entries:
            entry = TensorEntry(name, shape, ggml_type, data_start + offset, _nbytes(shape, ggml_type, path, name))
            if entry.offset + entry.nbytes > len(header_map):
                raise ConfigError(f"{path}: tensor {name} runs past the end of the file (cut short?)")
            self.tensors[name] = entry
        del self._buffer, buffer, header_map  # the header's pages go with the map

    def array(self, name: str) -> np.ndarray:
        entry = self.tensors[name]
        raw = np.empty(entry.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as file:
            file.seek(entry.offset)
            if file.readinto(memoryview(raw)) != entry.nbytes:
                raise ConfigError(f"{self.path}: tensor {name} runs past the end of the file")
        if entry.ggml_type in _PLAIN:
            return raw.view(_PLAIN[entry.ggml_type]).reshape(entry.shape)
        return raw.reshape(*entry.shape[:-1], -1)  # rows of blocks, as gguf.quants.dequantize takes them

    def _unpack(self, layout: str) -> tuple:
        values = struct.unpack_from(layout, self._buffer, self._at)
        self._at += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._at
        self._at += length
        if self._at > len(self._buffer):
            raise IndexError("a string runs past the end of the file")
        return bytes(self._buffer[start : self._at]).decode("utf-8", errors="replace")

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type in _SCALARS:
            dtype = np.dtype(_SCALARS[value_type])
            value = np.frombuffer(self._buffer, dtype, 1, self._at)[0].item()
            self._at += dtype.itemsize
            return value
        if value_type != _ARRAY:
            raise ConfigError(f"{self.path}: unknown GGUF value type {value_type}")
        element_type, count = self._unpack("<IQ")
        if element_type == _STRING:
            return [self._string() for _ in range(count)]
        if element_type in _SCALARS:
            dtype = np.dtype(_SCALARS[element_type])
            values = np.frombuffer(self._buffer, dtype, count, self._at).tolist()
            self._at += dtype.itemsize * count
            return values
        return [self._value(element_type) for _ in range(count)]


def _nbytes(shape: tuple[int, ...], ggml_type: int, path: str, name: str) -> int:
    count = int(np.prod(shape)) if shape else 1
    if ggml_type in _PLAIN:
        return count * np.dtype(_PLAIN[ggml_type]).itemsize
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ConfigError(f"{path}: tensor {name} has ggml type {ggml_type}, which the gguf package does not know") from None
    return count // block * block_bytes
