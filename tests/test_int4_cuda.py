"""kernels/int4_cuda.py (CUDA C++ W4A16 kernel through CuPy / NVRTC) and every variant of
kernels/int4_dispatch.py against w4a16_linear_ref on the GPU.

CPU: the module imports without CuPy and without a GPU, and its source compiles for sm_90 with nvcc when
nvcc is on the PATH (a syntax / register check; nothing runs). tests/cuda_emu.py runs the source on the CPU
(g++): every format against the reference, batch invariance, launch-shape overrides (KW, CG, split) and
MEASURED entries.
GPU (`gpu` marker): every format, odd N (not a multiple of the 32-row tile), K not a multiple of the
1024-weight chunk, the issue's shapes, B = 1..256; batch invariance (rows bitwise equal across M, so
across batch tiles); CUDA-graph capture with out= allocating nothing; fp32 out; strided x; both NVRTC
bindings when both exist. Tolerances as tests/test_int4_gemm.py (outputs ~N(0, 1); one bf16 ulp-ish).
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from tests.test_int4_gemm import FMTS, _check, _weight, _x  # noqa: F401  (also sets the interpreter flag)
from onepass.kernels.quant_pack import unpack_ref
from onepass.kernels import int4_cuda, int4_dispatch as disp
from tests import cuda_emu

ON_GPU = torch.cuda.is_available()
needs_cuda_kernel = pytest.mark.skipif(ON_GPU and not int4_cuda.available(),
                                       reason="no NVRTC binding (cupy or torch.cuda._compile_kernel)")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
@pytest.mark.parametrize("fmt", FMTS)
def test_source_compiles_for_sm90(tmp_path, fmt):
    """Default shape at three batch tiles, and non-default KW / CG; spills stay a few words (outside the
    inner loop: the register slots must not spill)."""
    for bt, f16, o32, kw, cg in ((1, False, False, 4, 32), (8, True, True, 4, 32), (4, False, True, 4, 32),
                                 (1, False, True, 8, 64), (8, False, True, 8, 32), (2, True, False, 2, 16)):
        src = tmp_path / f"{fmt}_{bt}_{kw}_{cg}.cu"
        src.write_text(int4_cuda.source(fmt, bt, f16, o32, kw, cg))
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(src) + ".cubin", "--resource-usage",
                            "-std=c++14", str(src)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)]
        assert max(spills, default=0) <= 64, f"{src.name}: {r.stdout + r.stderr}"


# --------------------------------------------------------------------------------------------------
# CPU: the kernel's source run by tests/cuda_emu.py (g++; blocks in turn, threads at real barriers)

# (N, K, fmt, Ms[, config]); the config {"TARGET_BLOCKS": 1} gives one split over several chunks on a
# small N (the default rule gives that only from N ~ 17k rows, too slow to emulate)
EMU = [(72, 160, "q4_0", (1, 3, 9)), (72, 160, "q4_1", (2, 8)), (72, 768, "q4_k", (1, 5)), (72, 160, "q8_0", (4, 11)),
       (64, 1024, "q4_1", (3,)), (333, 2080, "q8_0", (2,)), (40, 1280, "q4_k", (9,)),
       (80, 1088, "q4_0", (3,), {"TARGET_BLOCKS": 1})]
# non-default launch shapes: KW = 1 (no warp reduction), 2, 8; CG below / above the default (64: lowered
# to fit shared memory at BT = 8, bit-neutral); explicit SPLIT_K (uneven last split) and TARGET_BLOCKS
EMU_SHAPES = [(72, 160, "q4_1", (1, 9), {"KW": 2, "CG": 4, "SPLIT_K": 2}),
              (40, 768, "q4_k", (2, 9), {"KW": 8, "CG": 8, "SPLIT_K": 1}),
              (40, 1088, "q4_0", (1, 5), {"KW": 1, "CG": 4, "TARGET_BLOCKS": 3}),
              (40, 2080, "q8_0", (1, 9), {"KW": 4, "CG": 64, "SPLIT_K": 1})]


def exact_weights(pw, dtype):
    """The weights the exact-integer kernels multiply, whatever x's dtype: unpack_ref."""
    return unpack_ref(pw)


