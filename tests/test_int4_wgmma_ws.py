"""kernels/int4_wgmma_ws.py: the wgmma W4A16 kernel fed by a producer warpgroup. On the CPU its two launches (x
staged into the ring's image, then the GEMM) run under tests/cuda_emu.py, mbarriers and bulk copies emulated, and
must give int4_wgmma's emulated bits for the same split; on an H200 the compiled kernel against the folded
reference, bitwise against int4_wgmma, rows independent of M, graph capture."""
from __future__ import annotations

import functools

import pytest
import torch

from onepass.kernels import int4_wgmma, int4_wgmma_ws as ws, pdl
from tests import cuda_emu
from tests.test_nvrtc import (emulated_matches_ref, gpu_matches_ref, gpu_rows_independent_of_m,
                              gpu_strided_and_graph_capture)
from tests.test_int4_gemm import _weight, _x  # noqa: F401  (also sets the interpreter flag)
from tests.test_int4_mma import folded_weights

ON_GPU = torch.cuda.is_available()
needs_wg = pytest.mark.skipif(ON_GPU and not ws.available(), reason="no sm_90 device or no torch NVRTC binding")
needs_emu = pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")


def _plan(M, N, K, fmt, config=None):
    return ws.ws_config(M, N, K, fmt, config)


# (N, K, fmt, Ms, config): a ring of two stages reused many times (K = 1088: 9 quads, the last partial); the whole
# K loop inside the ring (its x copied after the loop); splits; rows past N in the last tile (264 = 256 + 8);
# stream-K (4 tiles of 256 on 3 blocks: tile heads and tails, a partial quad in a tail); tiles halved for it
# (SK_HALVE: 4 tiles of 256 are 7 of 128 on 5 blocks); four consumer warpgroups of one m64 tile (CWG 4) with a
# ring of two, with stream-K; batch tiles of 8..32, rows past M
EMU = [(264, 1088, "q4_0", (3, 11), {"STAGES": 2}),
       (264, 1088, "q4_0", (11,), {"STAGES": 2, "CWG": 4}),
       (776, 1280, "q4_k", (20,), {"STAGES": 3, "TARGET_BLOCKS": 3, "SK_HALVE": 0, "CWG": 4}),
       (264, 768, "q4_k", (9,), {}),
       (264, 1024, "q4_1", (5, 17), {"STAGES": 3, "SPLIT_K": 2}),
       (776, 1280, "q4_k", (2, 20), {"STAGES": 3, "TARGET_BLOCKS": 3, "SK_HALVE": 0}),
       (776, 1088, "q4_1", (4,), {"STAGES": 4, "TARGET_BLOCKS": 5}),
       (264, 1024, "q4_k", (6,), {**ws.T128, "STAGES": 3, "SPLIT_K": 2}),
       (264, 1088, "q8_0", (3, 11), {"STAGES": 2}),                                         # Q8_0: 32-byte records
       (776, 1280, "q8_0", (20,), {"STAGES": 3, "TARGET_BLOCKS": 3, "SK_HALVE": 0, "CWG": 4})]


@needs_emu
@pytest.mark.parametrize("case", [EMU[0], EMU[2], EMU[4], EMU[7], EMU[8]]
                         + cuda_emu.wider(EMU[1], EMU[3], EMU[5], EMU[6], EMU[9]),
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]}")
def test_ws_source_emulated_matches_wgmma_and_ref(seed, case):
    """The exact source text: against x @ unpack_folded(w)^T (bf16 and fp16 x), rows bitwise independent of M, bf16
    out the fp32 result rounded once; and bitwise int4_wgmma's emulated kernel with the same split and tiles."""
    N, K, fmt, Ms, config = case
    pw, x, y = emulated_matches_ref(functools.partial(cuda_emu.w4a16_wgmma_ws_emulated, seed=seed), _plan, seed,
                                    *case, weights=folded_weights)
    want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=ws.wg_equivalent(config), seed=seed + 1)
    assert torch.equal(y, want), f"{config}: not int4_wgmma's bits"


