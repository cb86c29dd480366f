"""kernels/int4_mma.py (mma.sync W4A16 kernel for small batches) against x @ unpack_ref(w)^T (exact weights).

CPU: tests/cuda_emu.py runs the source with g++ (mma.sync emulated with PTX's fragment layout): every format,
rows past the 16-row tile and past the block, partial groups per warp, split-K, batch tiles of 1/2/4/8 and
several tiles, fp16 x, bf16 output = the fp32 result rounded once, and rows bitwise independent of M. The launch
rule: a split never holds more than GMAX groups, and nothing but (N, K, fmt) sets it.
GPU (`gpu` marker): the same on the tensor cores for odd and issue shapes, B = 1..256, batch invariance, CUDA
graph capture with out= (nothing allocated), and the dispatch's cuda_mma variant (Q8_0 falls back).
The folded form (fold=True) the same ways against x @ unpack_folded(w)^T, Q8_0 included, and its launch shapes
bit-neutral.
"""
from __future__ import annotations

import functools

import pytest
import torch

from onepass.kernels.quant_pack import unpack_folded, unpack_ref
from onepass.kernels import int4_mma, nvrtc
from tests import cuda_emu
from tests.test_nvrtc import (ISSUE, emulated_matches_ref, gpu_matches_ref, gpu_rows_independent_of_m,
                              gpu_strided_and_graph_capture)
from tests.test_int4_gemm import _weight, _x  # noqa: F401  (also sets the interpreter flag)

ON_GPU = torch.cuda.is_available()
needs_mma = pytest.mark.skipif(ON_GPU and not int4_mma.available(), reason="no NVRTC binding or no sm_80+ device")
MMA_FMTS = list(int4_mma.FORMATS)
FOLD_FMTS = list(int4_mma.FOLD_FORMATS)


# (N, K, fmt, Ms, config): N = 40 / 33 / 72 leave rows past a 16-row tile and past the block; the configs give
# one and several phases (P), ring depths U that do and do not divide a warp's groups, and explicit splits
EMU = [(40, 256, "q4_0", (1, 3, 9), {"RT": 1, "P": 2, "U": 2}),
       (72, 1024, "q4_1", (2, 8, 17, 40), {"RT": 2, "P": 2, "U": 3, "RT16": 1, "U16": 2, "SPLIT_K": 3}),
       (33, 768, "q4_k", (5, 12), {"RT": 1, "P": 3, "U": 4}),
       (40, 1024, "q4_0", (4, 16), {"RT": 2, "P": 1, "U": 2, "SPLIT_K": 1}),     # one split of GMAX groups
       (64, 1280, "q4_k", (1, 8, 20), None),
       (48, 768, "q4_0", (2, 6), {"RT": 1, "P": 2, "U": 2}),                       # N % 16 == 0: row b at + 8 rows
       (32, 512, "q4_1", (3,), {"RT": 2, "P": 1, "U": 3})]


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", [EMU[0], EMU[1], EMU[3], EMU[5]] + cuda_emu.wider(EMU[2], EMU[4], EMU[6]),
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_source_emulated_matches_ref(seed, case):
    emulated_matches_ref(cuda_emu.w4a16_mma_emulated, int4_mma.mma_config, seed, *case)


def test_emulated_cases_cover_the_launch_shapes():
    cfgs = [int4_mma.mma_config(m, *c[:3], c[4]) for c in EMU for m in c[3]]
    assert any(c["SPLIT_K"] > 1 for c in cfgs) and any(c["SPLIT_K"] == 1 for c in cfgs)
    assert {c["BT"] for c in cfgs} >= {1, 2, 4, 8, 16, 32} and any(c["n_bt"] > 1 for c in cfgs)
    assert {c["P"] for c in cfgs} >= {1, 2, 3}
    assert any(c["groups_per_split"] % (c["P"] * c["U"]) for c in cfgs)      # a partial round of the ring


