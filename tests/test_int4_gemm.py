"""kernels.quant_pack (GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 repacked for the kernel) and kernels.int4_gemm.w4a16_linear.

  * pack / unpack_ref: bit-exact against engine.quant.dequantize on random raw blocks (any finite fp16
    scale bit pattern, any quant bytes), the documented layout, row gathers / concatenation, sizes.
  * w4a16_linear vs w4a16_linear_ref on odd shapes (N not a multiple of BLOCK_N, K a multiple of the
    format's block but not of BLOCK_K), B = 1, 3, 17, forced tile / split-K configurations.
    Tolerance: outputs are scaled to ~N(0, 1) (x divided by sqrt(K) * rms(w)); the kernel and the fp32
    reference differ only in fp32 summation order (the weights are never rounded), so they agree to
    about one output ulp: |y - ref| <= atol + rtol * |ref| with (1e-2, 1e-2) for bf16, (4e-3, 4e-3) for
    fp16, as tests/test_kernels_gemm.py.
  * batch invariance, bitwise: every row of an M=17 (and M=70: another BLOCK_M) result equals the row
    computed alone, and does not depend on the other rows. Checked on the fp32 output (out=float32: the
    accumulator before rounding), where a change of reduction order shows; rounding to bf16 hides most
    (test_invariance_checks_have_teeth shows a different split-K changes the fp32 bits).
  * GPU (`gpu` marker): the issue's shapes 5120x17408, 17408x5120, 5120x12288, 4096x4096, 2048x8192 for
    every format, B = 1..256 vs the reference, batch invariance across M and BLOCK_M, CUDA-graph capture
    with out=.

Interpreter: as tests/test_kernels_gemm.py. Without CUDA and with triton not yet imported, this module
sets TRITON_INTERPRET=1 before importing the kernel; if triton was already imported without it, the
kernel tests skip here and `test_small_suite_in_interpreter_subprocess` re-runs this file in a child
process with the flag. Every run draws fresh random weights; the seed is printed and is part of every
failure message.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from hypothesis import given, settings, strategies as st

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onepass.kernels.errors import GGUFError  # noqa: E402
from onepass.engine.gguf_loader import unpermute_qk  # noqa: E402
from onepass.engine.quant import dequantize  # noqa: E402
from onepass.kernels.quant_pack import (FORMATS, PackedWeight, cat_rows, pack, packable, packed_nbytes,  # noqa: E402
                               unpack_folded, unpack_int, unpack_ref)
from onepass.kernels import int4_gemm  # noqa: E402  (after the interpreter flag)
from onepass.kernels.int4_gemm import int4_config, w4a16_linear, w4a16_linear_ref  # noqa: E402
from tests.interpreter import run_in_interpreter  # noqa: E402

try:
    from triton.runtime.errors import OutOfResources  # noqa: E402
except ImportError:   # no Triton: nothing raises it
    class OutOfResources(Exception):
        pass

ROOT = Path(__file__).resolve().parent.parent
DEV = "cuda" if ON_GPU else "cpu"
FMTS = ["q4_0", "q4_1", "q4_k", "q8_0"]
QTYPE = {v: k for k, v in FORMATS.items()}
SCALE_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q8_0": [0]}   # byte offsets of fp16 fields
TOL = {torch.bfloat16: dict(rtol=1e-2, atol=1e-2), torch.float16: dict(rtol=4e-3, atol=4e-3)}
# odd shapes: N=72 is not a multiple of BLOCK_N (64); K=160 is 5 groups (BLOCK_K 128 = 4 groups)
SMALL = {"q4_0": (72, 160), "q4_1": (72, 160), "q8_0": (72, 160), "q4_k": (72, 512)}


def random_raw(fmt: str, N: int, K: int, seed: int, wide: bool = False, device: str = "cpu") -> torch.Tensor:
    """Random GGUF bytes [N, bytes per row]: random quant bytes; fp16 scale fields finite. wide: any finite
    fp16 bit pattern (zeros, subnormals, +-65504); else moderate magnitudes (randn x 10^U(-0.5, 0.5))."""
    block, size = GGML_QUANT_SIZES[QTYPE[fmt]]
    g = torch.Generator(device=device).manual_seed(seed)
    nb = N * K // block
    raw = torch.randint(0, 256, (nb, size), generator=g, dtype=torch.uint8, device=device)
    for off in SCALE_FIELDS[fmt]:
        if wide:
            bits = torch.randint(-(1 << 15), 1 << 15, (nb,), generator=g, dtype=torch.int16, device=device)
            inf_nan = (bits & 0x7C00) == 0x7C00
            bits = torch.where(inf_nan, bits & ~0x4000, bits)          # exponent 31 -> 15: finite
            vals = bits.view(torch.float16)
        else:
            mag = 10 ** (torch.rand(nb, generator=g, device=device) - 0.5)
            vals = (torch.randn(nb, generator=g, device=device) * mag).half()
        raw[:, off:off + 2] = vals.view(torch.uint8).view(nb, 2)
    return raw.reshape(N, -1)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _weight(fmt: str, N: int, K: int, seed: int, device: str = DEV) -> tuple[PackedWeight, float]:
    """A random packed weight and the factor that makes x @ w^T ~ N(0, 1) for x ~ N(0, 1)."""
    pw = pack(random_raw(fmt, N, K, seed, device=device), QTYPE[fmt], (N, K))
    rms = unpack_ref(pw).pow(2).mean().sqrt().item()
    return pw, 1.0 / (K ** 0.5 * rms)


def _x(seed: int, M: int, K: int, scale: float, dtype=torch.bfloat16, device: str = DEV) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(M, K, generator=g, device=device) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------
# packing (plain torch: runs everywhere)

@pytest.mark.parametrize("fmt", FMTS)
def test_pack_unpack_bit_exact(seed, fmt):
    for i, (N, K) in enumerate([(1, 256), (7, 512), (13, 768), (64, 1024)]):
        raw = random_raw(fmt, N, K, seed + i, wide=True)
        pw = pack(raw, QTYPE[fmt], (N, K))
        ref = dequantize(raw, QTYPE[fmt], (N, K))
        got = unpack_ref(pw)
        assert got.dtype == torch.float32
        assert _bits_equal(got, ref), (f"seed={seed} {fmt} {N}x{K}: unpack_ref(pack(raw)) differs from dequantize "
                                       f"in {int((got.view(torch.int32) != ref.view(torch.int32)).sum())} elements")


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_pack_single_block_property(fmt, data):
    """Any block bytes with any finite fp16 scales round-trip exactly."""
    qt = QTYPE[fmt]
    block, size = GGML_QUANT_SIZES[qt]
    raw = bytearray(data.draw(st.binary(min_size=size, max_size=size)))
    f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
    for off in SCALE_FIELDS[fmt]:
        raw[off:off + 2] = torch.tensor([data.draw(f16)], dtype=torch.float16).view(torch.uint8).tolist()
    t = torch.tensor(list(raw), dtype=torch.uint8)
    assert _bits_equal(unpack_ref(pack(t, qt, (1, block))), dequantize(t, qt, (1, block)))


@pytest.mark.parametrize("fmt", FMTS)
def test_packed_layout(seed, fmt):
    """The layout the kernel reads (kernels/quant_pack.py docstring): shapes, dtypes, contiguity, where a
    given weight's bits sit, and that the fp16 fields are the file's bits."""
    N, K = 5, 512
    raw = random_raw(fmt, N, K, seed)
    pw = pack(raw, QTYPE[fmt], (N, K))
    G, W = K // 32, (8 if fmt == "q8_0" else 4)
    assert pw.qweight.dtype == torch.int32 and pw.qweight.shape == (G, N, W) and pw.qweight.is_contiguous()
    assert pw.scales.dtype == torch.float16 and pw.scales.is_contiguous()
    assert pw.scales.shape == ((K // 256, N) if fmt == "q4_k" else (G, N))
    assert (pw.mins is not None) == (fmt in ("q4_1", "q4_k")) and (pw.sub is not None) == (fmt == "q4_k")
    if pw.sub is not None:
        assert pw.sub.dtype == torch.uint8 and pw.sub.shape == (G, N, 2) and int(pw.sub.max()) < 64
    q = unpack_int(pw)
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF
    for n, k in [(0, 0), (1, 37), (4, K - 1), (2, 200)]:
        g, r = divmod(k, 32)
        if fmt == "q8_0":
            byte = (words[g, n, r // 4] >> (8 * (r % 4))) & 0xFF
            assert int(byte) - (256 if byte >= 128 else 0) == int(q[n, k])
        else:
            assert int((words[g, n, r // 8] >> (4 * (r % 8))) & 0xF) == int(q[n, k])
    # the integers are ggml's: ref = affine(q) per format, spot-checked through dequantize
    ref = dequantize(raw, QTYPE[fmt], (N, K))
    d0 = raw[0, 0:2].contiguous().view(torch.float16).float()
    if fmt == "q4_0":
        assert _bits_equal(ref[0, :32], d0 * (q[0, :32] - 8).float())
    if fmt == "q8_0":
        assert _bits_equal(ref[0, :32], q[0, :32].float() * d0)
    assert torch.equal(pw.scales[0, 0].view(torch.int16), raw[0, 0:2].contiguous().view(torch.int16)[0])


@pytest.mark.parametrize("fmt", FMTS)
def test_sizes_rows_and_device(seed, fmt):
    N, K = 12, 512
    raw = random_raw(fmt, N, K, seed)
    pw = pack(raw, QTYPE[fmt], (N, K))
    assert pw.nbytes == packed_nbytes(QTYPE[fmt], (N, K))
    assert pw.nbytes == (raw.numel() * 148 // 144 if fmt == "q4_k" else raw.numel())   # ~ file size
    w = unpack_ref(pw)
    idx = torch.tensor([11, 0, 3, 3, 5])
    assert torch.equal(unpack_ref(pw.select_rows(idx)), w[idx])
    two = cat_rows([pw, pw.select_rows(idx)])
    assert two.N == N + 5 and torch.equal(unpack_ref(two), torch.cat([w, w[idx]]))
    assert pw.to("cpu").nbytes == pw.nbytes and packable(QTYPE[fmt]) and packable(fmt)
    # the loader's llama q/k un-permute as a row gather on the packed weight
    n_head = 3 if N % 6 == 0 else 1
    perm = unpermute_qk(torch.arange(N).view(N, 1), n_head).view(-1)
    assert torch.equal(unpack_ref(pw.select_rows(perm)), unpermute_qk(w, n_head))
    if ON_GPU:
        g = pw.to("cuda")
        assert g.device.type == "cuda" and torch.equal(unpack_ref(g).cpu(), w)
        assert _bits_equal(unpack_ref(pack(raw.cuda(), QTYPE[fmt], (N, K))).cpu(), w)   # pack on the device


@pytest.mark.slow
def test_real_smollm2_tensors(smollm2_path):
    """The real SmolLM2 Q4_1 file (Q8_0 token_embd): the tensors of layers 0-1 and the embedding pack exactly
    (every projection format of the file; all layers take ~25 s on 2 cores), and the kernel matches the
    reference on two real projections."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(smollm2_path)
    picked = {}
    for t in reader.tensors:
        if not packable(t.tensor_type) or len(t.shape) != 2 or t.name.split(".")[1] not in ("0", "1", "weight"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8))
        pw = pack(raw, t.tensor_type, shape)
        assert pw.nbytes == raw.numel(), t.name
        assert _bits_equal(unpack_ref(pw), dequantize(raw, t.tensor_type, shape)), t.name
        if t.name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
            picked[t.name] = pw
    assert len(picked) == 2
    if not CAN_RUN_SMALL:
        return
    for name, pw in picked.items():
        x = _x(len(name), 3, pw.K, 1.0, device=DEV)
        _check(w4a16_linear(x, pw.to(DEV)), _ref(x, pw.to(DEV)), 0, name)