@needs_emu
@pytest.mark.parametrize("form", [("FRESH_MIN_BT",), ("STEP_GROUPS_MIN_BT",), ("FRESH_MIN_BT", "STEP_GROUPS_MIN_BT")])
@pytest.mark.parametrize("case", [EMU[1], EMU[2]] + cuda_emu.wider(EMU[4], EMU[5]),
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]}")
def test_ws_fresh_write_and_step_groups_emulated_match_wgmma(seed, case, form, monkeypatch):
    """Every batch tile in the form that lets a segment's first quad write the accumulators (wgmma scale-d 0, no
    zeroing in the K loop; FRESH_MIN_BT lowered to 1), in the form that commits each k16 step's wgmmas as a group of
    their own (STEP_GROUPS_MIN_BT lowered to 1), and in both: int4_wgmma's bits still, over splits, stream-K segments
    and four consumer warpgroups."""
    for attr in form:
        monkeypatch.setattr(ws, attr, 1)
    N, K, fmt, Ms, config = case
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    x = _x(seed, Ms[-1], K, xs, device="cpu")
    cfg = _plan(Ms[-1], N, K, fmt, config)
    src = ws.source(fmt, cfg["BT"], False, True, cfg["STAGES"], 1, cfg["workers"] > 0, cfg["WG_MT"], cfg["CWG"])
    assert ("#define FRESH_WRITE 1" in src) == ("FRESH_MIN_BT" in form)
    assert ("#define WG_STEP_GROUPS 1" in src) == ("STEP_GROUPS_MIN_BT" in form)
    y = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, out32=True, config=config, seed=seed)
    want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=ws.wg_equivalent(config), seed=seed + 1)
    assert torch.equal(y, want), f"{config}: not int4_wgmma's bits"


@needs_emu
@pytest.mark.parametrize("case", [EMU[0], EMU[1], EMU[2], EMU[4], EMU[8]], ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]}")
def test_ws_x_in_gemm_emulated_matches_wgmma(seed, case, monkeypatch):
    """X_IN_GEMM (the producer warpgroup's warps 1-3 stage x into each stage themselves, one launch): int4_wgmma's
    bits still, with rings reused many times, stream-K, four consumer warpgroups and rows past M."""
    monkeypatch.setattr(ws, "X_IN_GEMM", True)
    N, K, fmt, Ms, config = case
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    for M in Ms:
        x = _x(seed + M, M, K, xs, device="cpu")
        cfg = _plan(M, N, K, fmt, config)
        assert cfg["x_in_gemm"] and cfg["x_staged"] == 0
        y = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, out32=True, config=config, seed=seed)
        want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=ws.wg_equivalent(config), seed=seed + 1)
        assert torch.equal(y, want), f"{config} M={M}: not int4_wgmma's bits"


@needs_emu
@pytest.mark.parametrize("x_in_gemm", [False, True], ids=["staged", "x_in_gemm"])
@pytest.mark.parametrize("case", [EMU[0], EMU[2], EMU[8]] + cuda_emu.wider(EMU[4], EMU[6], EMU[7], EMU[9]),
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]}")
def test_ws_mma_consumers_emulated_match_wgmma(seed, case, x_in_gemm, monkeypatch):
    """MMA 1 (the consumers on mma.sync, x's B fragments read by ldmatrix from the same stage image): int4_wgmma's
    bits for the same split, over rings reused many times, stream-K, four consumer warpgroups, Q4_1 / Q4_K, tiles of
    128 rows and rows past M, with x staged by its own launch or inside the GEMM."""
    monkeypatch.setattr(ws, "X_IN_GEMM", x_in_gemm)
    N, K, fmt, Ms, config = case
    config = {**config, "MMA": 1}
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    for M in Ms:
        x = _x(seed + M, M, K, xs, device="cpu")
        cfg = _plan(M, N, K, fmt, config)
        assert cfg["MMA"] == 1 and cfg["x_in_gemm"] == (x_in_gemm or cfg["BT"] <= ws.X_IN_GEMM_MAX_BT)
        y = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, out32=True, config=config, seed=seed)
        want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=ws.wg_equivalent(config), seed=seed + 1)
        assert torch.equal(y, want), f"{config} M={M}: not int4_wgmma's bits"


