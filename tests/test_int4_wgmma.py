"""kernels/int4_wgmma.py: the large-batch W4A16 kernel on sm_90's wgmma. On the CPU its source runs under
tests/cuda_emu.py (wgmma emulated as PTX defines its operands); on an H200 the compiled kernel against the folded
reference, rows independent of M, graph capture."""
from __future__ import annotations

import functools

import pytest
import torch

from onepass.kernels import int4_wgmma
from tests import cuda_emu
from tests.test_nvrtc import (emulated_matches_ref, gpu_matches_ref, gpu_rows_independent_of_m,
                              gpu_strided_and_graph_capture)
from tests.test_int4_gemm import _weight, _x  # noqa: F401  (also sets the interpreter flag)
from tests.test_int4_mma import folded_weights

ON_GPU = torch.cuda.is_available()
needs_wg = pytest.mark.skipif(ON_GPU and not int4_wgmma.available(), reason="no sm_90 device or no torch NVRTC binding")
needs_emu = pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")


def _plan(M, N, K, fmt, config=None):
    return int4_wgmma.wg_config(M, N, K, fmt, config)


# (N, K, fmt, Ms, config): rows past N, partial quads (K = 1088: 34 groups; K = 160: 5), splits, two warpgroups
# and two m64 tiles, batch tiles of 8..32 (rows past M), x staged without and with the 128-byte swizzle; stream-K
# (more row tiles than TARGET_BLOCKS): 5 tiles of 9 quads on 3 blocks (tile heads and tails, the partial quad in a
# tail, rows past N in a shared tile), 5 tiles of 128 rows and 6 quads; 3 tiles of two m64 halved into 5 of one
EMU = [(300, 1088, "q4_1", (2, 19), {"WGS": 1, "MT": 1, "STAGES": 3, "TARGET_BLOCKS": 3}),
       (520, 768, "q4_k", (5,), {"WGS": 2, "MT": 1, "TARGET_BLOCKS": 3}),
       (300, 1088, "q4_1", (4,), {"WGS": 1, "MT": 2, "TARGET_BLOCKS": 3, "SK_HALVE": 1}),
       (72, 1088, "q4_1", (3, 20), {"WGS": 1, "MT": 1, "STAGES": 3, "SPLIT_K": 2, "SWZ": 0}),
       (136, 768, "q4_k", (1, 9, 32), {"WGS": 2, "MT": 1, "U": 2, "STAGES": 4}),
       (40, 160, "q4_0", (5, 16), {"WGS": 1, "MT": 2, "STAGES": 5}),
       (200, 1024, "q4_k", (3, 17), {"WGS": 2, "MT": 2, "U": 1, "STAGES": 3, "SPLIT_K": 3}),
       (300, 1088, "q8_0", (2, 19), {"WGS": 1, "MT": 1, "STAGES": 3, "TARGET_BLOCKS": 3}),      # Q8_0: stream-K
       (136, 768, "q8_0", (1, 9, 32), {"WGS": 2, "MT": 2, "U": 2, "STAGES": 4, "SPLIT_K": 2})]


@needs_emu
@pytest.mark.parametrize("case", EMU, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]['WGS']}x{c[4]['MT']}")
def test_wgmma_source_emulated_matches_folded_ref(seed, case):
    """Staging ring, in-place reorder, descriptors, A fragments and the epilogue on the exact source text: against
    x @ unpack_folded(w)^T (bf16 and fp16 x), rows bitwise independent of M, bf16 out the fp32 result rounded once."""
    emulated_matches_ref(cuda_emu.w4a16_wgmma_emulated, _plan, seed, *case, weights=folded_weights)