def test_pack_rejects_bad_input():
    raw = random_raw("q4_0", 4, 64, 0)
    with pytest.raises(GGUFError, match="needs"):
        pack(raw[:, :-1], QT.Q4_0, (4, 64))
    with pytest.raises(GGUFError, match="multiple"):
        pack(raw, QT.Q4_0, (8, 36))
    with pytest.raises(GGUFError, match="cannot stay quantized"):
        pack(raw, QT.Q6_K, (4, 256))
    with pytest.raises(TypeError):
        pack(raw.to(torch.int8), QT.Q4_0, (4, 64))
    assert not packable(QT.Q5_K) and not packable("F16")
    with pytest.raises(GGUFError, match="different formats"):
        cat_rows([pack(raw, QT.Q4_0, (4, 64)), pack(random_raw("q8_0", 4, 64, 0), QT.Q8_0, (4, 64))])


@pytest.mark.parametrize("fmt", FMTS)
def test_ref_is_the_dequantized_product(seed, fmt):
    N, K = SMALL[fmt]
    raw = random_raw(fmt, N, K, seed)
    pw = pack(raw, QTYPE[fmt], (N, K))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    w = dequantize(raw, QTYPE[fmt], (N, K))
    assert torch.equal(w4a16_linear_ref(x, pw, exact=True), (x.float() @ w.T).to(torch.bfloat16))
    assert torch.equal(w4a16_linear_ref(x, pw), (x.float() @ w.bfloat16().float().T).to(torch.bfloat16))


