"""Vectorized torch dequantization of GGUF tensor data (CPU or CUDA, whole tensors at once).

Block layouts follow ggml-common.h. The arithmetic order matches ggml's reference
dequantizers (and gguf-py's), so results are bit-identical to gguf.quants.dequantize.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from onepass.kernels.errors import GGUFError

SUPPORTED_TYPES: frozenset[QT] = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K}
)


def nbytes_for(qtype: QT, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (torch order) occupies in `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = math.prod(shape)
    if shape and shape[-1] % block:
        raise GGUFError(f"{qtype.name}: row length {shape[-1]} is not a multiple of the block size {block}")
    return n // block * size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian fp16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2, k): low nibbles first, then high nibbles (ggml's packing order)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int16) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).reshape(-1, 32).float()
    return d * q + m


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Shared tail of Q4_K / Q5_K: y = (d*sc)*q - (dmin*m) per 32-element sub-block."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # 4 chunks of 32 bytes; chunk i holds sub-block 2i (low nibbles) and 2i+1 (high nibbles)
    q = _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_affine(b, q)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    qh = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # bit j of qh[l] is the 5th bit of sub-block j
    return _k_affine(b, ql | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).to(torch.int16) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)  # (n, 16, 1)
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


_BLOCK_FNS: dict[QT, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1,
    QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
}
_FLOAT_DTYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


def dequantize(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a tensor's raw GGUF bytes (uint8, any shape) into float32 of `shape` (torch order)."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(f"tensor type {qtype.name} is not supported (supported: {names})")
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must be uint8 bytes, got {raw.dtype}")
    shape = tuple(int(d) for d in shape)
    want = nbytes_for(qtype, shape)
    flat = raw.contiguous().reshape(-1)
    if flat.numel() != want:
        raise GGUFError(f"{qtype.name} tensor of shape {shape} needs {want} bytes, got {flat.numel()}")
    if qtype in _FLOAT_DTYPES:
        return flat.view(_FLOAT_DTYPES[qtype]).float().reshape(shape)
    _, type_size = GGML_QUANT_SIZES[qtype]
    return _BLOCK_FNS[qtype](flat.view(-1, type_size)).reshape(shape)