def emulated_matches_ref(emulate, plan, seed, N, K, fmt, Ms, config=None, fp16=True, weights=exact_weights):
    """A CUDA kernel's source run on the CPU (emulate: a tests/cuda_emu.py launcher; plan(M, N, K, fmt, config)
    its launch config; weights(pw, x dtype) the fp32 weights it multiplies): fp32 output vs the fp32 reference,
    rows bitwise independent of M (batch invariance), bf16 output = the fp32 result rounded once, fp16 x."""
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    cfg = plan(max(Ms), N, K, fmt, config)
    x_all = _x(seed, max(Ms), K, xs, device="cpu")
    y_all = emulate(x_all, pw, out32=True, config=config)
    ref = x_all.float() @ weights(pw, x_all.dtype).T
    err = (y_all - ref).abs().max().item()
    assert err <= 1e-4 * (1 + ref.abs().max().item()), f"seed={seed} {fmt} {N}x{K} {cfg}: max err {err}"
    for M in Ms:
        y = emulate(x_all[:M], pw, out32=True, config=config)
        assert torch.equal(y, y_all[:M]), f"seed={seed} {fmt} {N}x{K} {config}: M={M} rows differ from M={max(Ms)}"
    y16 = emulate(x_all, pw, config=config)
    assert torch.equal(y16, y_all.to(torch.bfloat16)), "bf16 output is not the fp32 result rounded once"
    if fp16:
        x16 = x_all.half()
        _check(emulate(x16, pw, config=config), (x16.float() @ weights(pw, x16.dtype).T).half(), seed, f"{fmt} fp16")
    return pw, x_all, y_all