# --------------------------------------------------------------------------------------------------
# the kernel at small shapes: the interpreter on CPU, the compiled kernel on a GPU

def _small_runs_here() -> bool:
    if ON_GPU:
        return True
    if not int4_gemm._INTERPRETED:
        return False
    try:
        pw = pack(random_raw("q4_0", 1, 32, 0), QT.Q4_0, (1, 32))
        w4a16_linear(torch.ones(1, 32, dtype=torch.bfloat16), pw)
        return True
    except Exception:  # noqa: BLE001 - a real bug shows up in the subprocess test's output
        return False


CAN_RUN_SMALL = _small_runs_here()
small = pytest.mark.skipif(not CAN_RUN_SMALL, reason="triton was imported without TRITON_INTERPRET=1 and there "
                                                     "is no GPU; covered by the subprocess test")


def _ref(x, pw, config=None):
    """w4a16_linear_ref for the K loop the kernel runs at this configuration (FOLD: rounded weights; W16: the
    folded weights)."""
    cfg = {**int4_config(x.shape[0], pw.N, pw.K, pw.fmt), **(config or {})}
    if cfg["W16"]:
        return w4a16_linear_ref(x, pw, folded=True)
    return w4a16_linear_ref(x, pw, exact=not cfg["FOLD"])


def _check(y, ref, seed, what):
    torch.testing.assert_close(y, ref, **TOL[ref.dtype], msg=lambda m: f"seed={seed} {what}: {m}")


def _f32(x: torch.Tensor, pw: PackedWeight, **kw) -> torch.Tensor:
    """The kernel's fp32 result (out=float32: no final rounding)."""
    return w4a16_linear(x, pw, out=torch.empty(x.shape[0], pw.N, dtype=torch.float32, device=x.device), **kw)


def _rows_alone_equal(x, pw, y32, rows, seed, what, **kw):
    for i in rows:
        yi = _f32(x[i:i + 1], pw, **kw)[0]
        assert torch.equal(yi, y32[i]), (f"seed={seed} {what}: row {i} of M={x.shape[0]} differs from the row alone "
                                         f"in {int((yi != y32[i]).sum())} of {pw.N} fp32 outputs")


@small
@pytest.mark.parametrize("fmt", FMTS)
def test_matches_ref(seed, fmt):
    N, K = SMALL[fmt]
    pw, xs = _weight(fmt, N, K, seed)
    for M, dtype in [(1, torch.bfloat16), (3, torch.float16), (17, torch.bfloat16)]:
        x = _x(seed + M, M, K, xs, dtype)
        y = w4a16_linear(x, pw)
        assert y.shape == (M, N) and y.dtype == dtype
        _check(y, _ref(x, pw), seed, f"{fmt} M={M} N={N} K={K} {dtype}")
    # unrounded: the fp32 accumulator against the fp32 product, ~1e-6 relative (summation order only)
    for fold in (True, False):
        w = unpack_ref(pw) if not fold else unpack_ref(pw).to(x.dtype).float()
        torch.testing.assert_close(_f32(x, pw, config={"FOLD": fold}), x.float() @ w.T, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"seed={seed} {fmt} FOLD={fold} fp32 out: {m}")