def test_split_rule_is_shape_only_and_bounded():
    for N, K in [(5120, 17408), (17408, 5120), (5120, 12288), (4096, 4096), (2048, 8192), (40, 2560)]:
        G = K // 32
        c1 = int4_mma.mma_config(1, N, K, "q4_0")
        assert c1["groups_per_split"] <= int4_mma.GMAX and c1["SPLIT_K"] * c1["groups_per_split"] >= G
        assert (c1["SPLIT_K"] - 1) * c1["groups_per_split"] < G                  # no empty split
        for M in (2, 8, 9, 200):
            c = int4_mma.mma_config(M, N, K, "q4_0")
            assert (c["SPLIT_K"], c["groups_per_split"]) == (c1["SPLIT_K"], c1["groups_per_split"])
    assert int4_mma.mma_config(1, 40, 2560, "q4_0", {"SPLIT_K": 1})["SPLIT_K"] == -(-80 // int4_mma.GMAX)  # GMAX wins
    # 16-sequence tiles where the block's shared memory holds them, else tiles of 8 (same bits)
    assert int4_mma.mma_config(16, 5120, 4096, "q4_k", {"RT": 4, "P": 1})["BT"] == 16
    assert int4_mma.mma_config(32, 5120, 4096, "q4_k", {"RT": 8, "P": 2})["BT"] == 16    # 32 would not fit
    assert (int4_mma.mma_config(32, 5120, 4096, "q4_0")["BT"] == 32
            and int4_mma.mma_config(33, 5120, 4096, "q4_0")["n_bt"] == 2)
    # tiles of 16+ sequences take RT16 / U16; the split (the bits) stays the shape's
    small, big = (int4_mma.mma_config(m, 5120, 4096, "q4_0", {"RT": 2, "U": 6, "RT16": 8, "U16": 3}) for m in (8, 16))
    assert (small["RT"], small["U"], big["RT"], big["U"]) == (2, 6, 8, 3)
    assert (small["SPLIT_K"], small["groups_per_split"]) == (big["SPLIT_K"], big["groups_per_split"])
    for bad in ({"RT": 0}, {"RT": 16, "P": 4}, {"U": 17}, {"RT16": 0}, {"SPLIT_K": 2, "TARGET_BLOCKS": 8}, {"KW": 4}):
        with pytest.raises(ValueError):
            int4_mma.mma_config(1, 64, 1024, "q4_0", bad)


def test_q8_0_is_refused_by_the_exact_form_only():
    """Q8_0 runs the folded form (its bytes made weights like the nibbles), not the exact one; the dispatch sends
    the exact variant of a Q8_0 weight to Triton and keeps the folded ones."""
    from onepass.kernels import int4_dispatch

    pw, _ = _weight("q8_0", 16, 64, 0, device="cpu")
    with pytest.raises(ValueError, match="q8_0"):
        int4_mma.w4a16_mma(torch.zeros(1, 64, dtype=torch.bfloat16), pw)
    assert not int4_mma.supports("q8_0") and int4_mma.supports("q4_k")
    assert int4_mma.supports("q8_0", fold=True) and int4_mma.supports("q4_k", fold=True)
    if ON_GPU and int4_mma.available():
        x = torch.zeros(1, 64, device="cuda")
        assert int4_dispatch.runnable("cuda_mma", x, "q8_0") == "triton"
        assert int4_dispatch.runnable("cuda_mma_fold", x, "q8_0") == "cuda_mma_fold"


# --------------------------------------------------------------------------------------------------
# GPU

ODD = [(40, 256, "q4_0"), (72, 1024, "q4_1"), (33, 768, "q4_k"), (1000, 1088, "q4_0"), (95, 1280, "q4_k"),
       (130, 96, "q4_1")]


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", ODD + [(n, k, f) for n, k in ISSUE for f in MMA_FMTS],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_matches_ref(seed, case):
    gpu_matches_ref(int4_mma.w4a16_mma, lambda M, N, K, fmt: int4_mma.mma_config(M, N, K, fmt), "cuda_mma", seed, *case)


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", [(72, 1024, "q4_1"), (4096, 4096, "q4_0"), (2048, 8192, "q4_k")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_batch_invariant_fp32(seed, case):
    """Rows are bitwise equal whatever M (tiles of 1..16 sequences, several tiles), fp32 out."""
    gpu_rows_independent_of_m(int4_mma.w4a16_mma, seed, *case)


@pytest.mark.gpu
@needs_mma
def test_mma_strided_and_graph_capture(seed):
    assert int4_mma.mma_config(8, 2048, 8192, "q4_0")["SPLIT_K"] > 1    # the workspace and the reduce kernel
    gpu_strided_and_graph_capture(int4_mma.w4a16_mma, seed, 2048, 8192, "q4_0")


# --------------------------------------------------------------------------------------------------
# the folded form (fold=True, the dispatch's cuda_mma_fold): y = x @ unpack_folded(w, x.dtype)^T

def folded_weights(pw, dtype):
    return unpack_folded(pw, dtype)


def _fold_plan(M, N, K, fmt, config=None):
    return int4_mma.mma_config(M, N, K, fmt, config, fold=True)


def test_unpack_folded_is_the_rounded_weight():
    """Scale and offset rounded to the dtype first, then one rounding of q * s + c: three roundings of half an ulp,
    of |q * s|, |c| (both at most ~2x the group's largest |w|: a group holds q = 0) and |w|; Q4_0 with bf16-exact
    scales is the rounded exact weight."""
    for fmt in FOLD_FMTS:
        pw, _ = _weight(fmt, 48, 512, 3, device="cpu")
        exact = unpack_ref(pw)
        for dtype, eps in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
            w = unpack_folded(pw, dtype)
            assert torch.equal(w, w.to(dtype).float()), f"{fmt} {dtype}: not values of the dtype"
            gmax = exact.view(48, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(48, 512)
            bound = eps / 2 * (exact.abs() + 4 * gmax) * 1.01
            assert ((w - exact).abs() <= bound).all(), f"{fmt} {dtype}: max err {(w - exact).abs().max()}"
    pw, _ = _weight("q4_0", 16, 64, 1, device="cpu")
    pw.scales.copy_(pw.scales.float().bfloat16().half())              # scales exact in bf16
    assert torch.equal(unpack_folded(pw, torch.bfloat16), unpack_ref(pw).bfloat16().float())
    pw, _ = _weight("q8_0", 16, 64, 2, device="cpu")                  # q * d rounded once, d rounded first
    d = pw.scales.t().float().bfloat16().float().repeat_interleave(32, dim=1)
    q = pw.qweight.permute(1, 0, 2).contiguous().view(torch.int8).reshape(16, 64).float()
    assert torch.equal(unpack_folded(pw, torch.bfloat16), (q * d).bfloat16().float())


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", [EMU[0], EMU[1], *cuda_emu.wider(EMU[2], EMU[4]),
                                  (40, 1088, "q4_0", (3, 17), {"RT": 2, "P": 2, "U": 1, "SPLIT_K": 2}),
                                  (24, 160, "q4_1", (2, 9), {"RT": 1, "P": 1, "U": 3}),
                                  (40, 512, "q4_k", (3, 20), {"RT16": 32, "U16": 1, "MINB16": 1}),    # 1024 threads
                                  (40, 1088, "q4_1", (3, 20), {"MT": 2, "RT": 1, "P": 2, "U": 1, "MT16": 2,
                                                               "RT16": 2, "U16": 2}),   # 2 row tiles, past N
                                  (72, 768, "q4_k", (5, 32), {"MT": 4, "RT": 2, "MT16": 4, "RT16": 1}),
                                  (40, 1088, "q8_0", (3, 17), {"RT": 2, "P": 2, "U": 1, "SPLIT_K": 2}),
                                  (33, 160, "q8_0", (2, 9), {"RT": 1, "P": 1, "U": 3}),   # rows past N, N % 16
                                  (48, 768, "q8_0", (5, 32), {"MT": 2, "RT": 1, "MT16": 2, "RT16": 1, "U16": 2})],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_fold_source_emulated_matches_folded_ref(seed, case):
    """The folded form on the CPU: against x @ unpack_folded(w)^T (bf16 and fp16 x), rows independent of M; quads
    whole and partial (K = 1088: 34 groups, K = 160: 5), phases, splits of whole quads; Q8_0's 32-byte records
    (every byte value, the sign bit included: _weight's random bytes)."""
    emulated_matches_ref(functools.partial(cuda_emu.w4a16_mma_emulated, fold=True), _fold_plan, seed, *case,
                         weights=folded_weights)


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", [(40, 1088, "q4_0", {"RT": 1, "P": 2, "U": 1, "RT16": 2, "U16": 1, "SPLIT_K": 2}),
                                  (72, 768, "q4_k", {"RT": 2, "P": 1, "U": 2, "RT16": 1, "U16": 2, "SPLIT_K": 1})],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_fold_row_tiles_per_warp_are_bit_neutral(seed, case):
    """MT / MT16 (row tiles per warp sharing each x fragment) change who computes a row, never its sum: the same
    bits as one tile per warp, for tiles of up to 8 sequences and of 16+ (split named, so the same split)."""
    N, K, fmt, cfg = case
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    x = _x(seed, 20, K, xs, device="cpu")
    for M in (3, 20):
        one = cuda_emu.w4a16_mma_emulated(x[:M], pw, out32=True, config=cfg, fold=True)
        for mt in (2, 4):
            many = cuda_emu.w4a16_mma_emulated(x[:M], pw, out32=True, config={**cfg, "MT": mt, "MT16": mt}, fold=True,
                                               seed=seed)
            assert torch.equal(one, many), f"{fmt} {N}x{K} M={M}: MT={mt} changed the bits"
    with pytest.raises(ValueError, match="MT"):
        int4_mma.mma_config(4, N, K, fmt, {"MT": 2})          # the exact form has one tile per warp
    with pytest.raises(ValueError, match="MT"):
        int4_mma.mma_config(4, N, K, fmt, {"MT": 3}, fold=True)