@needs_emu
def test_ws_two_batch_tiles_emulated(seed):
    """M = 130: two batch tiles, each staged and streamed from its own part of the staged image; stream-K flags per
    (batch tile, row tile)."""
    pw, xs = _weight("q4_0", 264, 640, seed % 1000, device="cpu")
    x = _x(seed, 130, 640, xs, device="cpu")
    config = {"STAGES": 3, "TARGET_BLOCKS": 2, "SK_HALVE": 1}      # 3 tiles of 128 rows on two blocks per batch tile
    c = _plan(130, 264, 640, "q4_0", config)
    assert (c["n_bt"], c["workers"], c["MT"]) == (2, 2, 1)
    y = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, out32=True, config=config, seed=seed)
    ref = x.float() @ folded_weights(pw, x.dtype).T
    assert (y - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
    part = cuda_emu.w4a16_wgmma_ws_emulated(x[128:], pw, out32=True, config=config, seed=seed + 1)
    assert torch.equal(part, y[128:]), "the second batch tile's rows depend on M"


def test_ws_launch_rules():
    """The split and tiles are int4_wgmma's for wg_equivalent (the same at every M); the ring takes as many stages
    as fit (at least 4 at 128 sequences), one 384-thread block per SM; bad configs and formats are refused; a
    weight the bulk copies cannot read is not aligned."""
    for N, K, fmt in [(34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (17408, 5120, "q4_0"), (2048, 8192, "q4_0")]:
        wg = int4_wgmma.wg_config(128, N, K, fmt, ws.wg_equivalent())
        for M in (1, 33, 128, 300):
            c = _plan(M, N, K, fmt)
            w = int4_wgmma.wg_config(M, N, K, fmt, ws.wg_equivalent())
            assert {k: c[k] for k in ("SPLIT_K", "groups_per_split", "workers", "n_nt", "MT", "BT", "grid")} == \
                   {k: w[k] for k in ("SPLIT_K", "groups_per_split", "workers", "n_nt", "MT", "BT", "grid")}
            assert c["block"] == 128 * (c["CWG"] + 1) and c["smem"] <= ws.SMEM_LIMIT and c["STAGES"] >= 4
            assert c["SPLIT_K"] == wg["SPLIT_K"] and c["groups_per_split"] == wg["groups_per_split"]
    assert _plan(128, 17408, 5120, "q4_0")["MT"] == 1 and _plan(128, 17408, 5120, "q4_0")["workers"] == 132
    assert _plan(128, 17408, 5120, "q4_0", {"SK_HALVE": 0})["grid"] == 68
    assert _plan(8, 4096, 4096, "q4_0")["STAGES"] == ws.MAX_STAGES
    for M in (16, 128, 300):    # the staging launch: a thread per unit, its four 16-byte pieces, covers the image
        c = _plan(M, 4096, 4096, "q4_k")
        assert not c["x_in_gemm"] and c["stage_units"] * 64 == c["x_staged"] == c["n_bt"] * c["BT"] * 4096 * 2
    for M in (1, 5, 8):         # tiles of up to X_IN_GEMM_MAX_BT sequences: x read inside the GEMM, nothing staged
        c = _plan(M, 4096, 4096, "q4_k")
        assert c["BT"] <= ws.X_IN_GEMM_MAX_BT and c["x_in_gemm"] and c["x_staged"] == 0
    for M in (1, 8, 9, 128):    # mma.sync consumers (two warpgroups by default) in tiles of up to MMA_MAX_BT
        c = _plan(M, 5120, 17408, "q4_k")
        mma = c["BT"] <= ws.MMA_MAX_BT
        assert (c["MMA"], c["CWG"]) == ((1, ws.MMA_CWG) if mma else (0, ws.DEFAULT_CWG)), M
        assert _plan(M, 5120, 17408, "q4_k", {"MMA": 1 - mma})["MMA"] == 1 - mma
        assert _plan(M, 5120, 17408, "q4_k", {"CWG": 4})["CWG"] == 4
    c4 = _plan(128, 5120, 17408, "q4_k", {"CWG": 4})
    assert (c4["CWG"], c4["WG_MT"], c4["block"], c4["SPLIT_K"]) == (4, 1, 640,
                                                                     _plan(128, 5120, 17408, "q4_k")["SPLIT_K"])
    assert _plan(128, 17408, 5120, "q4_0", {"CWG": 4})["CWG"] == 2     # halved tiles: one m64 per warpgroup already
    # T128: 128-row tiles, twice as many, half the split
    for N, K, fmt in [(16384, 5120, "q4_k"), (2048, 8192, "q4_0"), (4096, 4096, "q4_0")]:
        c, t = _plan(128, N, K, fmt), _plan(128, N, K, fmt, ws.T128)
        assert (t["MT"], t["CWG"], t["WG_MT"], t["block"]) == (1, 2, 1, 384)
        assert t["n_nt"] == 2 * c["n_nt"] and t["SPLIT_K"] * 2 == c["SPLIT_K"] and t["grid"] == c["grid"]
    for bad in ({"STAGES": 1}, {"STAGES": 9}, {"CWG": 3}, {"MMA": 2}):
        with pytest.raises(ValueError, match="int4_wgmma_ws"):
            _plan(128, 4096, 4096, "q4_k", bad)
    assert ws.supports("q8_0") and not ws.supports("q5_k")     # Q8_0: stages of 32-byte records, 4 scale rows
    assert ws.stage_bytes(128, "q8_0") == ws.stage_bytes(128, "q4_0") + 1024 * (-(-(4 * 256 * 16) // 1024))
    assert ws.aligned(_weight("q4_0", 264, 256, 0, device="cpu")[0])
    assert not ws.aligned(_weight("q4_0", 36, 256, 0, device="cpu")[0])


def test_ws_ready_scales_rules():
    """Ready scales: Q4_K builds whose batch tiles stage x outside the GEMM carry ready scale words (4 rows of 4-byte
    words a stage instead of 6 of 2 bytes); other formats, tiles of up to X_IN_GEMM_MAX_BT, READY 0 and the switch
    off do not; the words go in before int4_mma's code; a bad READY or a ready build of another format is refused."""
    for M, N, K, config in [(32, 5120, 17408, None), (128, 16384, 5120, ws.T128), (128, 34816, 5120, {"CWG": 4})]:
        c = _plan(M, N, K, "q4_k", config)
        assert c["ready"] == 1 and not c["x_in_gemm"] and c["STAGES"] >= 4 and c["smem"] <= ws.SMEM_LIMIT
        assert c["stage_bytes"] == ws.stage_bytes(c["BT"], "q4_k", c["MT"], True)
        raw = _plan(M, N, K, "q4_k", {**(config or {}), "READY": 0})
        assert raw["ready"] == 0 and raw["stage_bytes"] == ws.stage_bytes(c["BT"], "q4_k", c["MT"])
        assert ({k: raw[k] for k in ("SPLIT_K", "grid", "BT", "MT")}
                == {k: c[k] for k in ("SPLIT_K", "grid", "BT", "MT")})
        src = ws.source("q4_k", c["BT"], False, True, c["STAGES"], 1, c["workers"] > 0, c["WG_MT"], c["CWG"],
                        c["x_in_gemm"], bool(c["MMA"]))
        assert "#define READY_SCALES 1" in src and src.index("#define READY_SCALES") < src.index("QScales quad_scales")
    assert ws.stage_bytes(128, "q4_k", 2, True) - ws.stage_bytes(128, "q4_k", 2) == 1024  # 4.1 KB against 3.1
    assert "READY" not in ws.wg_equivalent({"READY": 0})
    for fmt in ("q4_0", "q4_1", "q8_0"):
        assert _plan(32, 5120, 17408, fmt)["ready"] == 0
    assert _plan(8, 5120, 17408, "q4_k")["ready"] == 0                       # x staged in the GEMM
    with pytest.raises(ValueError, match="READY=2"):
        _plan(32, 5120, 17408, "q4_k", {"READY": 2})
    with pytest.raises(ValueError, match="ready scale words"):
        ws.source("q4_0", 32, False, True, 4, ready=True)
    with pytest.raises(ValueError, match="ready scale words"):
        ws.ready_words(_weight("q4_0", 264, 256, 0, device="cpu")[0], torch.bfloat16)
    with pdl.applied(pdl.LaunchPolicy(ready_scales=False)):    # an engine with engine.ready_scales=false
        assert _plan(32, 5120, 17408, "q4_k")["ready"] == 0
        assert "#define READY_SCALES 0" in ws.source("q4_k", 32, False, True, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ready_words_are_the_affine_scale_and_offset_rounded(seed, dtype):
    """ready_words: per (group, row) the scale d * sc (low half) and offset -(dmin * mn) (high half) of
    kernels/quant_pack.py's affine form, each rounded to x's dtype, bit for bit (the offset's -0 too); made once per
    weight and dtype."""
    from onepass.kernels.quant_pack import _affine

    pw, _ = _weight("q4_k", 264, 1024, seed % 1000, device="cpu")
    _, s, c = _affine(pw)                                       # [N, G, 1]
    words = ws.ready_words(pw, dtype)
    assert words.shape == (1024 // 32, 264) and words.dtype == torch.int32 and words.is_contiguous()
    halves = words.view(dtype).reshape(1024 // 32, 264, 2)
    for got, want in ((halves[..., 0], s), (halves[..., 1], c)):
        want = want.squeeze(-1).t().to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert ws.ready_words(pw, dtype) is words
    assert ws.ready_words(pw, torch.float16 if dtype == torch.bfloat16 else torch.bfloat16) is not words


def test_ready_words_counted_and_freed(seed, monkeypatch):
    """ready_bytes counts the words made (per device); free_ready frees them; a launch policy without ready scales
    plans the raw scales."""
    monkeypatch.setattr(ws, "_READY", type(ws._READY)())
    pw, _ = _weight("q4_k", 264, 512, seed % 1000, device="cpu")
    assert ws.ready_bytes() == 0
    ws.ready_words(pw, torch.bfloat16)
    assert ws.ready_bytes("cpu") == ws.ready_bytes() == 264 * 512 // 32 * 4
    if torch.cuda.is_available():
        assert ws.ready_bytes("cuda") == 0
    ws.free_ready()
    assert ws.ready_bytes() == 0
    with pdl.applied(pdl.LaunchPolicy(ready_scales=False)):
        assert _plan(32, 5120, 17408, "q4_k")["ready"] == 0
    assert _plan(32, 5120, 17408, "q4_k")["ready"] == 1


@needs_emu
@pytest.mark.parametrize("case", [EMU[3], (264, 1024, "q4_k", (20,), {**ws.T128, "STAGES": 3, "SPLIT_K": 2})]
                         + cuda_emu.wider(EMU[2], EMU[5]),
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[4]}")
def test_ws_ready_and_raw_scales_emulated_give_the_same_bits(seed, case):
    """Q4_K's ready scale words or its raw scales in the ring: int4_wgmma's emulated bits either way, over stream-K,
    four consumer warpgroups, splits and 128-row tiles, bf16 and fp16 x."""
    N, K, fmt, Ms, config = case
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    for dtype in (torch.bfloat16, torch.float16):
        x = _x(seed, Ms[-1], K, xs, device="cpu").to(dtype)
        want = cuda_emu.w4a16_wgmma_emulated(x, pw, out32=True, config=ws.wg_equivalent(config), seed=seed + 1)
        for ready in (1, 0):
            cfg = {**config, "READY": ready}
            assert _plan(Ms[-1], N, K, fmt, cfg)["ready"] == ready
            y = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, out32=True, config=cfg, seed=seed)
            assert torch.equal(y, want), f"READY={ready} {dtype} {config}: not int4_wgmma's bits"


def test_ws_weights_evict_first_in_one_batch_tile(monkeypatch):
    """The GEMM launch asks for its evict-first build (WEIGHT_EVICT) where one batch tile reads every weight byte once,
    not where several tiles re-read them, and not with the switch off; the staging launch never does."""
    calls = []

    class Launch:   # a compiled kernel's stand-in: records which build each launch asked for
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, device, shared_mem=0, evict=False):
            calls.append((self.name, evict))

    cpu = torch.device("cpu")
    for on in (True, False):
        monkeypatch.setattr(ws, "WEIGHT_EVICT_FIRST", on)
        for M in (1, 32, 128, 300):
            cfg = _plan(M, 5120, 17408, "q4_k")
            calls.clear()
            x = torch.zeros(M, 17408, dtype=torch.bfloat16)
            args = [x, None, None, None, None, None, 17408, 5120, 0, M, 5120, 17408 // 32, cfg["groups_per_split"],
                    cfg["n_bt"], cfg["n_nt"]]
            ws._StagedLaunch(cfg, (Launch("stage"), Launch("gemm")))(cfg["grid"], cfg["block"], args, cpu, cfg["smem"])
            want = on and cfg["n_bt"] == 1
            assert ("gemm", want) in calls and ("stage", True) not in calls, (on, M, calls)
            assert (cfg["n_bt"] == 1) == (M <= 128), M


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("case", [(36, 256, "q4_0"), (264, 1088, "q4_1"), (776, 768, "q4_k"), (1000, 1088, "q4_0"),
                                  (34816, 5120, "q4_k"), (5120, 17408, "q4_k"), (17408, 5120, "q4_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_ws_matches_folded_ref_and_wgmma_bits(seed, case):
    """Against the folded reference at B = 1..256 (36 rows: not aligned, int4_wgmma runs instead), and bitwise
    int4_wgmma's kernel for the same split and tiles at B = 1, 77, 128, 200."""
    gpu_matches_ref(ws.w4a16_wgmma_ws, _plan, "cuda_wgmma_ws", seed, *case, weights=folded_weights)
    N, K, fmt = case
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    for M in (1, 77, 128, 200):
        x = _x(seed + M, M, K, xs, device="cuda")
        want = int4_wgmma.w4a16_wgmma(x, pw, torch.empty(M, N, device="cuda"), config=ws.wg_equivalent())
        assert torch.equal(ws.w4a16_wgmma_ws(x, pw, torch.empty(M, N, device="cuda")), want), f"M={M}"


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("shape", sorted(ws.MEASURED_T128), ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_t128_measured_split_matches_ref_and_wgmma_bits(seed, shape):
    """The dispatch's 128-row tiles with a split of their own (MEASURED_T128): the folded reference at B = 1..256,
    bitwise int4_wgmma's kernel for that split, and rows independent of M."""
    from onepass.kernels import int4_dispatch as disp

    N, K, fmt = shape
    cfg = disp.ws_variant_config("cuda_wgmma_ws_t128", N, K, fmt)
    assert cfg["SPLIT_K"] == ws.MEASURED_T128[shape]["SPLIT_K"] and cfg["MT"] == ws.T128["MT"]
    fn = functools.partial(ws.w4a16_wgmma_ws, config=cfg)
    gpu_matches_ref(fn, lambda M, N, K, fmt: ws.ws_config(M, N, K, fmt, cfg), "cuda_wgmma_ws_t128", seed, *shape,
                    weights=folded_weights)
    gpu_rows_independent_of_m(fn, seed, *shape)
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    for M in (1, 64, 128):
        x = _x(seed + M, M, K, xs, device="cuda")
        want = int4_wgmma.w4a16_wgmma(x, pw, torch.empty(M, N, device="cuda"), config=ws.wg_equivalent(cfg))
        assert torch.equal(disp.run_variant("cuda_wgmma_ws_t128", x, pw, torch.empty(M, N, device="cuda")), want), M


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("config", [None, {"STAGES": 2}, {"TARGET_BLOCKS": 5, "SK_HALVE": 0}, {"SPLIT_K": 3},
                                    {"CWG": 4}, {"CWG": 4, "TARGET_BLOCKS": 5, "SK_HALVE": 0}, ws.T128,
                                    {"MMA": 1}, {"MMA": 1, "CWG": 4}, {"MMA": 1, "CWG": 4, "TARGET_BLOCKS": 5,
                                                                        "SK_HALVE": 0}, {**ws.T128, "MMA": 1}],
                         ids=["default", "two_stages", "stream_k", "split3", "cwg4", "cwg4_stream_k", "t128", "mma",
                              "mma_cwg4", "mma_cwg4_stream_k", "mma_t128"])
def test_ws_batch_invariant_and_repeatable(seed, config):
    """Rows independent of M (fp32 out) for each launch shape, the same bits on every repeat (stream-K leaves its
    flags zero), and int4_wgmma's bits for the same split."""
    fn = functools.partial(ws.w4a16_wgmma_ws, config=config)
    gpu_rows_independent_of_m(fn, seed, 2048, 5120, "q4_k")
    pw, xs = _weight("q4_k", 2048, 5120, seed % 1000, device="cuda")
    x = _x(seed, 130, 5120, xs, device="cuda")
    first = fn(x, pw)
    for _ in range(4):
        assert torch.equal(fn(x, pw), first), "result changed between launches"
    assert torch.equal(first, int4_wgmma.w4a16_wgmma(x, pw, config=ws.wg_equivalent(config)))


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("config", [None, {"CWG": 4}, {"TARGET_BLOCKS": 5, "SK_HALVE": 0}, ws.T128],
                         ids=["default", "cwg4", "stream_k", "t128"])
@pytest.mark.parametrize("fresh", [False, True], ids=["zeroed", "fresh"])
def test_ws_x_in_gemm_and_fresh_write_keep_the_bits(seed, config, fresh, monkeypatch):
    """The switches measured against each other on the GPU: X_IN_GEMM (x staged inside the GEMM, one launch), with the
    accumulators zeroed in the K loop or written by each segment's first quad at every batch tile: int4_wgmma's bits
    at B = 1, 40, 130 (two batch tiles), rows independent of M, graph capture."""
    monkeypatch.setattr(ws, "X_IN_GEMM", True)
    monkeypatch.setattr(ws, "FRESH_MIN_BT", 1 if fresh else 1 << 30)
    ws._kernels.cache_clear()
    try:
        fn = functools.partial(ws.w4a16_wgmma_ws, config=config)
        pw, xs = _weight("q4_k", 2048, 5120, seed % 1000, device="cuda")
        for M in (1, 40, 130):
            x = _x(seed + M, M, 5120, xs, device="cuda")
            assert torch.equal(fn(x, pw), int4_wgmma.w4a16_wgmma(x, pw, config=ws.wg_equivalent(config))), f"M={M}"
        gpu_rows_independent_of_m(fn, seed, 2048, 5120, "q4_k")
        gpu_strided_and_graph_capture(fn, seed, 2048, 5120, "q4_k", weights=folded_weights)
    finally:
        ws._kernels.cache_clear()


@needs_emu
@pytest.mark.parametrize("M,N,K,fmt,config", [(16, 264, 1024, "q4_0", None), (32, 264, 768, "q4_k", {"CWG": 4}),
                                              (128, 136, 512, "q4_1", ws.T128), (64, 264, 1280, "q4_k", None)],
                         ids=["bt16", "bt32_cwg4", "bt128_t128", "bt64"])
def test_x_image_is_the_staging_launchs(seed, M, N, K, fmt, config):
    """kernels/x_image.XImage.write_ref (what the producer kernels store) is byte for byte the image the staging
    launch (wg_stage_x, emulated) writes."""
    from onepass.kernels.x_image import XImage

    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    x = _x(seed, M, K, xs, device="cpu")
    staged = cuda_emu.w4a16_wgmma_ws_emulated(x, pw, config=config, staged_only=True)
    cfg = ws.ws_config(M, N, K, fmt, config)
    img = XImage(torch.zeros(staged.numel(), dtype=torch.bfloat16), M, K, cfg["BT"])
    assert img.numel == staged.numel()
    img.write_ref(x)
    assert torch.equal(img.buf.view(torch.int16), staged), f"seed={seed}: the image differs from wg_stage_x's"


def test_image_for_gives_none_on_the_cpu():
    """No image off the GPU (the CPU runs the reference or the interpreter, which stage nothing); the GPU test below
    checks the other rules (partial batch tiles, batch tiles that read x in the GEMM)."""
    from onepass.kernels import int4_dispatch as disp

    pw, _ = _weight("q4_k", 264, 1024, 1, device="cpu")
    assert ws.image_for(torch.zeros(32, 1024, dtype=torch.bfloat16), pw) is None          # CPU
    assert disp.image_for(torch.zeros(32, 1024, dtype=torch.bfloat16), pw) is None


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("config", [None, {"CWG": 4}, ws.T128, {"TARGET_BLOCKS": 5, "SK_HALVE": 0}],
                         ids=["default", "cwg4", "t128", "stream_k"])
def test_gpu_ws_reads_a_prestaged_image(seed, config):
    """The GEMM given an image written by XImage.write_ref (no staging launch) gives the staged call's bits, at the
    batch tiles that take one; image_for refuses partial tiles and the batch tiles that read x in the GEMM."""
    pw, xs = _weight("q4_k", 2048, 5120, seed % 1000, device="cuda")
    for M in (16, 32, 64, 128, 256):
        x = _x(seed + M, M, 5120, xs, device="cuda")
        img = ws.image_for(x, pw, config)
        assert img is not None and img.BT == ws.ws_config(M, 2048, 5120, "q4_k", config)["BT"], f"M={M}"
        img.buf.fill_(float("nan"))
        img.write_ref(x)
        want = ws.w4a16_wgmma_ws(x, pw, config=config)
        img.write_ref(x)                            # the staged call above rewrote the workspace: write it again
        assert torch.equal(ws.w4a16_wgmma_ws(x, pw, config=config, x_image=img), want), f"seed={seed} M={M}"
    assert ws.image_for(_x(seed, 40, 5120, xs, device="cuda"), pw, config) is None           # 40 of a tile of 64
    assert ws.image_for(_x(seed, 8, 5120, xs, device="cuda"), pw, config) is None            # x read in the GEMM
    with pytest.raises(ValueError, match="take it from image_for"):
        ws.w4a16_wgmma_ws(_x(seed, 64, 5120, xs, device="cuda"), pw, config=config,
                          x_image=ws.image_for(_x(seed, 128, 5120, xs, device="cuda"), pw, config))


@pytest.mark.gpu
@needs_wg
@pytest.mark.parametrize("shape", [(2048, 8192), (34816, 5120)], ids=["split", "stream_k"])
def test_ws_strided_and_graph_capture(seed, shape):
    gpu_strided_and_graph_capture(ws.w4a16_wgmma_ws, seed, *shape, "q4_k", weights=folded_weights)


@pytest.mark.gpu
@needs_wg
def test_ws_ready_words_never_made_inside_a_capture(seed):
    """A Q4_K weight captured before any eager call runs the raw-scale build in the graph (the same bits, nothing
    allocated, no ready words made: made there they would be filled only by replays); the next eager call makes the
    words and keeps the bits."""
    pw, xs = _weight("q4_k", 5120, 17408, seed % 1000, device="cuda")
    x = _x(seed, 32, 17408, xs, device="cuda")
    out = torch.empty(32, 5120, dtype=x.dtype, device="cuda")
    assert _plan(32, 5120, 17408, "q4_k")["ready"] == 1
    raw = ws.w4a16_wgmma_ws(x, pw, config={"READY": 0})          # compiles the raw build before the capture
    assert pw not in ws._READY
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_allocated()
        ws.w4a16_wgmma_ws(x, pw, out)
        after = torch.cuda.memory_allocated()
    assert after == before and pw not in ws._READY
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, raw)
    assert torch.equal(ws.w4a16_wgmma_ws(x, pw), raw) and torch.bfloat16 in ws._READY[pw]
    assert torch.equal(raw, int4_wgmma.w4a16_wgmma(x, pw, torch.empty(32, 5120, dtype=x.dtype, device="cuda"),
                                                   config=ws.wg_equivalent()))


def _nvcc():
    import glob
    import shutil

    found = shutil.which("nvcc") or sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (a CUDA toolkit compiles the source offline)")
@pytest.mark.parametrize("x_in_gemm", [False, True])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "q8_0"])
@pytest.mark.parametrize("N, K, M, config", [(5120, 17408, 128, None), (17408, 5120, 128, None),
                                             (5120, 6144, 128, ws.T128), (2048, 8192, 128, ws.T128),
                                             (5120, 17408, 32, None), (34816, 5120, 32, None)])
def test_sm90_compile_keeps_wgmmas_pipelined(tmp_path, fmt, N, K, M, config, x_in_gemm):
    """ptxas on the sm_90a build (offline, nvcc): from FRESH_MIN_BT sequences no wgmma serialization by accumulators
    defined inside the K loop (warning C7515, which zeroing them there causes on split-K builds of 16+ sequences;
    smaller tiles keep that zeroing, measured no slower there: the module docstring); every build compiles, X_IN_GEMM's
    too."""
    import subprocess

    cfg = ws.ws_config(M, N, K, fmt, config)
    src = ws.source(fmt, cfg["BT"], False, True, cfg["STAGES"], 1, cfg["workers"] > 0, cfg["WG_MT"], cfg["CWG"],
                    x_in_gemm)
    cu = tmp_path / "ws.cu"
    cu.write_text(src)
    r = subprocess.run([_nvcc(), "-arch=sm_90a", "-cubin", "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "ws.cubin")],
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    if x_in_gemm:
        return
    if cfg["BT"] >= ws.FRESH_MIN_BT:
        assert "#define FRESH_WRITE 1" in src
        assert "C7515" not in log, log[-2000:]
    else:
        assert "#define FRESH_WRITE 0" in src


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (a CUDA toolkit compiles the source offline)")
@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
@pytest.mark.parametrize("N, K", [(5120, 17408), (16384, 5120)])
def test_sm90_compile_step_groups_keep_wgmmas_pipelined_at_128(tmp_path, fmt, N, K):
    """ptxas on the sm_90a build at 128 sequences (four consumer warpgroups of 112 registers): with a word's two k16
    steps per commit group it serializes the wgmmas for lack of registers (warning C7512); with one group per step
    (WG_STEP_GROUPS, the STEP_GROUPS_MIN_BT switch) it does not."""
    import subprocess

    cfg = ws.ws_config(128, N, K, fmt)
    assert cfg["BT"] == 128 and cfg["CWG"] == 4
    logs = {}
    for step in (False, True):
        src = ws.source(fmt, cfg["BT"], False, True, cfg["STAGES"], 1, cfg["workers"] > 0, cfg["WG_MT"], cfg["CWG"],
                        False, step_groups=step)
        assert f"#define WG_STEP_GROUPS {int(step)}" in src
        cu = tmp_path / f"ws{int(step)}.cu"
        cu.write_text(src)
        r = subprocess.run([_nvcc(), "-arch=sm_90a", "-cubin", "-Xptxas", "-v", str(cu),
                            "-o", str(tmp_path / "ws.cubin")], capture_output=True, text=True, timeout=300)
        logs[step] = r.stdout + r.stderr
        assert r.returncode == 0, logs[step][-2000:]
    assert "C7512" in logs[False], logs[False][-2000:]
    assert "C7512" not in logs[True], logs[True][-2000:]


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (a CUDA toolkit compiles the source offline)")
@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_sm90_compile_evict_first_copies(tmp_path, fmt):
    """The evict-first build (WEIGHT_EVICT defined) gives the weights' and scales' bulk copies an L2 cache hint, x's
    copies none, and compiles for sm_90a with the plain build's registers and spills."""
    import re
    import subprocess

    cfg = ws.ws_config(32, 5120, 17408, fmt)
    src = ws.source(fmt, cfg["BT"], False, True, cfg["STAGES"], 1, cfg["workers"] > 0, cfg["WG_MT"], cfg["CWG"], False)
    usage = {}
    for evict in (False, True):
        cu = tmp_path / f"ws{int(evict)}.cu"
        cu.write_text(("#define WEIGHT_EVICT 1\n" if evict else "") + src)
        r = subprocess.run([_nvcc(), "-arch=sm_90a", "-ptx", str(cu), "-o", str(tmp_path / "ws.ptx")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
        copies = [ln for ln in (tmp_path / "ws.ptx").read_text().splitlines() if "cp.async.bulk.shared" in ln]
        hinted = [ln for ln in copies if "L2::cache_hint" in ln]
        assert copies and (0 < len(hinted) < len(copies) if evict else not hinted), (evict, copies)   # x's: plain
        r = subprocess.run([_nvcc(), "-arch=sm_90a", "-cubin", "-Xptxas", "-v", str(cu),
                            "-o", str(tmp_path / "ws.cubin")], capture_output=True, text=True, timeout=300)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-2000:]
        usage[evict] = re.findall(r"w4a16_wgmma_ws.*?\n.*?\n(.*?registers.*)", log) or log
    assert usage[True] == usage[False], usage