@needs_emu
def test_wgmma_stream_k_over_batch_tiles_emulated(seed):
    """Stream-K with two batch tiles (M = 130: the flags are per batch tile and row tile): rows equal the same rows
    computed alone, and the fp32 result the folded reference."""
    pw, xs = _weight("q4_0", 200, 640, seed % 1000, device="cpu")
    x = _x(seed, 130, 640, xs, device="cpu")
    config = {"WGS": 1, "MT": 1, "STAGES": 3, "TARGET_BLOCKS": 3}    # 4 tiles of 5 quads: two shared
    assert _plan(130, 200, 640, "q4_0", config)["n_bt"] == 2 and _plan(130, 200, 640, "q4_0", config)["workers"] == 3
    y = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=config, seed=seed)
    ref = x.float() @ folded_weights(pw, x.dtype).T
    assert (y - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
    for lo, M in ((128, 2), (0, 3)):
        part = cuda_emu.w4a16_wgmma_emulated(x[lo:lo + M], pw, out32=True, config=config, seed=seed + 1)
        assert torch.equal(part, y[lo:lo + M]), f"rows {lo}..{lo + M} depend on M"


@needs_emu
def test_wgmma_launch_shape_is_bit_neutral(seed):
    """WGS, MT, U, STAGES and the staging's swizzle move rows between warps and change the pipeline, never a row's
    sum (same split); the block order does not matter either."""
    pw, xs = _weight("q4_k", 136, 1024, seed % 1000, device="cpu")
    x = _x(seed, 12, 1024, xs, device="cpu")
    base = {"WGS": 1, "MT": 1, "U": 1, "STAGES": 3, "SPLIT_K": 2}
    want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=base)
    for cfg in ({"WGS": 2, "MT": 2, "U": 2, "STAGES": 4}, {"WGS": 1, "MT": 2, "U": 3, "STAGES": 6, "SWZ": 0}):
        got = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config={**base, **cfg}, seed=seed + 1)
        assert torch.equal(got, want), f"{cfg} changed the bits"


