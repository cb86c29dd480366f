"""kernels.gemm.linear: agreement with linear_ref, and batch invariance (row m of the result is bitwise
the same for the same x[m] whatever M is and whatever the other rows hold).

How this runs without a GPU: triton.jit (and triton.language's own jit helpers) choose between GPU
compilation and the CPU interpreter when they are *decorated*, reading TRITON_INTERPRET, so the flag
must be in the environment before triton is first imported. Without CUDA, and with triton not yet
imported, this module sets it (setdefault) before importing kernels.gemm (`import torch` does not import
triton). If triton was already imported without the flag (another test module, a plugin), the small
tests cannot run in this process: they skip, and `test_small_suite_in_interpreter_subprocess` re-runs
this file in a child process with TRITON_INTERPRET=1 instead. With CUDA the small tests run on the GPU
and the `gpu`-marked tests cover the real shapes.

Inputs are fresh random data on every run; the seed is printed and is part of every failure message.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onepass.kernels import gemm  # noqa: E402  (after the interpreter flag)
from onepass.kernels.gemm import gemm_config, linear, linear_ref  # noqa: E402
from tests.interpreter import run_in_interpreter  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bf16 steps (their bit patterns mapped to ordered integers)."""
    def key(t):
        i = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(i >= 0, i, -(i & 0x7FFF))
    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def assert_same_row(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    """Batch invariance: bitwise on the GPU. Under the interpreter tl.dot is numpy's matmul, and OpenBLAS sums a row
    in an order that depends on the row's place in the tile, so a row moved within a tile can round to the next bf16
    value there (seen: one element of one row in 17 at 1.1e-05): one step is allowed on the CPU, none on the GPU."""
    if ON_GPU:
        assert torch.equal(a, b), msg
    else:
        assert _bf16_ulps(a, b) <= 1, msg


def _small_runs_here() -> bool:
    """GPU, or a working interpreter (triton imported with the flag: a one-row probe succeeds)."""
    if ON_GPU:
        return True
    if not gemm._INTERPRETED:
        return False
    try:
        linear(torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(16, 16, dtype=torch.bfloat16))
        return True
    except Exception:  # noqa: BLE001 - a real bug shows up in the subprocess test's output
        return False


CAN_RUN_SMALL = _small_runs_here()
small = pytest.mark.skipif(not CAN_RUN_SMALL, reason="triton was imported without TRITON_INTERPRET=1 and there "
                                                     "is no GPU; covered by the subprocess test")

# tolerance against the fp32 reference, rounded once to the output dtype: about one output ulp
TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float16: dict(rtol=4e-3, atol=4e-3)}

# (N, K) of the projections that matter: Llama-3.2-1B, Qwen3-1.7B, Qwen3-4B (qkv, o, gate_up, down, lm_head)
SHAPES = [
    (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
    (4096, 2048), (12288, 2048), (2048, 6144), (151936, 2048),
    (6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560),
]


def _inputs(seed: int, M: int, N: int, K: int, dtype=torch.bfloat16, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)  # outputs ~ N(0, 1)
    return x.to(device), w.to(device)


def _rows_alone(x: torch.Tensor, w: torch.Tensor, rows, **kw) -> dict[int, torch.Tensor]:
    return {i: linear(x[i:i + 1], w, **kw)[0] for i in rows}


# --------------------------------------------------------------------------------------------------
# small shapes: the interpreter on CPU, the compiled kernels on a GPU

@small
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,N,K", [(1, 32, 64), (3, 48, 96), (17, 32, 96), (17, 48, 64)])
def test_matches_ref(seed, dtype, M, N, K):
    # N=48 is not a multiple of BLOCK_N=64, K=96 not a multiple of BLOCK_K=64
    x, w = _inputs(seed, M, N, K, dtype)
    y = linear(x, w)
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y, linear_ref(x, w), **TOL[dtype], msg=lambda m: f"seed={seed}: {m}")


# forced configurations: split-K (uneven last split, K tail), narrow tiles, the other BLOCK_M values
FORCED = [
    dict(SPLIT_K=2, BLOCK_K=32),                    # K=96 -> 3 blocks: splits of 2 and 1
    dict(SPLIT_K=3, BLOCK_K=16, BLOCK_N=16),        # 6 blocks of 16, N=48 over three 16-wide tiles
    dict(SPLIT_K=2, BLOCK_K=64),                    # 2 blocks, the second one masked (K=96)
    dict(BLOCK_M=128),
    dict(BLOCK_M=16, BLOCK_N=32),
]


@small
@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_forced_configs_match_ref_and_are_batch_invariant(seed, cfg):
    M, N, K = 17, 48, 96
    x, w = _inputs(seed, M, N, K)
    y = linear(x, w, config=cfg)
    torch.testing.assert_close(y, linear_ref(x, w), **TOL[torch.bfloat16], msg=lambda m: f"seed={seed}: {m}")
    for i, yi in _rows_alone(x, w, (0, 7, 16), config=cfg).items():
        assert_same_row(y[i], yi, f"seed={seed} cfg={cfg}: row {i} of M={M} differs from the row alone")