# forced configurations: split-K (uneven last split, K tail), narrow tiles, every BLOCK_M, BLOCK_K > K
FORCED = [
    dict(SPLIT_K=2),                                 # 5 groups in blocks of 4 -> splits of 1 block each, tail masked
    dict(SPLIT_K=3, BLOCK_K=32, BLOCK_N=16),         # 5 blocks of 1 group -> splits of 2, 2, 1; 5 N tiles
    dict(BLOCK_K=96, BLOCK_N=32, FOLD=False),        # 3 groups per block: K tail for every format (Q4_K: 16 groups)
    dict(SPLIT_K=2, FOLD=False),                     # the group loop with split-K and a masked tail
    dict(BLOCK_K=128, BLOCK_N=16, SPLIT_K=2),        # FOLD's tail: a block of 4 groups with 1 valid
    dict(BLOCK_K=64, SPLIT_K=4, BLOCK_M=16),         # M=17 -> two M tiles
    dict(BLOCK_M=128, BLOCK_K=1024),                 # one (masked) block covering all of K
    dict(BLOCK_N=128, BLOCK_M=32, SPLIT_K=2),        # the wide tile, one N tile covering N=72
    dict(W16=True, SPLIT_K=2),                       # weights folded in 16 bits (unpack_folded), split-K, K tail
    dict(W16=True, BLOCK_K=64, BLOCK_N=16, BLOCK_M=16),
]


@small
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_forced_configs_match_ref_and_are_batch_invariant(seed, fmt, cfg):
    N, K = SMALL[fmt]
    M = 17
    pw, xs = _weight(fmt, N, K, seed)
    x = _x(seed, M, K, xs)
    if cfg.get("W16") and fmt == "q8_0":
        with pytest.raises(AssertionError, match="W16"):
            w4a16_linear(x, pw, config=cfg)
        return
    try:
        y = w4a16_linear(x, pw, config=cfg)
    except OutOfResources as e:   # a tile meant for the interpreter (BLOCK_K=1024 x BLOCK_M=128) on a real GPU
        assert x.is_cuda, e
        pytest.skip(f"{cfg} does not fit this GPU's shared memory ({e}); the interpreter runs it on the CPU")
    _check(y, _ref(x, pw, cfg), seed, f"{fmt} cfg={cfg}")
    y32 = _f32(x, pw, config=cfg)
    assert torch.equal(y32.to(y.dtype), y), f"seed={seed} {fmt} cfg={cfg}: fp32 out rounded != bf16 out"
    _rows_alone_equal(x, pw, y32, (0, 16), seed, f"{fmt} cfg={cfg}", config=cfg)


@small
@pytest.mark.parametrize("fmt", FMTS)
def test_batch_invariance(seed, fmt):
    """Rows of an M=17 result equal each row computed alone (M=1), and do not depend on the other rows."""
    N, K = SMALL[fmt]
    M = 17
    pw, xs = _weight(fmt, N, K, seed)
    x = _x(seed, M, K, xs)
    y = w4a16_linear(x, pw)
    y32 = _f32(x, pw)
    assert int4_config(M, N, K, fmt)["BLOCK_M"] != int4_config(1, N, K, fmt)["BLOCK_M"] or int4_gemm.PIN_BLOCK_M
    _rows_alone_equal(x, pw, y32, range(M), seed, fmt)
    for i in (0, 9):
        assert torch.equal(y[i], w4a16_linear(x[i:i + 1], pw)[0]), f"seed={seed} {fmt}: bf16 row {i} differs"
    x2 = _x(seed + 1, M, K, xs * 100)
    x2[5] = x[5]
    assert torch.equal(_f32(x2, pw)[5], y32[5]), f"seed={seed} {fmt}: row 5 depends on the other rows"


@small
@pytest.mark.parametrize("fmt", FMTS)
def test_invariance_checks_have_teeth(seed, fmt):
    """A changed K order (split-K 1 vs 2) does change fp32 outputs: the bitwise checks above would see an
    M-dependent reduction order. (In the group loop BLOCK_K alone does not change the order: groups are always
    ascending; FOLD sums whole K blocks, so there it does, and BLOCK_K comes from (N, K, fmt) alone.)"""
    N, K = SMALL[fmt]
    pw, xs = _weight(fmt, N, K, seed)
    x = _x(seed, 17, K, xs)
    a, b = _f32(x, pw, config=dict(SPLIT_K=1)), _f32(x, pw, config=dict(SPLIT_K=2, BLOCK_K=64))
    assert int((a != b).sum()) > N, f"seed={seed} {fmt}: split-K 1 and 2 agree bitwise in fp32 (no teeth)"
    exact = dict(SPLIT_K=1, FOLD=False)
    assert torch.equal(_f32(x, pw, config=exact), _f32(x, pw, config=dict(exact, BLOCK_K=64))), \
        f"seed={seed}: BLOCK_K changed the group loop's bits"


@small
def test_batch_invariance_across_block_m_and_split_chunks(seed, monkeypatch):
    """M=70 takes BLOCK_M=128, M=1 takes 16; split-K row chunks of 8: rows must not change."""
    fmt, (N, K) = "q4_1", SMALL["q4_1"]
    pw, xs = _weight(fmt, N, K, seed)
    x = _x(seed, 70, K, xs)
    assert int4_config(70, N, K, fmt)["BLOCK_M"] == 128 or int4_gemm.PIN_BLOCK_M
    _rows_alone_equal(x, pw, _f32(x, pw), (0, 63, 64, 69), seed, "M=70")
    cfg = dict(SPLIT_K=2, BLOCK_K=64)
    ys = _f32(x[:20], pw, config=cfg)
    monkeypatch.setattr(int4_gemm, "SPLITK_M_CHUNK", 8)
    assert torch.equal(ys, _f32(x[:20], pw, config=cfg)), f"seed={seed}: chunked split-K differs"


