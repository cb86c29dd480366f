"""GGUF key/value metadata as plain Python values (no tensors are touched here)."""
from __future__ import annotations

import math
import mmap
import os
import struct
import sys
from typing import Any

import gguf
import numpy as np

from onepass.kernels.errors import GGUFError

# bytes per scalar, from the table gguf-py reads them with
_SCALAR_BYTES = {t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_STRING, _ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
# the fewest bytes an element can take: a string is at least its 8-byte length, an array its type and count
_MIN_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}
_MIN_KV = 8 + 4 + 1           # empty key, value type, a one-byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8   # empty name, n_dims, type, offset
_MAX_DIMS = 4                 # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
_MAX_NESTING = 8              # arrays of arrays; nothing real nests at all
_FIX = "the file is damaged or was not written by a GGUF converter: download or convert it again"


class _HeaderScan:
    """One pass over a GGUF header that checks each length and count the file claims against the bytes left before
    it is read. gguf-py trusts them: a count of 2**33 has it read element by element to the end of the file, for
    minutes and GBs of numpy views. This walk costs O(header bytes), whatever is claimed."""

    def __init__(self, path: str, buf: mmap.mmap) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 4
        # gguf-py reads a version whose low half is 0 as written on a host of the other byte order
        native = struct.unpack_from("=I", buf, 4)[0] if self.size >= 8 else 0
        swapped = native and not native & 0xFFFF
        self.order = {"little": "<>", "big": "><"}[sys.byteorder][bool(swapped)]
        self.u32, self.u64 = struct.Struct(self.order + "I"), struct.Struct(self.order + "Q")

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: corrupt or truncated GGUF header ({what}); {_FIX}")

    def take(self, n: int, what: str) -> int:
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but only {left} are left in the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def read(self, fmt: struct.Struct, what: str) -> int:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def text(self, what: str) -> str:
        n = self.read(self.u64, f"the length of {what}")
        start = self.take(n, f"{what} ({n} bytes claimed)")
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at offset {start} is not UTF-8 ({e.reason})") from None

    def skip(self, vtype: int, what: str, depth: int = 0) -> None:
        """Step over one value of type vtype."""
        if vtype in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[vtype], what)
            return
        if vtype == _STRING:
            n = self.read(self.u64, f"the length of {what}")
            self.take(n, f"{what} (a string of {n} bytes)")
            return
        if vtype != _ARRAY:
            raise self.fail(f"{what} has value type {vtype}, which is not a GGUF type")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        itype = self.read(self.u32, f"the element type of {what}")
        count = self.read(self.u64, f"the element count of {what}")
        if itype not in _MIN_BYTES:
            raise self.fail(f"{what} is an array of type {itype}, which is not a GGUF type")
        need, left = count * _MIN_BYTES[itype], self.size - self.pos
        if need > left:
            raise self.fail(f"{what} claims {count} {gguf.GGUFValueType(itype).name} elements ({need} bytes at "
                            f"least), but only {left} bytes are left in the file")
        if itype in _SCALAR_BYTES:
            self.pos += need
        elif itype == _STRING:   # the hot loop (a vocabulary, its merges), inlined: ~0.1 s per million strings
            buf, u64, size, pos = self.buf, self.u64, self.size, self.pos
            for i in range(count):
                pos += 8 + (u64.unpack_from(buf, pos)[0] if pos + 8 <= size else size)
                if pos > size:
                    raise self.fail(f"{what}[{i}], a string, runs past the end of the file ({size} bytes)")
            self.pos = pos
        else:
            for i in range(count):
                self.skip(itype, f"{what}[{i}]", depth + 1)

    def scan(self) -> None:
        version = self.read(self.u32, "the version")
        if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (versions "
                            f"{gguf.gguf_reader.READER_SUPPORTED_VERSIONS} are): convert the model again with a "
                            "current llama.cpp")
        n_tensors = self.read(self.u64, "the tensor count")
        n_kv = self.read(self.u64, "the key/value count")
        left = self.size - self.pos
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > left:
            raise self.fail(f"it claims {n_kv} metadata keys and {n_tensors} tensors, which need at least "
                            f"{n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO} bytes, but only {left} are left")
        keys: set[str] = set()
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self.text(f"metadata key #{i}'s name")
            if key in keys:
                raise self.fail(f"metadata key {key} appears twice")
            keys.add(key)
            vtype = self.read(self.u32, f"metadata key {key}'s type")
            if key != "general.alignment":
                self.skip(vtype, f"metadata key {key}")
                continue
            # the reader's own rule for the one value the layout depends on
            if vtype != gguf.GGUFValueType.UINT32:
                raise self.fail(f"general.alignment has value type {vtype}; it must be UINT32")
            alignment = self.read(self.u32, "general.alignment")
            if not alignment or alignment & (alignment - 1):
                raise self.fail(f"general.alignment is {alignment}; it must be a power of 2")
        tensors, names = [], set()
        for i in range(n_tensors):
            name = self.text(f"tensor #{i}'s name")
            if name in names:
                raise self.fail(f"tensor {name} appears twice")
            names.add(name)
            n_dims = self.read(self.u32, f"tensor {name}'s dimension count")
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name} claims {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}")
            at = self.take(8 * n_dims, f"tensor {name}'s dims")
            dims = struct.unpack_from(f"{self.order}{n_dims}Q", self.buf, at)
            raw_type = self.read(self.u32, f"tensor {name}'s type")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
            except ValueError:
                raise self.fail(f"tensor {name}: type {raw_type} is not a valid GGMLQuantizationType") from None
            if dims and dims[0] % block:
                raise self.fail(f"tensor {name} has {dims[0]} columns, not a multiple of its type's block of {block}")
            offset = self.read(self.u64, f"tensor {name}'s offset")
            tensors.append((name, offset, math.prod(dims) // block * type_size))
        data_start = -(-self.pos // alignment) * alignment
        for name, offset, n_bytes in tensors:
            end = data_start + offset + n_bytes
            if end > self.size:
                raise GGUFError(f"{self.path}: truncated: tensor {name} needs bytes up to {end}, file has {self.size} "
                                "(a cut-short download or copy, or a damaged offset, shape or type): download or "
                                "convert it again")


def check_header(path: str) -> None:
    """Refuse, with a GGUFError naming the item, a file that is not GGUF or whose header claims counts, lengths,
    dimensions or tensor data that do not fit in it (see _HeaderScan)."""
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _HeaderScan(path, buf).scan()


def open_reader(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file read-only, its header walked first (check_header) so that gguf-py never reads a count or
    length the file cannot hold; any failure becomes a GGUFError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        check_header(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read the file ({e.strerror or e}): check its permissions") from None
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on damaged headers
        raise GGUFError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from e


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field as str / int / float / bool / list of those."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except UnicodeDecodeError as e:   # gguf-py decodes string values only here
            path = getattr(reader.data, "filename", "<gguf>")
            raise GGUFError(f"{path}: metadata key {key} holds a string that is not UTF-8 ({e.reason}); "
                            f"{_FIX}") from None
    return out