def test_fold_launch_shapes(monkeypatch):
    """The folded form takes FOLD_TILES / MEASURED_FOLD; its splits hold whole quads (4 groups), at most GMAX groups,
    from (N, K, fmt) alone, so the same at every M."""
    for N, K, fmt in [(34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (5120, 12288, "q4_0"), (40, 1088, "q4_0")]:
        exact, fold = int4_mma.mma_config(32, N, K, fmt), _fold_plan(32, N, K, fmt)
        want = {**int4_mma.FOLD_TILES[fmt], **int4_mma.MEASURED_FOLD.get((N, K, fmt), {})}
        if fold["BT"] >= 16:
            assert (fold["RT"], fold["U"], fold["MINB"]) == (want["RT16"], want["U16"], want["MINB16"])
        assert _fold_plan(8, N, K, fmt)["U"] == want["U"]
        G, gps = K // 32, fold["groups_per_split"]
        assert gps % 4 == 0 and gps <= int4_mma.GMAX and (fold["SPLIT_K"] - 1) * gps < G <= fold["SPLIT_K"] * gps
        seen = []                                                      # the reserved workspace holds either form's
        monkeypatch.setattr(nvrtc, "reserve_splits", lambda dev, shp, rows, plan: seen.append(
            max(plan(rows, *s)["workspace_floats"] for s in shp)))
        int4_mma.reserve_workspace("cpu", [(N, K, fmt)], 32)
        assert seen == [max(fold["workspace_floats"], exact["workspace_floats"])]
        assert all((_fold_plan(m, N, K, fmt)["SPLIT_K"], _fold_plan(m, N, K, fmt)["groups_per_split"])
                   == (fold["SPLIT_K"], gps) for m in (1, 9, 200))
        assert fold["smem"] < exact["smem"] or fmt == "q4_0"                                  # no group sums of x


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", ODD[:4] + [(34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (5120, 17408, "q4_0"),
                                            (40, 256, "q8_0"), (1000, 1088, "q8_0"), (5120, 17408, "q8_0"),
                                            (2048, 8192, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_fold_matches_folded_ref(seed, case):
    gpu_matches_ref(functools.partial(int4_mma.w4a16_mma, fold=True), _fold_plan, "cuda_mma_fold", seed, *case,
                    weights=folded_weights)


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", [(72, 1024, "q4_1"), (2048, 8192, "q4_k"), (5120, 4096, "q4_0"), (2048, 8192, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_fold_batch_invariant_fp32(seed, case):
    gpu_rows_independent_of_m(functools.partial(int4_mma.w4a16_mma, fold=True), seed, *case)


@pytest.mark.gpu
@needs_mma
def test_mma_fold_strided_and_graph_capture(seed):
    gpu_strided_and_graph_capture(functools.partial(int4_mma.w4a16_mma, fold=True), seed, 2048, 8192, "q4_k",
                                  weights=folded_weights)


# --------------------------------------------------------------------------------------------------
# the folded form's latency launch (latency=True, the dispatch's cuda_mma_fold_lat)

def _lat_plan(M, N, K, fmt, config=None):
    return int4_mma.mma_config(M, N, K, fmt, {**int4_mma.latency_config(N, K, fmt), **(config or {})}, fold=True)


def test_latency_launch_shape():
    """The fewest splits (MEASURED_LAT aside), the same at every M (so the same bits), batch tiles of at most BTMAX,
    a ring of U16 quads (all but one of K = 576's five); only the folded form has it."""
    for N, K, fmt in [(960, 576, "q4_1"), (3072, 576, "q4_1"), (576, 1536, "q4_1"), (2048, 2048, "q4_0"),
                      (5120, 17408, "q4_k"), (40, 1088, "q4_0")]:
        G = K // 32
        want_s = int4_mma.MEASURED_LAT.get((N, K, fmt), {}).get("SPLIT_K", -(-G // int4_mma.GMAX))
        plans = [_lat_plan(m, N, K, fmt) for m in (1, 8, 9, 16, 17, 32, 128, 300)]
        assert {(c["SPLIT_K"], c["groups_per_split"]) for c in plans} == {(plans[0]["SPLIT_K"],
                                                                           plans[0]["groups_per_split"])}
        assert plans[0]["SPLIT_K"] == want_s and plans[0]["groups_per_split"] <= int4_mma.GMAX
        assert max(c["BT"] for c in plans) == int4_mma.LATENCY["BTMAX"] == 16
        assert _lat_plan(128, N, K, fmt)["n_bt"] == 8
    big = _lat_plan(64, 960, 576, "q4_1")
    assert big["U"] * 4 >= big["groups_per_split"] - 4          # K = 576: 5 quads, 4 in flight from the start
    assert _lat_plan(1, 40, 1088, "q4_0")["SPLIT_K"] < _fold_plan(1, 40, 1088, "q4_0")["SPLIT_K"]
    assert int4_mma.mma_config(40, 64, 1024, "q4_0", {"BTMAX": 8})["BT"] == 8
    with pytest.raises(ValueError, match="BTMAX"):
        int4_mma.mma_config(4, 64, 1024, "q4_0", {"BTMAX": 12})
    pw, _ = _weight("q4_0", 16, 64, 0, device="cpu")
    with pytest.raises(ValueError, match="fold"):
        int4_mma.w4a16_mma(torch.zeros(1, 64, dtype=torch.bfloat16), pw, latency=True)


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", [(40, 1088, "q4_1", (3, 17, 40), None),     # 2 splits of 5 quads, 4 in flight
                                  (72, 768, "q4_k", (1, 9, 33), {"RT16": 2}),   # one split of 6 quads, rows past N
                                  (24, 160, "q4_0", (2, 20), {"U": 1, "U16": 1}),
                                  (40, 1088, "q8_0", (3, 17), None)],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_latency_source_emulated_matches_folded_ref(seed, case):
    """The latency launch on the CPU: against x @ unpack_folded(w)^T, rows bitwise independent of M (batch tiles
    of 16: one, two and three tiles)."""
    N, K, fmt, Ms, cfg = case
    emulated_matches_ref(
        lambda x, pw, out32=False, config=None: cuda_emu.w4a16_mma_emulated(
            x, pw, out32=out32, config={**int4_mma.latency_config(N, K, fmt), **(config or {})}, fold=True),
        _lat_plan, seed, N, K, fmt, Ms, cfg, weights=folded_weights)


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", ODD[:4] + [(960, 576, "q4_1"), (576, 1536, "q4_1"), (2048, 2048, "q4_0"),
                                            (3072, 576, "q4_1"), (5120, 4096, "q4_k"), (3072, 2048, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_fold_latency_matches_folded_ref(seed, case):
    gpu_matches_ref(functools.partial(int4_mma.w4a16_mma, fold=True, latency=True), _lat_plan, "cuda_mma_fold_lat",
                    seed, *case, weights=folded_weights)


@pytest.mark.gpu
@needs_mma
@pytest.mark.parametrize("case", [(72, 1024, "q4_1"), (960, 576, "q4_1"), (2048, 2048, "q4_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_mma_fold_latency_batch_invariant_fp32(seed, case):
    gpu_rows_independent_of_m(functools.partial(int4_mma.w4a16_mma, fold=True, latency=True), seed, *case)


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("fold", [False, True])
def test_block_order_does_not_matter(seed, fold):
    """Blocks share nothing but the read-only inputs: any order of the grid gives the same bits (split-K, phases,
    several batch tiles)."""
    pw, xs = _weight("q4_1", 72, 1024, seed % 1000, device="cpu")
    x = _x(seed, 19, 1024, xs, device="cpu")
    cfg = {"RT": 2, "P": 2, "U": 2, "RT16": 1, "U16": 2, "SPLIT_K": 3}
    ys = [cuda_emu.w4a16_mma_emulated(x, pw, out32=True, config=cfg, fold=fold, seed=s) for s in (0, 1, 2)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