@small
def test_strided_views_and_out(seed):
    fmt, (N, K) = "q4_k", SMALL["q4_k"]
    M = 9
    pw, xs = _weight(fmt, N, K, seed)
    x = _x(seed, M, K, xs)
    ref = w4a16_linear(x, pw)
    big = torch.zeros(2 * M, 2 * K, dtype=x.dtype, device=x.device)
    big[::2, 3:3 + K] = x
    xv = big[::2, 3:3 + K]
    out_big = torch.full((M, N + 16), 7.0, dtype=x.dtype, device=x.device)
    out = out_big[:, 8:8 + N]
    r = w4a16_linear(xv, pw, out=out)
    assert r.data_ptr() == out.data_ptr()
    assert torch.equal(out, ref), f"seed={seed}: strided x / out changed the result"
    assert torch.all(out_big[:, :8] == 7) and torch.all(out_big[:, 8 + N:] == 7), "wrote outside out"


GPU_SHAPES = [(5120, 17408), (17408, 5120), (5120, 12288), (4096, 4096), (2048, 8192)]


def test_config_rule_depends_on_n_k_fmt_only():
    fixed = ("BLOCK_N", "BLOCK_K", "GPB", "SPLIT_K", "K_BLOCKS_PER_SPLIT", "DEQ_ASM")
    for N, K in GPU_SHAPES + [(72, 160), (72, 512), (151936, 2560)]:
        for fmt in FMTS:
            base = {k: int4_config(1, N, K, fmt)[k] for k in fixed}
            for M in (2, 7, 16, 17, 64, 65, 128, 256, 512, 1000):
                c = int4_config(M, N, K, fmt)
                assert {k: c[k] for k in fixed} == base, (N, K, fmt, M)
                assert c["BLOCK_M"] in int4_gemm.BLOCK_M_CHOICES and c["BLOCK_M"] >= min(M, 128)
            c1 = int4_config(1, N, K, fmt)
            if (N, K) in GPU_SHAPES:
                assert c1["grid"] >= int4_gemm.NUM_SMS and K % c1["BLOCK_K"] == 0, (N, K, c1)
                assert int4_config(4096, N, K, fmt)["workspace_bytes"] <= 64 << 20


def test_measured_table_overrides_rule(monkeypatch):
    rule = int4_config(200, 4096, 4096, "q4_0")
    monkeypatch.setitem(int4_gemm.MEASURED, (4096, 4096, "q4_0"),
                        {"BLOCK_N": 64, "SPLIT_K": 2, "MAX_BLOCK_M": 64, "num_warps": 8, "DEQ_ASM": False})
    int4_gemm.clear_config_cache()
    try:
        c = int4_config(200, 4096, 4096, "q4_0")
        assert (c["BLOCK_N"], c["SPLIT_K"], c["BLOCK_M"], c["BLOCK_K"], c["num_warps"], c["DEQ_ASM"]) == \
            (64, 2, 64, 128, 8, False)
        assert int4_config(200, 4096, 4096, "q4_1")["BLOCK_N"] == rule["BLOCK_N"]   # other formats: the rule
    finally:
        monkeypatch.undo()
        int4_gemm.clear_config_cache()
    assert int4_config(200, 4096, 4096, "q4_0") == rule


# --------------------------------------------------------------------------------------------------
# the GPU-only inline PTX (DEQ_ASM), checked on the CPU: its text through a small emulator, and the whole
# kernel compiled for sm_90a (ptxas included) by Triton's offline compiler