def _emulated_matches_ref(seed, N, K, fmt, Ms, config=None, fp16=True):
    return emulated_matches_ref(cuda_emu.w4a16_emulated, int4_cuda.cuda_config, seed, N, K, fmt, Ms, config, fp16)


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", EMU, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_cuda_source_emulated_matches_ref(seed, case):
    """Indexing, masks (N past the row tile, K past the chunk, M past the batch tile), split-K and the
    warp / split reduction order, on the exact source text."""
    _emulated_matches_ref(seed, *case)


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("case", EMU_SHAPES, ids=lambda c: f"{c[2]}-" + "-".join(f"{k}{v}" for k, v in c[4].items()))
def test_emulated_launch_shapes(seed, case):
    """A config= override equals the reference and is batch-invariant; a different CG (same KW and split)
    gives the same bits."""
    N, K, fmt, Ms, config = case
    pw, x_all, y_all = _emulated_matches_ref(seed, N, K, fmt, Ms, config, fp16=False)
    other = dict(config, CG=config["KW"] * (2 if config["CG"] > 2 * config["KW"] else 4))
    assert int4_cuda.cuda_config(1, N, K, fmt, other)["CG"] != int4_cuda.cuda_config(1, N, K, fmt, config)["CG"]
    y = cuda_emu.w4a16_emulated(x_all, pw, out32=True, config=other)
    assert torch.equal(y, y_all), f"seed={seed} {fmt} {N}x{K}: CG {config['CG']} -> {other['CG']} changed the bits"


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
def test_emulated_measured_entry_is_used(seed, monkeypatch):
    """A MEASURED entry sets the launch shape of its (N, K, fmt) alone; config= still overrides it."""
    N, K, fmt = 40, 1280, "q4_1"
    entry = {"KW": 2, "CG": 8, "SPLIT_K": 3}
    base = int4_cuda.cuda_config(5, N, K, fmt)
    monkeypatch.setitem(int4_cuda.MEASURED, (N, K, fmt), entry)
    c = int4_cuda.cuda_config(5, N, K, fmt)
    assert (c["KW"], c["CG"], c["SPLIT_K"], c["block"]) == (2, 8, 3, 64) and c["workspace_floats"] == 3 * 5 * N
    assert int4_cuda.cuda_config(5, N, K, "q4_0") == int4_cuda.cuda_config(5, N, K, "q4_0", {})  # other shapes
    assert int4_cuda.split_rule(N, K, fmt) == (3, 14)
    assert int4_cuda.cuda_config(5, N, K, fmt, {"TARGET_BLOCKS": 1})["SPLIT_K"] == 1       # replaces SPLIT_K
    assert int4_cuda.cuda_config(5, N, K, fmt, {"KW": 4})["CG"] == 8                        # keeps the rest
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cpu")
    x = _x(seed, 5, K, xs, device="cpu")
    y = cuda_emu.w4a16_emulated(x, pw, out32=True)
    assert torch.equal(y, cuda_emu.w4a16_emulated(x, pw, out32=True, config=entry))
    ref = x.float() @ unpack_ref(pw).T
    assert (y - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
    monkeypatch.delitem(int4_cuda.MEASURED, (N, K, fmt))
    assert int4_cuda.cuda_config(5, N, K, fmt) == base


def test_shape_config_rejects_bad_overrides():
    for bad in ({"KW": 3, "CG": 32}, {"KW": 32}, {"CG": 128}, {"SPLIT_K": 2, "TARGET_BLOCKS": 8}, {"BT": 4},
                {"SPLIT_K": 0}):
        with pytest.raises(ValueError):
            int4_cuda.cuda_config(1, 64, 1024, "q4_0", bad)
    assert int4_cuda.cuda_config(1, 64, 1024, "q4_0", {"SPLIT_K": 99})["SPLIT_K"] == 32     # at most G
    assert int4_cuda.cuda_config(8, 64, 4096, "q4_0", {"CG": 64})["CG"] == 40               # fits 48 KB at BT 8
    assert int4_cuda.cuda_config(1, 64, 4096, "q4_0", {"CG": 64})["CG"] == 64


def test_emulated_cases_cover_split_k_and_chunks():
    cfgs = [int4_cuda.cuda_config(m, *c[:3], *c[4:]) for c in EMU + EMU_SHAPES for m in c[3]]
    assert any(c["SPLIT_K"] > 1 for c in cfgs) and any(c["SPLIT_K"] == 1 for c in cfgs)
    assert any(c["groups_per_split"] > c["CG"] for c in cfgs)                   # several chunks per split
    assert any(c["groups_per_split"] % c["CG"] for c in cfgs)                   # a partial chunk
    assert {c["BT"] for c in cfgs} >= {1, 2, 4, 8}
    assert {c["KW"] for c in cfgs} >= {1, 2, 4, 8}


# --------------------------------------------------------------------------------------------------
# GPU

def _ref(x, pw, weights=exact_weights):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return (x.float() @ weights(pw, x.dtype).T).to(x.dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


ODD = [(72, 160, "q4_0"), (72, 160, "q4_1"), (72, 160, "q8_0"), (72, 768, "q4_k"), (1000, 1088, "q4_0"),
       (333, 2080, "q8_0"), (95, 1280, "q4_k"), (130, 96, "q4_1")]
ISSUE = [(5120, 17408), (17408, 5120), (5120, 12288), (4096, 4096), (2048, 8192)]


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("case", ODD + [(n, k, f) for n, k in ISSUE for f in FMTS],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_cuda_matches_ref(seed, case):
    gpu_matches_ref(int4_cuda.w4a16_cuda, lambda M, N, K, fmt: int4_cuda.cuda_config(M, N, K, fmt), "cuda", seed, *case)


def gpu_matches_ref(fn, plan, label, seed, N, K, fmt, weights=exact_weights):
    """fn(x, pw) against the reference (weights(pw, x dtype): what fn multiplies) for B = 1..256 (batch tiles,
    several tiles, split-K) and fp16 x."""
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    Ms = (1, 2, 3, 4, 5, 8, 9, 16, 31, 64, 129, 256) if N * K < 1 << 24 else (1, 2, 4, 8, 17, 64, 256)
    for M in Ms:
        x = _x(seed + M, M, K, xs, device="cuda")
        _check(fn(x, pw), _ref(x, pw, weights), seed, f"{label} {fmt} N={N} K={K} M={M} cfg={plan(M, N, K, fmt)}")
    x = _x(seed, 6, K, xs, torch.float16, device="cuda")
    _check(fn(x, pw), _ref(x, pw, weights), seed, f"{label} {fmt} N={N} K={K} fp16")


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("case", [(72, 160, "q4_1"), (4096, 4096, "q4_0"), (2048, 8192, "q4_k"), (17408, 5120, "q8_0")],
                         ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_cuda_batch_invariant_fp32(seed, case):
    gpu_rows_independent_of_m(int4_cuda.w4a16_cuda, seed, *case)


def gpu_rows_independent_of_m(fn, seed, N, K, fmt):
    """Rows are bitwise equal whatever M and wherever they sit in x (so whichever batch tile and tile
    index), fp32 out; the x-dtype output is the fp32 result rounded once."""
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    x = _x(seed, 100, K, xs, device="cuda")
    y_all = fn(x, pw, torch.empty(100, N, device="cuda"))
    for M in (1, 2, 3, 7, 8, 9, 16, 17, 33):
        for lo in (0, 100 - M):
            y = fn(x[lo:lo + M], pw, torch.empty(M, N, device="cuda"))
            assert torch.equal(y, y_all[lo:lo + M]), f"seed={seed} {fmt} N={N} K={K}: rows {lo}..{lo + M} depend on M"
    assert torch.equal(fn(x, pw), y_all.to(x.dtype)), "the bf16 output is not the fp32 result rounded once"


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_launch_shapes(seed, fmt):
    """config= overrides (KW 1..16, CG lowered at BT 8, explicit splits) vs the reference, batch-invariant
    (fp32 out), and CG bit-neutral."""
    N, K = 1000, 4352
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    x = _x(seed, 20, K, xs, device="cuda")
    for config in ({"KW": 8, "CG": 64}, {"KW": 2, "CG": 16, "SPLIT_K": 3}, {"KW": 1, "CG": 8, "SPLIT_K": 1},
                   {"KW": 16, "CG": 32, "TARGET_BLOCKS": 400}):
        _check(int4_cuda.w4a16_cuda(x, pw, config=config), _ref(x, pw), seed, f"cuda {fmt} {config}")
        y_all = int4_cuda.w4a16_cuda(x, pw, torch.empty(20, N, device="cuda"), config=config)
        for M in (1, 2, 5, 8, 9):
            y = int4_cuda.w4a16_cuda(x[:M], pw, torch.empty(M, N, device="cuda"), config=config)
            assert torch.equal(y, y_all[:M]), f"seed={seed} {fmt} {config} M={M}: rows depend on M"
        other = dict(config, CG=config["KW"] * 2 if config["CG"] > 2 * config["KW"] else config["KW"] * 4)
        y = int4_cuda.w4a16_cuda(x, pw, torch.empty(20, N, device="cuda"), config=other)
        assert torch.equal(y, y_all), f"seed={seed} {fmt} {config} -> {other}: CG changed the bits"


@pytest.mark.gpu
@needs_cuda_kernel
def test_cuda_strided_and_graph_capture(seed):
    assert int4_cuda.cuda_config(8, 2048, 8192, "q4_0")["SPLIT_K"] > 1  # split-K: workspace + reduce kernel
    gpu_strided_and_graph_capture(int4_cuda.w4a16_cuda, seed, 2048, 8192, "q4_0")


def gpu_strided_and_graph_capture(fn, seed, N, K, fmt, weights=exact_weights):
    """Column-strided x (copied), row-strided x and out, and a CUDA graph capture that allocates nothing and
    replays with new x."""
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    big = _x(seed, 8, 2 * K, xs, device="cuda")
    x = big[:, ::2]                                          # non-unit column stride: copied
    _check(fn(x, pw), _ref(x, pw, weights), seed, "strided x")
    x = big[:, :K]                                           # row stride 2K
    out_big = torch.empty(8, 2 * N, dtype=x.dtype, device="cuda")
    out = out_big[:, N:]
    fn(x, pw, out)
    _check(out, _ref(x, pw, weights), seed, "row-strided x and out")
    disp.reserve(x.device, x.dtype, [pw], 8)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, pw, out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_allocated()
        fn(x, pw, out)
        after = torch.cuda.memory_allocated()
    assert after == before, f"allocated {after - before} bytes during capture"
    x.copy_(_x(seed + 1, 8, K, xs, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(x, pw))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", disp.VARIANTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_dispatch_variants_match_ref(seed, variant, fmt):
    N, K = (5120, 4096)
    pw, xs = _weight(fmt, N, K, seed % 1000, device="cuda")
    for M in (1, 4, 16, 128, 300):
        x = _x(seed + M, M, K, xs, device="cuda")
        y = disp.run_variant(variant, x, pw)
        # triton (FOLD) and dequant_cublas round the weights to bf16; the CUDA kernels take them exactly
        tol = 1 if disp.runnable(variant, x, fmt) in ("cuda", "cuda_mma") else 3
        ref = _ref(x, pw)
        err = (y.float() - ref.float()).abs()
        assert (err <= tol * 1e-2 * (1 + ref.float().abs())).all(), \
            f"seed={seed} {variant} {fmt} M={M}: max err {err.max().item():.3g}"


@pytest.mark.gpu
def test_both_nvrtc_bindings_agree(seed, monkeypatch):
    if int4_cuda._cupy is None or not hasattr(torch.cuda, "_compile_kernel"):
        pytest.skip("needs both cupy and torch.cuda._compile_kernel")
    pw, xs = _weight("q4_1", 1000, 1088, seed % 1000, device="cuda")
    x = _x(seed, 5, 1088, xs, device="cuda")
    ys = {}
    for how in ("cupy", "torch"):
        monkeypatch.setenv("ONEPASS_INT4_CUDA_COMPILER", how)
        int4_cuda._kernel.cache_clear()
        ys[how] = int4_cuda.w4a16_cuda(x, pw)
    int4_cuda._kernel.cache_clear()
    assert torch.equal(ys["cupy"], ys["torch"])


@pytest.mark.skipif(not cuda_emu.available(), reason="g++ not found")
@pytest.mark.parametrize("S", [1, 2, 5, 9, 12, 13, 23, 26])
def test_splitk_reduce_adds_splits_in_order(S):
    """The reduce kernel loads splits eight and four at a time; the sum is still ((p0 + p1) + p2) + ... in fp32,
    rounded once (bf16 out)."""
    g = torch.Generator().manual_seed(S)
    ws = torch.randn(S, 3, 70, generator=g) * torch.logspace(-3, 3, S)[:, None, None]
    want = ws[0].clone()
    for s in range(1, S):
        want = want + ws[s]
    assert torch.equal(cuda_emu.splitk_reduce_emulated(ws, out32=True), want)
    assert torch.equal(cuda_emu.splitk_reduce_emulated(ws), want.bfloat16())