@small
def test_split_k_row_chunks(seed, monkeypatch):
    # split-K launches take SPLITK_M_CHUNK rows at a time (bounded workspace): chunking must not show
    monkeypatch.setattr(gemm, "SPLITK_M_CHUNK", 8)
    M, N, K = 17, 48, 96
    x, w = _inputs(seed, M, N, K)
    cfg = dict(SPLIT_K=2, BLOCK_K=32)
    y = linear(x, w, config=cfg)
    torch.testing.assert_close(y, linear_ref(x, w), **TOL[torch.bfloat16], msg=lambda m: f"seed={seed}: {m}")
    monkeypatch.setattr(gemm, "SPLITK_M_CHUNK", 512)
    assert_same_row(y, linear(x, w, config=cfg), f"seed={seed}: chunked split-K differs from unchunked")


@small
@pytest.mark.parametrize("N,K", [(48, 96), (32, 64)])
def test_batch_invariance(seed, N, K):
    """Rows of an M=17 result equal each row computed alone (M=1), and do not depend on the other rows."""
    M = 17
    x, w = _inputs(seed, M, N, K)
    y = linear(x, w)
    for i, yi in _rows_alone(x, w, range(M)).items():
        assert_same_row(y[i], yi, f"seed={seed}: row {i} of M={M} differs from M=1")
    # same row 5, different neighbours (much larger values)
    x2, _ = _inputs(seed + 1, M, N, K)
    x2 = x2 * 100
    x2[5] = x[5]
    assert_same_row(linear(x2, w)[5], y[5], f"seed={seed}: row 5 depends on the other rows")


@small
def test_batch_invariance_across_block_m_rule(seed):
    """M=70 takes BLOCK_M=128 under the rule, M=1 takes 64: rows must still agree."""
    M, N, K = 70, 48, 96
    x, w = _inputs(seed, M, N, K)
    assert gemm_config(M, N, K)["BLOCK_M"] != gemm_config(1, N, K)["BLOCK_M"] or gemm.PIN_BLOCK_M is not None
    y = linear(x, w)
    for i, yi in _rows_alone(x, w, (0, 63, 64, 69)).items():
        assert_same_row(y[i], yi, f"seed={seed}: row {i} of M={M} differs from M=1")


@small
def test_strided_views_and_out(seed):
    M, N, K = 9, 48, 96
    x, w = _inputs(seed, M, N, K)
    ref = linear(x, w)
    big = torch.zeros(2 * M, 2 * K, dtype=x.dtype, device=x.device)
    big[::2, 3:3 + K] = x
    xv = big[::2, 3:3 + K]                       # row stride 4K, offset start: a non-contiguous view
    out_big = torch.full((M, N + 16), 7.0, dtype=x.dtype, device=x.device)
    out = out_big[:, 8:8 + N]                    # non-contiguous output
    r = linear(xv, w, out=out)
    assert r.data_ptr() == out.data_ptr()
    assert torch.equal(out, ref), f"seed={seed}: strided x / out changed the result"
    assert torch.all(out_big[:, :8] == 7) and torch.all(out_big[:, 8 + N:] == 7), "wrote outside out"


def test_config_rule_depends_on_n_k_only():
    """Everything fixing the K reduction order is a function of (N, K); M moves only BLOCK_M & launch."""
    fixed = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "K_BLOCKS_PER_SPLIT")
    for N, K in SHAPES + [(48, 96), (32, 64)]:
        base = {k: gemm_config(1, N, K)[k] for k in fixed}
        for M in (2, 7, 64, 65, 128, 512, 1000, 4096):
            c = gemm_config(M, N, K)
            assert {k: c[k] for k in fixed} == base, (N, K, M)
            assert c["BLOCK_M"] in gemm.BLOCK_M_CHOICES
        c1 = gemm_config(1, N, K)
        if (N, K) in SHAPES:
            # the rule's decode grid fills the SMs (measured shapes may do better with fewer programs);
            # split-K workspace stays small
            if (N, K) not in gemm.MEASURED:
                assert c1["grid"] >= gemm.NUM_SMS, (N, K, c1)
            assert K % c1["BLOCK_K"] == 0
            assert gemm_config(4096, N, K)["workspace_bytes"] <= 32 << 20, (N, K)


def test_pin_block_m(monkeypatch):
    monkeypatch.setattr(gemm, "PIN_BLOCK_M", 64)
    assert {gemm_config(M, 2048, 8192)["BLOCK_M"] for M in (1, 64, 128, 512, 4096)} == {64}