def _ptx_emulate(asm: str, r2: int, src: str = "$2", inputs: dict | None = None, exact: bool = True) -> dict:
    """Run the straight-line PTX subset _nibble_asm_text / _word_asm_text use, input r2 in
    register src (and `inputs`); returns the registers ($0, $1, ... among them). exact: every 16-bit fma result
    must be exact (else it is rounded to nearest even, as the hardware does)."""
    regs: dict[str, int] = {src: r2, **(inputs or {})}
    val = lambda t: regs[t] if t in regs else int(t, 0)  # noqa: E731

    def half_float(bits: int, f16: bool) -> float:
        t = torch.tensor([bits], dtype=torch.int32).to(torch.int16)
        return float(t.view(torch.float16 if f16 else torch.bfloat16).float())

    def float_half(v: float, f16: bool) -> int:
        t = torch.tensor([v], dtype=torch.float64).to(torch.float16 if f16 else torch.bfloat16)
        assert float(t) == v or not exact, f"not exact: {v}"
        return int(t.view(torch.int16)) & 0xFFFF

    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32" and a[0].startswith("{"):      # unpack: {lo, hi} = the two 16-bit halves
            regs[a[0].strip("{ ")], regs[a[1].strip("} ")] = val(a[2]) & 0xFFFF, (val(a[2]) >> 16) & 0xFFFF
            continue
        if op == "mov.b32":
            r = val(a[1])
        elif op == "shr.b32":
            r = (val(a[1]) & 0xFFFFFFFF) >> val(a[2])
        elif op == "prmt.b32":
            src = (val(a[1]) & 0xFFFFFFFF) | ((val(a[2]) & 0xFFFFFFFF) << 32)
            sel = val(a[3])
            r = 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                assert nib < 8, "sign-replicate selectors are not emulated"
                r |= ((src >> (8 * nib)) & 0xFF) << (8 * i)
        elif op == "lop3.b32":
            x, y, z, lut = (val(t) & 0xFFFFFFFF for t in a[1:5])
            r = 0
            for i in range(8):   # lut bit (4a + 2b + c) set -> that minterm
                if (lut >> i) & 1:
                    mx = x if i & 4 else ~x
                    my = y if i & 2 else ~y
                    mz = z if i & 1 else ~z
                    r |= mx & my & mz
            r &= 0xFFFFFFFF
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            f16 = op.endswith("f16x2") and "bf16" not in op
            x, y, z = (val(t) for t in a[1:4])
            r = 0
            for h in (0, 16):
                v = (half_float((x >> h) & 0xFFFF, f16) * half_float((y >> h) & 0xFFFF, f16)
                     + half_float((z >> h) & 0xFFFF, f16))
                r |= float_half(v, f16) << h
        else:
            raise AssertionError(f"unemulated instruction {op}")
        regs[a[0]] = r & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sub8", [False, True], ids=["q", "q-8"])
@pytest.mark.parametrize("high", [False, True], ids=["lo", "hi"])
def test_nibble_asm_text(seed, high, f16, sub8):
    """Element i (byte i of $2; outputs $0 = elements 0,1 and $1 = 2,3, element 0 in the low half) is the
    byte's low / high nibble q as the exact number q (- 8) in bf16 / fp16."""
    asm = int4_gemm._nibble_asm_text(high, f16, sub8)
    g = torch.Generator().manual_seed(seed)
    words = [0, 0xFFFFFFFF, 0x01234567, 0xFEDCBA98] + torch.randint(0, 1 << 32, (200,), generator=g).tolist()
    dt = torch.float16 if f16 else torch.bfloat16
    for w in words:
        regs = _ptx_emulate(asm, w)
        o0, o1 = regs["$0"], regs["$1"]
        got = torch.tensor([o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16], dtype=torch.int32).to(torch.int16).view(dt)
        nib = [((w >> (8 * i + (4 if high else 0))) & 0xF) - (8 if sub8 else 0) for i in range(4)]
        assert got.float().tolist() == [float(v) for v in nib], f"seed={seed} word={w:#010x}: {got.tolist()} != {nib}"


@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sub8", [False, True], ids=["q", "q-8"])
def test_word_asm_text_folded(seed, f16, sub8):
    """Output $s is nibble q_s of the word $8 folded with the group's scale $9 and offset $10 (16-bit, both halves):
    q_s * s + c rounded once to bf16 / fp16, i.e. kernels.quant_pack.unpack_folded's value."""
    asm = int4_gemm._word_asm_text(f16, sub8, fold=True)
    g = torch.Generator().manual_seed(seed)
    dt = torch.float16 if f16 else torch.bfloat16
    words = [0, 0xFFFFFFFF, 0x01234567] + torch.randint(0, 1 << 32, (100,), generator=g).tolist()
    for i, w in enumerate(words):
        s = (torch.randn(1, generator=g) * 0.01).to(dt)
        c = torch.zeros(1, dtype=dt) if sub8 and i % 2 else (torch.randn(1, generator=g) * 0.05).to(dt)
        pair = lambda t: (int(t.view(torch.int16)) & 0xFFFF) * 0x10001  # noqa: E731
        regs = _ptx_emulate(asm, w, "$8", {"$9": pair(s), "$10": pair(c)}, exact=False)
        got = torch.tensor([regs[f"${k}"] for k in range(8)], dtype=torch.int32).to(torch.int16).view(dt)
        q = torch.tensor([((w >> (4 * k)) & 0xF) - (8 if sub8 else 0) for k in range(8)], dtype=torch.float64)
        want = (q * s.double() + c.double()).to(dt)
        assert torch.equal(got, want), f"seed={seed} word={w:#010x} s={float(s)} c={float(c)}: {got} != {want}"


@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sub8", [False, True], ids=["q", "q-8"])
def test_word_asm_text(seed, f16, sub8):
    """Output $s (s = 0..7) is nibble s of the word $8 as the exact number q (- 8) in bf16 / fp16."""
    asm = int4_gemm._word_asm_text(f16, sub8)
    g = torch.Generator().manual_seed(seed)
    words = [0, 0xFFFFFFFF, 0x01234567, 0xFEDCBA98] + torch.randint(0, 1 << 32, (200,), generator=g).tolist()
    dt = torch.float16 if f16 else torch.bfloat16
    for w in words:
        regs = _ptx_emulate(asm, w, "$8")
        got = torch.tensor([regs[f"${s}"] for s in range(8)], dtype=torch.int32).to(torch.int16).view(dt)
        nib = [((w >> (4 * s)) & 0xF) - (8 if sub8 else 0) for s in range(8)]
        assert got.float().tolist() == [float(v) for v in nib], f"seed={seed} word={w:#010x}: {got.tolist()} != {nib}"


_AOT_SCRIPT = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onepass.kernels import int4_gemm as ig

def compile_one(fmt, BM, BN, nw, asm, xdt="bf16", even=True, ydt=None, fold=True, w16=False):
    k = ig._w4a16_kernel
    names = list(k.arg_names)
    ydt = ydt or xdt
    sig = {"x_ptr": f"*{xdt}", "qw_ptr": "*i32", "s_ptr": "*fp16", "c_ptr": "*fp16", "sub_ptr": "*u8",
           "y_ptr": f"*{ydt}", "M": "i32", "N": "i32", "G": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
           "stride_ym": "i32", "stride_yn": "constexpr", "stride_ys": "i32", "KB_PER_SPLIT": "i32"}
    consts = {"stride_xk": 1, "stride_yn": 1, "FMT": ig.FMT_CODE[fmt], "BLOCK_M": BM, "BLOCK_N": BN, "GPB": 4,
              "EVEN_K": even, "W_EVICT": "evict_first", "UPCAST": False, "RNE_BF16": False, "DEQ_ASM": asm,
              "X_F16": xdt == "fp16", "FOLD": fold, "W16": w16, "PDL": False}
    assert set(names) == set(sig) | set(consts), names
    for n in consts:
        sig.setdefault(n, "constexpr")
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("x_ptr", "qw_ptr", "s_ptr", "c_ptr", "sub_ptr", "y_ptr", "N", "G", "stride_xm", "stride_ym")}
    c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 64), options={"num_warps": nw, "num_stages": 3})
    return sorted(set(m.split(".")[0] + "." + m.split(".")[-1] for m in
                      re.findall(r"(?:wgmma\.mma_async|mma\.sync)[\w.]*?\.(?:m\d+n)", c.asm["ptx"])))

