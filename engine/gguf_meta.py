"""GGUF key/value metadata as plain Python values (no tensors are touched here)."""
from __future__ import annotations

import os
from typing import Any

import gguf


def open_reader(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file read-only; any parse failure becomes a GGUFError naming the file."""
    from onepass.kernels.errors import GGUFError

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
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
        out[key] = field.contents()
    return out