def test_rejects_bad_inputs():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="w is"):
        linear(x, torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="dtype"):
        linear(x, torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(AssertionError, match="out is"):
        linear(x, torch.zeros(32, 64, dtype=torch.bfloat16), out=torch.empty(2, 31, dtype=torch.bfloat16))


def test_small_suite_in_interpreter_subprocess():
    if CAN_RUN_SMALL:
        pytest.skip("the small tests run in this process")
    run_in_interpreter(__file__, "(tests/test_kernels_gemm.py)")


# --------------------------------------------------------------------------------------------------
# GPU: the real shapes

_W: dict = {}


def _weight(N: int, K: int, dtype=torch.bfloat16) -> torch.Tensor:
    key = (N, K, dtype)
    if key not in _W:
        _W.clear()  # one weight at a time (LM heads are ~0.8 GB)
        g = torch.Generator(device="cuda").manual_seed(N * 7919 + K)
        _W[key] = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(dtype)
    return _W[key]


def _x(seed: int, M: int, K: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(M, K, generator=g, device="cuda").to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_gpu_matches_ref(seed, N, K):
    w = _weight(N, K)
    for M in (1, 8, 64, 128, 512):
        x = _x(seed + M, M, K)
        torch.testing.assert_close(linear(x, w), linear_ref(x, w), **TOL[torch.bfloat16],
                                   msg=lambda m: f"seed={seed} N={N} K={K} M={M} cfg={gemm_config(M, N, K)}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(3072, 2048), (2048, 8192), (16384, 2048), (128256, 2048)], ids=lambda v: str(v))
def test_gpu_matches_ref_fp16(seed, N, K):
    w = _weight(N, K, torch.float16)
    for M in (1, 64, 512):
        x = _x(seed + M, M, K, torch.float16)
        torch.testing.assert_close(linear(x, w), linear_ref(x, w), **TOL[torch.float16],
                                   msg=lambda m: f"seed={seed} N={N} K={K} M={M}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_gpu_batch_invariance(seed, N, K):
    """Rows of M in {1, 7, 64, 128, 512, 1000} results equal the M=512 result's rows and the rows alone.
    M=1..64 run BLOCK_M=64, M>64 BLOCK_M=128 (unless pinned), M=1000 runs split-K shapes in two chunks."""
    w = _weight(N, K)
    x = _x(seed, 1000, K)
    y_all = linear(x, w)
    for M in (1, 7, 64, 128, 512):
        y = linear(x[:M], w)
        bad = (y != y_all[:M]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (f"seed={seed} N={N} K={K}: rows {bad[:8]} of M={M} differ from M=1000 "
                         f"(BLOCK_M {gemm_config(M, N, K)['BLOCK_M']} vs {gemm_config(1000, N, K)['BLOCK_M']}); "
                         f"if only BLOCK_M differs, pin it: onepass.kernels.gemm.PIN_BLOCK_M = 64")
    for i, yi in _rows_alone(x, w, (0, 5, 63, 64, 127, 128, 511, 512, 999)).items():
        assert torch.equal(yi, y_all[i]), f"seed={seed} N={N} K={K}: row {i} alone differs from M=1000"
    # same row, other rows replaced by large values
    x2 = _x(seed + 1, 128, K) * 64
    x2[77] = x[3]
    assert torch.equal(linear(x2, w)[77], y_all[3]), f"seed={seed} N={N} K={K}: a row depends on its neighbours"


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_gpu_block_m_64_vs_128_bitwise(seed, N, K):
    """The rule switches BLOCK_M 64 -> 128 above M=64; both must give the same bits for every row."""
    w = _weight(N, K)
    x = _x(seed, 300, K)
    a = linear(x, w, config={"BLOCK_M": 64})
    b = linear(x, w, config={"BLOCK_M": 128})
    assert torch.equal(a, b), (f"seed={seed} N={N} K={K}: BLOCK_M 64 and 128 differ in "
                               f"{int((a != b).sum())} elements: pin onepass.kernels.gemm.PIN_BLOCK_M = 64 "
                               f"(or ONEPASS_GEMM_BLOCK_M=64)")


@pytest.mark.gpu
@pytest.mark.xfail(strict=False, reason="informational: BLOCK_M=16 (mma.sync) vs 64 (wgmma); the rule never uses 16")
@pytest.mark.parametrize("N,K", [(2048, 8192), (16384, 2048)], ids=lambda v: str(v))
def test_gpu_block_m_16_vs_64_bitwise(seed, N, K):
    w = _weight(N, K)
    x = _x(seed, 64, K)
    assert torch.equal(linear(x, w, config={"BLOCK_M": 16}), linear(x, w, config={"BLOCK_M": 64}))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(2048, 8192), (16384, 2048)], ids=lambda v: str(v))  # split-K, and not
def test_gpu_cuda_graph_out(seed, N, K):
    w = _weight(N, K)
    M = 8
    x = _x(seed, M, K)
    out = torch.empty(M, N, dtype=x.dtype, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        linear(x, w, out=out)        # compiles, sizes the split-K workspace
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_allocated()   # host-side allocator stats: fine during capture
        linear(x, w, out=out)
        after = torch.cuda.memory_allocated()
    assert after == before, f"linear(out=...) allocated {after - before} bytes during capture"
    for k in range(2):
        x.copy_(_x(seed + 1 + k, M, K))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear(x, w)), f"seed={seed} N={N} K={K}: replay {k} differs from eager"