if sys.argv[1] == "probe":
    @triton.jit
    def _probe(x):
        triton.language.store(x, triton.language.load(x) + 1)
    triton.compile(ASTSource(fn=_probe, signature={"x": "*fp32"}), target=GPUTarget("cuda", 90, 64))
    print("PROBE_OK")
else:
    kinds = {}
    for fmt, BN, BM, nw, asm, xdt, even in [
            ("q4_0", 128, 16, 4, True, "bf16", True), ("q4_0", 128, 64, 8, True, "bf16", True),
            ("q4_1", 128, 32, 4, False, "bf16", True), ("q4_1", 128, 128, 8, False, "bf16", True),
            ("q4_k", 64, 16, 4, True, "fp16", False), ("q4_k", 64, 128, 4, True, "fp16", False),
            ("q8_0", 64, 16, 4, False, "bf16", False), ("q8_0", 64, 64, 4, False, "bf16", False)]:
        for fold in (True, False):
            kinds.setdefault((fmt, BN, fold), set()).add(tuple(compile_one(fmt, BM, BN, nw, asm, xdt, even,
                                                                           fold=fold)))
    compile_one("q4_k", 64, 32, 4, False, ydt="fp32")         # split-K partials (fp32 out)
    for fmt, xdt in (("q4_k", "bf16"), ("q4_0", "fp16"), ("q4_1", "bf16")):     # 16-bit folded weights
        kinds[(fmt, 64, "w16")] = {tuple(compile_one(fmt, BM, 64, 4, True, xdt, fold=True, w16=True))
                                   for BM in (16, 64, 128)}
    for key, ks in kinds.items():
        # every BLOCK_M of a shape lowers to the same MMA instruction family (the invariance premise)
        assert len(ks) == 1 and all(k and all("wgmma" in i for i in k) for k in ks), (key, ks)
    print("AOT_OK", kinds)
"""


def test_kernel_compiles_for_sm90(tmp_path):
    """Triton's offline compiler (no GPU needed) builds the kernel for sm_90a through ptxas in the variants
    the rule uses (4-bit with and without DEQ_ASM, the min-term formats, Q8_0, fp16 x, K tails, fp32
    split-K partials), and every BLOCK_M of a shape lowers to wgmma (the batch-invariance premise)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = tmp_path / "aot_int4.py"           # @jit needs a file
    script.write_text(_AOT_SCRIPT)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    run = lambda arg: subprocess.run([sys.executable, str(script), arg], cwd=ROOT, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=600)
    probe = run("probe")
    if "PROBE_OK" not in probe.stdout:
        pytest.skip(f"no offline CUDA compiler here: {probe.stderr.strip().splitlines()[-1:]}")
    r = run("kernels")
    assert r.returncode == 0 and "AOT_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def test_rejects_bad_inputs():
    pw = pack(random_raw("q4_0", 32, 64, 0), QT.Q4_0, (32, 64))
    with pytest.raises(AssertionError, match="weight is"):
        w4a16_linear(torch.zeros(2, 96, dtype=torch.bfloat16), pw)
    with pytest.raises(AssertionError, match="dtype"):
        w4a16_linear(torch.zeros(2, 64, dtype=torch.float32), pw)
    with pytest.raises(AssertionError, match="out is"):
        w4a16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), pw, out=torch.empty(2, 31, dtype=torch.bfloat16))


def test_small_suite_in_interpreter_subprocess():
    if CAN_RUN_SMALL:
        pytest.skip("the small tests run in this process")
    run_in_interpreter(__file__, "(tests/test_int4_gemm.py)")


# --------------------------------------------------------------------------------------------------
# GPU: the shapes

_W: dict = {}


def _gpu_weight(fmt: str, N: int, K: int) -> tuple[PackedWeight, float]:
    """A random packed weight on the GPU (packed there), cached one at a time with its fp32 decode."""
    key = (fmt, N, K)
    if key not in _W:
        _W.clear()
        pw, xs = _weight(fmt, N, K, N * 7919 + K * 31 + FMTS.index(fmt), device="cuda")
        _W[key] = (pw, xs, unpack_ref(pw))
    return _W[key][:2]


def _gpu_ref(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """w4a16_linear_ref with the cached fp32 weight (rounded to x's dtype for FOLD; unpack_folded's 16-bit values
    where the launch folds in 16-bit arithmetic, W16), TF32 off."""
    w = next(v[2] for v in _W.values() if v[0] is pw)
    cfg = int4_config(x.shape[0], pw.N, pw.K, pw.fmt)
    if cfg.get("W16"):
        w = unpack_folded(pw, x.dtype).to(x.device).float()
    elif cfg["FOLD"]:
        w = w.to(x.dtype).float()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return (x.float() @ w.T).to(x.dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


GPU_CASES = [(n, k, f) for n, k in GPU_SHAPES for f in FMTS]
_ids = lambda v: f"{v[0]}x{v[1]}-{v[2]}"  # noqa: E731


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1000, 1088, "q4_0"), (130, 1280, "q4_k"), (5120, 6144, "q4_k"),
                                  (2048, 8192, "q4_1")], ids=_ids)
