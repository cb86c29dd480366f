"""kernels/nvrtc.py, the runtime every CUDA C++ kernel of onepass is compiled and launched through (its split-K
reduce kernel, the launch-shape layering, both NVRTC bindings), and every variant of kernels/int4_dispatch.py against
w4a16_linear_ref on the GPU. The helpers the CUDA kernels' own tests share (tests/test_int4_mma.py,
test_int4_wgmma.py, test_int4_wgmma_ws.py) live here too.

CPU: the module imports without CuPy and without a GPU; the reduce's source compiles for sm_90 with nvcc when nvcc is
on the PATH (nothing runs); tests/cuda_emu.py runs the reduce on the CPU (g++): the splits added in order.
GPU (`gpu` marker): every dispatch variant and format against the reference; both NVRTC bindings give the same bits
when both exist. Tolerances as tests/test_int4_gemm.py (outputs ~N(0, 1); one bf16 ulp-ish).
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tests.test_int4_gemm import FMTS, _check, _weight, _x  # noqa: F401  (also sets the interpreter flag)
from onepass.kernels.quant_pack import unpack_ref
from onepass.kernels import int4_dispatch as disp, int4_mma, nvrtc
from tests import cuda_emu

ON_GPU = torch.cuda.is_available()


def test_imports_and_configures_without_cupy():
    """Importing never fails; without a GPU (or a binding) nothing claims to run; the sources need no headers."""
    assert nvrtc.available() is (nvrtc._compiler() is not None)
    assert nvrtc.available() is False or ON_GPU
    assert nvrtc.compiler() in ("cupy", "torch", "none")
    for x_f16 in (False, True):
        for out32 in (False, True):
            src = nvrtc.reduce_source(x_f16, out32)
            head = src.split("\n")[:nvrtc.REDUCE_DEFINES]
            assert head == [f"#define X_F16 {int(x_f16)}", f"#define OUT32 {int(out32)}"]
            assert "w4a16_splitk_reduce" in src and "#include" not in src


def test_layered_config():
    """base, then each layer replacing the keys it names (None / empty skipped); a layer naming one split key drops
    the other; unknown keys, or both split keys in one layer, are errors."""
    keys = ("A", "B", "SPLIT_K", "TARGET_BLOCKS")
    base = {"A": 1, "B": 2, "TARGET_BLOCKS": 100}
    assert nvrtc.layered_config("k", (1, 2, "q4_0"), base, (None, {}), keys) == base
    assert nvrtc.layered_config("k", (1, 2, "q4_0"), base, ({"A": 3}, None, {"B": "4"}), keys) == \
        {"A": 3, "B": 4, "TARGET_BLOCKS": 100}
    assert nvrtc.layered_config("k", (1, 2, "q4_0"), base, ({"SPLIT_K": 3}, {"A": 5}), keys) == \
        {"A": 5, "B": 2, "SPLIT_K": 3}
    assert nvrtc.layered_config("k", (1, 2, "q4_0"), base, ({"SPLIT_K": 3}, {"TARGET_BLOCKS": 8}), keys) == \
        {"A": 1, "B": 2, "TARGET_BLOCKS": 8}
    assert base == {"A": 1, "B": 2, "TARGET_BLOCKS": 100}                      # the base is not modified
    for bad in ({"C": 1}, {"SPLIT_K": 2, "TARGET_BLOCKS": 8}):
        with pytest.raises(ValueError, match="keys are"):
            nvrtc.layered_config("k", (1, 2, "q4_0"), base, (bad,), keys)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_reduce_source_compiles_for_sm90(tmp_path):
    for x_f16 in (False, True):
        for out32 in (False, True):
            for release in ("", "#define PDL_RELEASE 1\n"):
                src = tmp_path / f"reduce_{int(x_f16)}{int(out32)}{int(bool(release))}.cu"
                src.write_text(release + nvrtc.reduce_source(x_f16, out32))
                r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(src) + ".cubin", "-std=c++14",
                                    str(src)], capture_output=True, text=True, timeout=300)
                assert r.returncode == 0, r.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# the CUDA kernels' shared test helpers: emulation (tests/cuda_emu.py) and the GPU

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


# --------------------------------------------------------------------------------------------------
# GPU

def _ref(x, pw, weights=exact_weights):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return (x.float() @ weights(pw, x.dtype).T).to(x.dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


ISSUE = [(5120, 17408), (17408, 5120), (5120, 12288), (4096, 4096), (2048, 8192)]


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
        # triton (FOLD) and the folded CUDA kernels round the weights to bf16; cuda_mma takes them exactly
        tol = 1 if disp.runnable(variant, x, fmt) == "cuda_mma" else 3
        ref = _ref(x, pw)
        err = (y.float() - ref.float()).abs()
        assert (err <= tol * 1e-2 * (1 + ref.float().abs())).all(), \
            f"seed={seed} {variant} {fmt} M={M}: max err {err.max().item():.3g}"


@pytest.mark.gpu
def test_both_nvrtc_bindings_agree(seed, monkeypatch):
    """The mma kernel and the split-K reduce compiled by CuPy and by torch's binding: the same bits."""
    if nvrtc._cupy is None or not hasattr(torch.cuda, "_compile_kernel"):
        pytest.skip("needs both cupy and torch.cuda._compile_kernel")
    if not int4_mma.available():
        pytest.skip("no mma.sync kernel here (sm_80+)")
    pw, xs = _weight("q4_1", 1000, 1088, seed % 1000, device="cuda")
    x = _x(seed, 5, 1088, xs, device="cuda")
    assert int4_mma.mma_config(5, 1000, 1088, "q4_1")["SPLIT_K"] > 1           # the kernel, then the reduce
    ys = {}
    for how in ("cupy", "torch"):
        monkeypatch.setenv("ONEPASS_INT4_CUDA_COMPILER", how)
        assert nvrtc.compiler() == how
        int4_mma._kernel.cache_clear()
        nvrtc._reduce_kernel.cache_clear()
        ys[how] = int4_mma.w4a16_mma(x, pw)
    int4_mma._kernel.cache_clear()
    nvrtc._reduce_kernel.cache_clear()
    assert torch.equal(ys["cupy"], ys["torch"])
    _check(ys["torch"], _ref(x, pw), seed, "mma split-K through both bindings")


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
