"""engine.quant.dequantize against gguf-py's independent numpy dequantizers.

Equality is bitwise (float32 bit patterns): both follow ggml's operation order, so no rounding slack
is needed. Quantized blocks are random bytes with their fp16 scale fields forced finite.
"""
from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from hypothesis import given, settings, strategies as st

from onepass.kernels.errors import GGUFError
from onepass.engine.quant import SUPPORTED_TYPES, dequantize

QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K]
FLOATS = [QT.F32, QT.F16, QT.BF16]
# byte offsets of the fp16 scale fields (d, and m / dmin) inside one block (ggml-common.h)
SCALE_OFFSETS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def random_raw(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random tensor bytes, shape (rows, bytes per row); float payloads and fp16 scales finite."""
    if qtype == QT.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:  # bf16 = upper half of a float32
        f32 = rng.standard_normal((rows, cols)).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(raw.shape[0]) * rng.choice([1e-4, 1e-2, 1.0, 100.0])).astype(np.float16)
        raw[:, off : off + 2] = scales.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def assert_bitwise_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(tuple(ours.shape))
    assert np.array_equal(ours.numpy().view(np.int32), ref.view(np.int32))


def test_supported_types_listed():
    assert SUPPORTED_TYPES == set(QUANTIZED + FLOATS)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_matches_gguf_py(qtype: QT, seed: int):
    rng = np.random.default_rng(seed)
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 5, max(block, 32) * (seed + 2)
    raw = random_raw(qtype, rows, cols, rng)
    ours = dequantize(torch.from_numpy(raw), qtype, (rows, cols))
    assert tuple(ours.shape) == (rows, cols)
    assert_bitwise_equal(ours, gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_single_block_property(qtype: QT, data: st.DataObject):
    """Any block bytes with any finite fp16 scales decode like gguf-py."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = bytearray(data.draw(st.binary(min_size=size, max_size=size)))
    f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
    for off in SCALE_OFFSETS[qtype]:
        raw[off : off + 2] = np.float16(data.draw(f16)).tobytes()
    arr = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(1, size)
    ours = dequantize(torch.from_numpy(arr.copy()), qtype, (block,))
    assert_bitwise_equal(ours, gguf.quants.dequantize(arr, qtype))


def test_raw_shape_is_irrelevant_and_3d_output():
    rng = np.random.default_rng(3)
    raw = random_raw(QT.Q8_0, 6, 64, rng)
    flat = dequantize(torch.from_numpy(raw.reshape(-1)), QT.Q8_0, (2, 3, 64))
    assert tuple(flat.shape) == (2, 3, 64)
    assert_bitwise_equal(flat, gguf.quants.dequantize(raw, QT.Q8_0))


def test_known_values():
    """Hand-built blocks, independent of gguf-py: Q8_0 d=0.5, Q4_0 d=2 (q-8), Q4_1 d=1 m=-3."""
    def f16(x: float) -> np.ndarray:
        return np.frombuffer(np.float16(x).tobytes(), np.uint8)

    def decode(parts: list[np.ndarray], qtype: QT) -> list[float]:
        return dequantize(torch.from_numpy(np.concatenate(parts)), qtype, (32,)).tolist()

    nib = np.arange(16, dtype=np.uint8)
    assert (decode([f16(0.5), np.arange(-16, 16, dtype=np.int8).view(np.uint8)], QT.Q8_0)
            == [0.5 * i for i in range(-16, 16)])
    low_then_high = [*range(16), *range(15, -1, -1)]  # low nibbles are elements 0-15, high nibbles 16-31
    assert decode([f16(2.0), nib | ((15 - nib) << 4)], QT.Q4_0) == [2.0 * (v - 8) for v in low_then_high]
    assert decode([f16(1.0), f16(-3.0), nib | ((15 - nib) << 4)], QT.Q4_1) == [v - 3.0 for v in low_then_high]


def test_unsupported_type_raises():
    with pytest.raises(GGUFError, match=r"Q5_0 is not supported \(supported: .*Q4_K"):
        dequantize(torch.zeros(22, dtype=torch.uint8), QT.Q5_0, (32,))


def test_wrong_byte_count_raises():
    with pytest.raises(GGUFError, match="needs 68 bytes, got 67"):
        dequantize(torch.zeros(67, dtype=torch.uint8), QT.Q8_0, (64,))
    with pytest.raises(GGUFError, match="not a multiple of the block size 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), QT.Q4_K, (128,))


def test_throughput():
    """16M elements of the slowest formats decode well under a second per type on 2 cores
    (~4-5 s per 1B parameters measured); the bound is loose to stay robust on busy machines."""
    n = 1 << 24
    for qtype in (QT.Q4_K, QT.Q6_K, QT.Q4_1):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = torch.randint(0, 256, (n // block * size,), dtype=torch.uint8)
        start = time.perf_counter()
        dequantize(raw, qtype, (n // 4096, 4096))
        assert time.perf_counter() - start < 3.0, qtype.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: QT):
    raw = torch.from_numpy(random_raw(qtype, 64, 512, np.random.default_rng(7)))
    cpu = dequantize(raw, qtype, (64, 512))
    gpu = dequantize(raw.cuda(), qtype, (64, 512))
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))