def test_gpu_w16_matches_folded_ref_and_is_batch_invariant(seed, case):
    """W16 (the inline-PTX fold, one packed fma per pair) against x @ unpack_folded(w)^T, bf16 and fp16 x, and every
    row the same bits at every M (BLOCK_M 16..128, M-chunked split-K)."""
    N, K, fmt = case
    pw, xs = _gpu_weight(fmt, N, K)
    cfg = {"W16": True}
    for dt in (torch.bfloat16, torch.float16):
        x = _x(seed, 200, K, xs, dt, device="cuda")
        _check(w4a16_linear(x, pw, config=cfg), w4a16_linear_ref(x, pw, folded=True), seed, f"{fmt} {N}x{K} {dt} W16")
    x = _x(seed, 200, K, xs, device="cuda")
    y_all = _f32(x, pw, config=cfg)
    for M in (1, 7, 16, 33, 64, 129):
        assert torch.equal(_f32(x[:M], pw, config=cfg), y_all[:M]), \
            f"seed={seed} {fmt} {N}x{K}: W16 rows differ at M={M}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids)
def test_gpu_matches_ref(seed, case):
    N, K, fmt = case
    pw, xs = _gpu_weight(fmt, N, K)
    for M in (1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 100, 128, 129, 256):
        x = _x(seed + M, M, K, xs, device="cuda")
        _check(w4a16_linear(x, pw), _gpu_ref(x, pw), seed, f"{fmt} N={N} K={K} M={M} cfg={int4_config(M, N, K, fmt)}")
    x = _x(seed, 16, K, xs, torch.float16, device="cuda")
    _check(w4a16_linear(x, pw), _gpu_ref(x, pw), seed, f"{fmt} N={N} K={K} M=16 fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids)
def test_gpu_batch_invariance(seed, case):
    """Rows of every M in 1..256 equal the M=256 result's rows (BLOCK_M 16, 32, 64, 128 all taken) and the
    rows computed alone; a row does not depend on its neighbours."""
    N, K, fmt = case
    pw, xs = _gpu_weight(fmt, N, K)
    x = _x(seed, 256, K, xs, device="cuda")
    assert torch.equal(_f32(x, pw).to(x.dtype), w4a16_linear(x, pw))
    y_all = _f32(x, pw)                                  # fp32: every reduction-order change shows
    for M in (1, 2, 5, 16, 17, 32, 40, 64, 65, 128, 200):
        y = _f32(x[:M], pw)
        bad = (y != y_all[:M]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (f"seed={seed} {fmt} N={N} K={K}: rows {bad[:8]} of M={M} differ from M=256 (BLOCK_M "
                         f"{int4_config(M, N, K, fmt)['BLOCK_M']} vs {int4_config(256, N, K, fmt)['BLOCK_M']}); "
                         f"if only BLOCK_M differs, pin it: onepass.kernels.int4_gemm.PIN_BLOCK_M = 16")
    _rows_alone_equal(x, pw, y_all, (0, 5, 127, 128, 255), seed, f"{fmt} N={N} K={K}")
    x2 = _x(seed + 1, 64, K, xs * 64, device="cuda")
    x2[33] = x[3]
    assert torch.equal(_f32(x2, pw)[33], y_all[3]), f"seed={seed} {fmt} N={N} K={K}: neighbours matter"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(4096, 4096, "q4_0"), (2048, 8192, "q4_k"), (17408, 5120, "q4_1")], ids=_ids)
def test_gpu_block_m_bitwise(seed, case):
    """Every BLOCK_M gives the same bits for every row (the one hardware assumption of the invariance)."""
    N, K, fmt = case
    pw, xs = _gpu_weight(fmt, N, K)
    x = _x(seed, 150, K, xs, device="cuda")
    ys = {bm: _f32(x, pw, config={"BLOCK_M": bm}) for bm in int4_gemm.BLOCK_M_CHOICES}
    for bm, y in ys.items():
        assert torch.equal(y, ys[16]), (f"seed={seed} {fmt} N={N} K={K}: BLOCK_M {bm} differs from 16 in "
                                        f"{int((y != ys[16]).sum())} elements: pin kernels.int4_gemm.PIN_BLOCK_M")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(5120, 17408, "q4_0"), (17408, 5120, "q4_1"), (2048, 8192, "q4_k")], ids=_ids)
def test_gpu_deq_asm_matches_plain(seed, case):
    """The inline-PTX dequantization (DEQ_ASM) feeds the same exact integers to the same dot as the plain
    Triton one: bitwise equal fp32 results, bf16 and fp16 x. If this fails, set ONEPASS_INT4_DEQ_ASM=0."""
    N, K, fmt = case
    pw, xs = _gpu_weight(fmt, N, K)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (1, 37, 130):
            x = _x(seed + M, M, K, xs, dtype, device="cuda")
            a, b = _f32(x, pw, config={"DEQ_ASM": True}), _f32(x, pw, config={"DEQ_ASM": False})
            assert torch.equal(a, b), (f"seed={seed} {fmt} N={N} K={K} M={M} {dtype}: DEQ_ASM differs from the plain "
                                       f"dequantization in {int((a != b).sum())} elements: set ONEPASS_INT4_DEQ_ASM=0")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2048, 8192, "q4_k"), (34816, 5120, "q4_0"), (4096, 4096, "q8_0")], ids=_ids)
def test_gpu_cuda_graph_out(seed, case):
    N, K, fmt = case
    assert (int4_config(8, N, K, fmt)["SPLIT_K"] > 1) == (N != 34816)   # split-K and not (544 row tiles)
    pw, xs = _gpu_weight(fmt, N, K)
    M = 8
    x = _x(seed, M, K, xs, device="cuda")
    out = torch.empty(M, N, dtype=x.dtype, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w4a16_linear(x, pw, out=out)     # compiles, sizes the split-K workspace
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_allocated()
        w4a16_linear(x, pw, out=out)
        after = torch.cuda.memory_allocated()
    assert after == before, f"w4a16_linear(out=...) allocated {after - before} bytes during capture"
    for k in range(2):
        x.copy_(_x(seed + 1 + k, M, K, xs, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w4a16_linear(x, pw)), f"seed={seed} {fmt} N={N} K={K}: replay {k} differs from eager"