def test_wgmma_launch_rules():
    """The split comes from (N, K, fmt) and the per-shape config alone (whole quads, >= 4 per split unless named, at
    most one wave of blocks), so it is the same at every M; BT is the wgmma's N extent; bad configs are refused."""
    for N, K, fmt in [(34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (5120, 6144, "q4_k"), (2048, 8192, "q4_0")]:
        c = _plan(128, N, K, fmt)
        G, gps, S = K // 32, c["groups_per_split"], c["SPLIT_K"]
        assert gps % 4 == 0 and (S - 1) * gps < G <= S * gps
        assert S == 1 or gps >= 4 * int4_wgmma.MIN_QUADS_PER_SPLIT
        assert S == 1 or c["n_nt"] * S <= int4_wgmma.DEFAULTS["TARGET_BLOCKS"]      # one wave of blocks
        assert all((_plan(m, N, K, fmt)["SPLIT_K"], _plan(m, N, K, fmt)["groups_per_split"]) == (S, gps)
                   for m in (1, 9, 64, 300))
    assert [_plan(m, 4096, 4096, "q4_0")["BT"] for m in (1, 8, 9, 33, 64, 65, 128, 300)] == [8, 8, 16, 64, 64, 128,
                                                                                                128, 128]
    assert _plan(300, 4096, 4096, "q4_0")["n_bt"] == 3
    assert _plan(128, 4096, 4096, "q4_0")["smem"] == int4_wgmma.DEFAULTS["STAGES"] * 128 * 256
    sk = _plan(128, 34816, 5120, "q4_k")            # 136 row tiles of 256 on 132 SMs: stream-K, one wave
    assert (sk["workers"], sk["grid"], sk["SPLIT_K"], sk["flag_ints"]) == (132, 132, 1, 272)
    assert sk["workspace_floats"] == 128 * 34816 and _plan(300, 34816, 5120, "q4_k")["grid"] == 3 * 132
    assert _plan(128, 34816, 5120, "q4_k", {"SK": 0})["grid"] == 136
    assert _plan(128, 16384, 5120, "q4_k")["workers"] == 0                  # 64 tiles: splits fill the wave
    x2 = _plan(32, 34816, 5120, "q4_k", int4_wgmma.X2)   # 136 tiles of 256 rows: 272 of 128, stream-K on 264
    assert (x2["MT"], x2["n_nt"], x2["workers"], x2["grid"], x2["MINB"]) == (1, 272, 264, 264, 2)
    assert [_plan(m, 5120, 17408, "q4_k", int4_wgmma.X2)["SPLIT_K"] for m in (1, 64, 128)] == [13, 13, 13]
    assert [_plan(m, 5120, 17408, "q4_k", int4_wgmma.X2)["MINB"] for m in (32, 64, 128)] == [2, 2, 1]
    assert [_plan(m, 5120, 17408, "q4_k")["MINB"] for m in (32, 64, 128)] == [2, 1, 1]
    for bad in ({"WGS": 3}, {"MT": 4}, {"STAGES": 2}, {"U": 0}, {"SWZ": 2}, {"SK": 2}, {"TARGET_BLOCKS": 0},
                {"SK_HALVE": 3}):
        with pytest.raises(ValueError, match="int4_wgmma"):
            _plan(4, 4096, 4096, "q4_k", bad)
    assert _plan(128, 5120, 17408, "q8_0")["MT"] == 1 and _plan(128, 5120, 17408, "q4_0")["MT"] == 2   # per format
    assert int4_wgmma.supports("q8_0") and not int4_wgmma.supports("q5_k")


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("case", [(40, 256, "q4_0"), (72, 1024, "q4_1"), (33, 768, "q4_k"), (1000, 1088, "q4_0"),
                                  (34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (5120, 17408, "q4_0"),
                                  (1000, 1088, "q8_0"), (5120, 17408, "q8_0"), (17408, 5120, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_wgmma_matches_folded_ref(seed, case):
    gpu_matches_ref(int4_wgmma.w4a16_wgmma, _plan, "cuda_wgmma", seed, *case, weights=folded_weights)


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("case", [(72, 1024, "q4_1"), (2048, 8192, "q4_k"), (5120, 4096, "q4_0"), (2048, 8192, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_wgmma_batch_invariant_fp32(seed, case):
    """Every batch tile (m64n8 .. m64n128) gives a row the same bits."""
    gpu_rows_independent_of_m(int4_wgmma.w4a16_wgmma, seed, *case)


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("case", [(34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (72, 1024, "q4_1"),
                                  (5120, 12288, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_wgmma_x2(seed, case):
    """The dispatch's cuda_wgmma_x2 (two blocks per SM below 128 sequences; tiles halved for stream-K on the
    34816-row shape): against the folded reference at B = 1..256, rows independent of M."""
    fn = functools.partial(int4_wgmma.w4a16_wgmma, config=int4_wgmma.X2)
    gpu_matches_ref(fn, lambda M, N, K, fmt: _plan(M, N, K, fmt, int4_wgmma.X2), "cuda_wgmma_x2", seed, *case,
                    weights=folded_weights)
    gpu_rows_independent_of_m(fn, seed, *case)


# stream-K forced on small shapes: 8 row tiles of 256 on 5 blocks, 4 tiles (the last one partial) on 3
SK_SMALL = [(2048, 5120, "q4_k", {"TARGET_BLOCKS": 5}), (1000, 1088, "q4_0", {"TARGET_BLOCKS": 3})]


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("case", SK_SMALL, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_wgmma_stream_k(seed, case):
    """Stream-K (tiles shared by two blocks, their partials met through the workspace and the flags): against the
    folded reference at B = 1..256, rows independent of M, and the same bits on every repeat (the flags are left
    zero for the next launch)."""
    N, K, fmt, config = case
    assert _plan(64, N, K, fmt, config)["workers"] == config["TARGET_BLOCKS"]
    fn = functools.partial(int4_wgmma.w4a16_wgmma, config=config)
    gpu_matches_ref(fn, lambda M, N, K, fmt: _plan(M, N, K, fmt, config), "cuda_wgmma stream-K", seed, N, K, fmt,
                    weights=folded_weights)
    gpu_rows_independent_of_m(fn, seed, N, K, fmt)
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    x = _x(seed, 77, K, xs, device="cuda")
    first = fn(x, pw)
    for _ in range(5):
        assert torch.equal(fn(x, pw), first), "stream-K result changed between launches"


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("config", [None, {"TARGET_BLOCKS": 5}], ids=["split", "stream_k"])
def test_wgmma_batch_invariant_at_large_tiles(seed, config):
    """Rows computed in tiles of 128 (M = 128, 200) equal the same rows computed alone or in tiles of 64."""
    pw, xs = _weight("q4_k", 2048, 5120, seed % 1000, device="cuda")
    x = _x(seed, 200, 5120, xs, device="cuda")
    y_all = int4_wgmma.w4a16_wgmma(x, pw, torch.empty(200, 2048, device="cuda"), config=config)
    for lo, M in ((0, 128), (100, 64), (199, 1), (64, 40)):
        y = int4_wgmma.w4a16_wgmma(x[lo:lo + M], pw, torch.empty(M, 2048, device="cuda"), config=config)
        assert torch.equal(y, y_all[lo:lo + M]), f"rows {lo}..{lo + M} depend on M"


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("shape", [(2048, 8192), (34816, 5120)], ids=["split", "stream_k"])
def test_wgmma_strided_and_graph_capture(seed, shape):
    gpu_strided_and_graph_capture(int4_wgmma.w4a16_wgmma, seed, *shape, "q4_k", weights=folded_weights)
