"""Row-wise Triton kernels (RMSNorm, fused add+RMSNorm, RoPE + q/k norm + KV write, SwiGLU, embedding)
against their torch references in the same files.

Where the kernels run:
* CUDA available: every test runs on the GPU (the small ones too); `gpu` tests add full model shapes
  and CUDA-graph capture + replay.
* CPU only: Triton decides when a kernel is decorated (when kernels.* is imported, possibly by another
  test module first) whether it is compiled or run by its CPU interpreter (TRITON_INTERPRET=1), and the
  choice cannot be changed later in the process. So:
  - with TRITON_INTERPRET=1 already set (`TRITON_INTERPRET=1 pytest tests/test_kernels_elementwise.py`)
    the kernel tests run in-process, one report per test;
  - otherwise (plain `pytest`, CI on CPU) they are skipped in-process and
    `test_cpu_kernels_in_interpreter_subprocess` reruns this file in a child pytest with
    TRITON_INTERPRET=1, failing with the child's output if anything fails or is skipped there.

Exactness: copies (embedding, the V write), the fp32 residual add and fp32 RoPE without a norm are
compared bitwise; bf16 results bitwise only on the GPU (the interpreter truncates fp32 -> bf16 where
the GPU rounds to nearest even), otherwise within 1 bf16 ulp. Norm results differ from torch in the
reduction order / rsqrt: fp32 within 1e-5 relative, bf16 within 1 ulp (2 ulps of the row's largest
element when a bf16-rounded norm feeds RoPE). Batch invariance (a row alone == the same row in a
batch) is always bitwise.

Inputs are fresh random every run: the seed comes from os.urandom (KERNEL_TEST_SEED=<n> replays one)
and is printed in every failure message.
"""
from __future__ import annotations


import pytest
import torch

from onepass.kernels.embedding import embedding_ref, embedding_triton
from onepass.kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from onepass.kernels.rope import (apply_rope_ref, rope_cache, rope_cos_sin, rope_inv_freq, rope_kv_write_ref,
                          rope_kv_write_triton)
from onepass.kernels.swiglu import swiglu_fused_ref, swiglu_ref, swiglu_triton
from tests.interpreter import run_in_interpreter

from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, SEED, _gen, _msg, _randn, needs_kernel
BF16_EXACT = not INTERPRET



def _randn_dev(salt, *shape, dtype=torch.bfloat16):
    """Large random tensors drawn on the device (embedding tables on the GPU)."""
    gd = torch.Generator(device=DEV).manual_seed(SEED * 1000 + salt)
    return torch.randn(*shape, generator=gd, device=DEV, dtype=torch.float32).to(dtype)


def _exact(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, _msg(f"{what}: {a.dtype}{tuple(a.shape)} vs "
                                                           f"{b.dtype}{tuple(b.shape)}")
    bad = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
    assert not bool(bad.any()), _msg(f"{what}: {int(bad.sum())} elements differ, max |diff| "
                                     f"{(a.float() - b.float()).abs().max().item():.3g}")


def _close(a, b, what, ulps=1.0, row_scale=False):
    """fp32: 1e-5 relative; bf16/fp16: `ulps` units in the last place (relative), or of the row's
    largest element when row_scale (for results that went through cancellation)."""
    assert a.dtype == b.dtype and a.shape == b.shape, _msg(f"{what}: {a.dtype}{tuple(a.shape)} vs "
                                                           f"{b.dtype}{tuple(b.shape)}")
    af, bf = a.float(), b.float()
    if a.dtype == torch.float32:
        rtol, atol = 1e-5, 1e-5
    else:
        rtol = ulps * (2.0 ** -7 if a.dtype == torch.bfloat16 else 2.0 ** -10)
        atol = 1e-6
    tol = atol + rtol * (bf.abs().amax(dim=-1, keepdim=True) if row_scale else bf.abs())
    err = (af - bf).abs()
    bad = err > tol
    assert not bool(bad.any()), _msg(f"{what}: {int(bad.sum())} / {bad.numel()} elements off, max |diff| "
                                     f"{err.max().item():.3g}")


def _same_or_close(a, b, what, **kw):
    """Bitwise where the arithmetic is identical to torch's; bf16 on the interpreter only within 1 ulp."""
    if a.dtype == torch.float32 or BF16_EXACT:
        _exact(a, b, what)
    else:
        _close(a, b, what, **kw)


# ------------------------------------------------------------------------------------------------
# pure torch: the references agree with the model's own ops (runs everywhere, no kernel)

def test_references_agree_with_model_ops():
    g = _gen(1)
    R, nh, kvh, D = 5, 4, 2, 16
    qkv = torch.randn(R, (nh + 2 * kvh) * D, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 40, (R,), generator=g)
    slots = torch.randperm(R, generator=g)
    inv = rope_inv_freq(D, 10000.0)
    qn, kn = torch.randn(D, generator=g), torch.randn(D, generator=g)
    k_cache = torch.zeros(R, 40, kvh, D, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = rope_kv_write_ref(qkv, positions, slots, rope_cache(inv, 40), k_cache, v_cache, nh, kvh, D,
                          q_norm=qn, k_norm=kn, eps=1e-6)
    # the model's path (engine/models/llama.py + qwen3.py): view, per-head norm, rope_cos_sin, apply_rope_ref
    cos, sin = rope_cos_sin(positions, inv)
    q_m = apply_rope_ref(rms_norm_ref(qkv[:, : nh * D].view(R, nh, D), qn, 1e-6), cos, sin)
    k_m = apply_rope_ref(rms_norm_ref(qkv[:, nh * D: (nh + kvh) * D].view(R, kvh, D), kn, 1e-6), cos, sin)
    _exact(q, q_m, "q")
    _exact(k_cache[slots, positions], k_m, "k written")
    _exact(v_cache[slots, positions], qkv[:, (nh + kvh) * D:].view(R, kvh, D), "v written")
    gu = torch.randn(3, 40, generator=g)
    _exact(swiglu_fused_ref(gu), swiglu_ref(gu[:, :20], gu[:, 20:]), "swiglu_fused_ref")
    x, res, w = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16(), torch.randn(32)
    normed, new_res = add_rms_norm_ref(x, res, w, 1e-5)
    _exact(new_res, res + x, "add_rms_norm_ref residual")
    _exact(normed, rms_norm_ref(res + x, w, 1e-5), "add_rms_norm_ref normed")


# ------------------------------------------------------------------------------------------------
# RMSNorm

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96])
def test_rms_norm(dtype, D):
    g = _gen(10 + D)
    x = _randn(g, 7, D, dtype=dtype, scale=3.0)
    w = _randn(g, D)
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), "rms_norm")
    out = torch.empty_like(x)
    assert rms_norm_triton(x, w, 1e-6, out=out) is out
    _close(out, rms_norm_ref(x, w, 1e-6), "rms_norm out=")
    _exact(rms_norm_triton(x[2], w, 1e-6), out[2], "1-D input")
    # batch invariance: each row alone, and the batch reversed
    for r in range(x.shape[0]):
        _exact(rms_norm_triton(x[r: r + 1], w, 1e-6), out[r: r + 1], f"row {r} alone")
    _exact(rms_norm_triton(x.flip(0), w, 1e-6), out.flip(0), "reversed batch")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_strided(dtype):
    """Qwen3 q/k norm on a strided [R, heads, head_dim] view of a fused qkv row."""
    g = _gen(20)
    R, nh, kvh, D = 5, 4, 2, 32
    qkv = _randn(g, R, (nh + 2 * kvh) * D, dtype=dtype)
    w = _randn(g, D)
    q = qkv[:, : nh * D].view(R, nh, D)
    k = qkv[:, nh * D: (nh + kvh) * D].view(R, kvh, D)
    for name, t in (("q", q), ("k", k)):
        out = rms_norm_triton(t, w, 1e-6)
        _close(out, rms_norm_ref(t, w, 1e-6), f"per-head {name}")
        out2 = torch.empty(R, t.shape[1] * 2, D, dtype=dtype, device=DEV)[:, ::2]  # a strided out
        rms_norm_triton(t, w, 1e-6, out=out2)
        _exact(out2, out, f"strided out {name}")


@needs_kernel
@pytest.mark.parametrize("dtype,res_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_add_rms_norm(dtype, res_dtype):
    g = _gen(30)
    R, D = 6, 80
    x = _randn(g, R, D, dtype=dtype, scale=2.0)
    res0 = _randn(g, R, D, dtype=res_dtype, scale=4.0)
    w = _randn(g, D)
    normed_ref, res_ref = add_rms_norm_ref(x, res0, w, 1e-5)
    res = res0.clone()
    out = torch.empty_like(x)
    normed, res_ret = add_rms_norm_triton(x, res, w, 1e-5, out=out)
    assert normed is out and res_ret is res
    _same_or_close(res, res_ref, "residual += x")
    # normed against the reference norm of the kernel's own residual (the interpreter's bf16 residual may
    # sit 1 ulp off torch's), and against the end-to-end reference where the residuals agree
    _close(normed, rms_norm_ref(res, w, 1e-5).to(dtype), "normed")
    if torch.equal(res, res_ref):
        _close(normed, normed_ref, "normed (end to end)")
    # batch invariance: row r alone (residual row r alone) is bitwise the batched result
    for r in range(R):
        res_r = res0[r: r + 1].clone()
        n_r, _ = add_rms_norm_triton(x[r: r + 1], res_r, w, 1e-5)
        _exact(res_r, res[r: r + 1], f"row {r} residual alone")
        _exact(n_r, normed[r: r + 1], f"row {r} normed alone")


@needs_kernel
@pytest.mark.parametrize("dtype,res_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("D,chunk", [(200, 64), (256, 64), (5120, 512)])
def test_rms_norm_chunked(dtype, res_dtype, D, chunk, monkeypatch):
    """Rows wider than ROW_MAX_D: one program per chunk of a row, the last to arrive normalizing the row. Against the
    references, with and without a residual, D a multiple of the chunk or not; run twice (the per-row tickets must
    be left at zero); each row alone bitwise the batched row."""
    from onepass.kernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "ROW_MAX_D", min(rmsnorm.ROW_MAX_D, D - 1))
    monkeypatch.setattr(rmsnorm, "CHUNK", chunk)
    g = _gen(40 + D)
    R = 5
    x = _randn(g, R, D, dtype=dtype, scale=2.0)
    res0 = _randn(g, R, D, dtype=res_dtype, scale=4.0)
    w = _randn(g, D)
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), "rms_norm chunked")
    first = rms_norm_triton(x, w, 1e-6)
    _exact(rms_norm_triton(x, w, 1e-6), first, "rms_norm chunked, second launch")
    res = res0.clone()
    normed, _ = add_rms_norm_triton(x, res, w, 1e-5)
    _, res_ref = add_rms_norm_ref(x, res0, w, 1e-5)
    _same_or_close(res, res_ref, "chunked residual += x")
    _close(normed, rms_norm_ref(res, w, 1e-5).to(dtype), "chunked normed")
    for r in (0, R - 1):
        res_r = res0[r: r + 1].clone()
        n_r, _ = add_rms_norm_triton(x[r: r + 1], res_r, w, 1e-5)
        _exact(res_r, res[r: r + 1], f"row {r} residual alone")
        _exact(n_r, normed[r: r + 1], f"row {r} normed alone")
        _exact(rms_norm_triton(x[r: r + 1], w, 1e-6), first[r: r + 1], f"row {r} rms_norm alone")


# ------------------------------------------------------------------------------------------------
# SwiGLU

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F", [48, 1100])
def test_swiglu(dtype, F):
    g = _gen(40 + F)
    R = 3
    gu = _randn(g, R, 2 * F, dtype=dtype, scale=4.0)
    ref = swiglu_fused_ref(gu)
    out = torch.empty(R, F, dtype=dtype, device=DEV)
    assert swiglu_triton(gu, out=out) is out
    _close(out, ref, "swiglu")
    for r in range(R):
        _exact(swiglu_triton(gu[r: r + 1]), out[r: r + 1], f"row {r} alone")
    wide = _randn(g, R, 2 * F + 8, dtype=dtype)[:, : 2 * F]  # row stride != 2F
    _close(swiglu_triton(wide), swiglu_fused_ref(wide), "strided rows")


# ------------------------------------------------------------------------------------------------
# Embedding

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding(dtype, id_dtype):
    g = _gen(50)
    V, D = 37, 1100
    table = _randn(g, V, D, dtype=dtype)
    ids = torch.randint(0, V, (9,), generator=g, dtype=id_dtype)
    ids[:3] = torch.tensor([0, V - 1, 0])
    ids = ids.to(DEV)
    _exact(embedding_triton(ids, table), embedding_ref(ids, table), "embedding")
    out = torch.empty(9, D, dtype=dtype, device=DEV)
    assert embedding_triton(ids, table, out=out) is out
    _exact(out, embedding_ref(ids, table), "embedding out=")
    _exact(embedding_triton(ids.view(3, 3), table), embedding_ref(ids, table).view(3, 3, D), "2-D ids")


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k", "q8_0"])
def test_embedding_packed_is_the_dense_table(fmt):
    """A packed table's gather (the file's bytes kept, each row decoded on the fly): bitwise the rows of the dense
    table the loader makes (unpack_ref rounded once to the model's dtype), fp32 rows when no out is given, any id
    shape; bad ids' dtype and out shapes refused."""
    from onepass.kernels.quant_pack import unpack_ref
    from onepass.harness.int4_bench import random_packed

    g = _gen(51)
    V, D = 37, 512
    pw = random_packed(fmt, V, D, SEED % 1000, DEV)
    dense32 = unpack_ref(pw)
    ids = torch.randint(0, V, (9,), generator=g)
    ids[:3] = torch.tensor([0, V - 1, 0])
    ids = ids.to(DEV)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(9, D, dtype=dtype, device=DEV)
        assert embedding_triton(ids, pw, out=out) is out
        _exact(out, dense32.to(dtype)[ids.long()], f"{fmt} {dtype} rows")
        _exact(out, embedding_ref(ids, pw).to(dtype), f"{fmt} {dtype} against the reference")
    _exact(embedding_triton(ids.int(), pw), dense32[ids.long()], f"{fmt} fp32 rows")
    _exact(embedding_triton(ids.view(3, 3), pw), dense32[ids.long()].view(3, 3, D), f"{fmt} 2-D ids")
    with pytest.raises(ValueError, match="int32 or int64"):
        embedding_triton(ids.float(), pw)
    with pytest.raises(ValueError, match="out shape"):
        embedding_triton(ids, pw, out=torch.empty(8, D, device=DEV))


# ------------------------------------------------------------------------------------------------
# RoPE + q/k norm + KV write

def _rope_case(g, R, nh, kvh, D, dtype, paged, n_slots=6, ctx=48, block_size=8, pad_row=True, max_pos=64):
    """Rows at distinct (slot, position) pairs: random ones plus a prefill-like run of consecutive
    positions of one slot, and a padding row (slot -1). Caches hold random garbage (must stay untouched
    where nothing is written); paged caches use a shuffled block table over a pool with spare blocks."""
    pairs = set()
    run_slot = int(torch.randint(0, n_slots, (1,), generator=g))
    start = int(torch.randint(0, ctx - 4, (1,), generator=g))
    rows = [(run_slot, start + i) for i in range(min(4, R))]
    pairs.update(rows)
    while len(rows) < R:
        pr = (int(torch.randint(0, n_slots, (1,), generator=g)), int(torch.randint(0, ctx, (1,), generator=g)))
        if pr not in pairs:
            pairs.add(pr)
            rows.append(pr)
    if pad_row and R > 1:
        rows[-1] = (-1, rows[-1][1])
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32).to(DEV)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64).to(DEV)
    qkv = _randn(g, R, (nh + 2 * kvh) * D, dtype=dtype, scale=2.0)
    cs = rope_cache(rope_inv_freq(D, 10000.0), max_pos).to(DEV)
    if paged:
        nb = ctx // block_size
        total = n_slots * nb + 3
        block_table = torch.randperm(total, generator=g)[: n_slots * nb].view(n_slots, nb).to(torch.int32).to(DEV)
        shape = (total, block_size, kvh, D)
    else:
        block_table = None
        shape = (n_slots, ctx, kvh, D)
    k_cache, v_cache = _randn(g, *shape, dtype=dtype), _randn(g, *shape, dtype=dtype)
    return qkv, positions, slots, cs, k_cache, v_cache, block_table


def _run_rope(fn, case, nh, kvh, D, qn, kn, q_out=None):
    qkv, positions, slots, cs, k_cache, v_cache, bt = case
    k_c, v_c = k_cache.clone(), v_cache.clone()
    kw = {} if q_out is None else {"q_out": q_out}
    q = fn(qkv, positions, slots, cs, k_c, v_c, nh, kvh, D, q_norm=qn, k_norm=kn, eps=1e-6, block_table=bt, **kw)
    return q, k_c, v_c


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qknorm"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("D", [16, 64])
def test_rope_kv_write(dtype, qk_norm, paged, D):
    g = _gen(60 + D + 2 * qk_norm + paged)
    R, nh, kvh = 9, 4, 2
    case = _rope_case(g, R, nh, kvh, D, dtype, paged)
    qn = _randn(g, D) if qk_norm else None
    kn = _randn(g, D) if qk_norm else None
    q_out = torch.empty(R, nh, D, dtype=dtype, device=DEV)
    q, k_c, v_c = _run_rope(rope_kv_write_triton, case, nh, kvh, D, qn, kn, q_out=q_out)
    q_r, k_r, v_r = _run_rope(rope_kv_write_ref, case, nh, kvh, D, qn, kn)
    assert q is q_out
    _exact(v_c, v_r, "v cache (plain copy; everything else untouched)")
    if qk_norm:
        _close(q, q_r, "q", ulps=2, row_scale=True)
        _close(k_c, k_r, "k cache", ulps=2, row_scale=True)
    else:  # same fp32 ops as torch (no FMA contraction): bitwise
        _same_or_close(q, q_r, "q", ulps=1, row_scale=True)
        _same_or_close(k_c, k_r, "k cache", ulps=1, row_scale=True)
    # batch invariance: every row alone gives bitwise the same q and cache writes
    qkv, positions, slots, cs, k_cache, v_cache, bt = case
    k_1, v_1 = k_cache.clone(), v_cache.clone()
    for r in range(R):
        q_1 = rope_kv_write_triton(qkv[r: r + 1], positions[r: r + 1], slots[r: r + 1], cs, k_1, v_1, nh, kvh, D,
                                   q_norm=qn, k_norm=kn, eps=1e-6, block_table=bt)
        _exact(q_1, q[r: r + 1], f"row {r} alone: q")
    _exact(k_1, k_c, "rows alone: k cache")
    _exact(v_1, v_c, "rows alone: v cache")


@needs_kernel
def test_rope_kv_write_int32_positions_and_strided_q_out():
    g = _gen(70)
    R, nh, kvh, D = 5, 2, 1, 32
    case = _rope_case(g, R, nh, kvh, D, torch.float32, paged=False, pad_row=False)
    q_ref, k_ref, v_ref = _run_rope(rope_kv_write_triton, case, nh, kvh, D, None, None)
    qkv, positions, slots, cs, k_cache, v_cache, bt = case
    case32 = (qkv, positions.to(torch.int32), slots.to(torch.int64), cs, k_cache, v_cache, bt)
    q_out = torch.empty(R, nh + 1, D, device=DEV)[:, :nh]  # strided q_out
    q, k_c, v_c = _run_rope(rope_kv_write_triton, case32, nh, kvh, D, None, None, q_out=q_out)
    _exact(q, q_ref, "q with int32 positions into a strided q_out")
    _exact(k_c, k_ref, "k")
    _exact(v_c, v_ref, "v")


# ------------------------------------------------------------------------------------------------
# CPU: run the kernel tests above in the Triton interpreter, in a child process

@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in this process")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), KERNEL_TEST_SEED=str(SEED))


# ------------------------------------------------------------------------------------------------
# GPU: full model shapes, bf16, CUDA graphs

GPU_MODELS = {  # dim, n_heads, kv_heads, head_dim, ffn, vocab
    "llama3.2-1b": (2048, 32, 8, 64, 8192, 128256),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, 151936),
    "qwen3-4b": (2560, 32, 8, 128, 9728, 151936),
    "hd256": (2560, 16, 4, 256, 8192, 151936),
    "qwen3.8-27b": (5120, 24, 4, 256, 17408, 248320),   # rows wider than ROW_MAX_D: the chunked norm
}
GPU_ROWS = [1, 128, 512]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128256, 2048, "q4_0"), (49152, 576, "q8_0"), (151936, 2560, "q4_1"),
                                   (248320, 5120, "q4_k")], ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}")
@pytest.mark.parametrize("R", GPU_ROWS)
def test_gpu_embedding_packed(shape, R):
    """The packed gather at model vocabularies (ids across the whole table, repeats), bitwise the reference's rows
    rounded to bf16, and inside a CUDA graph."""
    from onepass.harness.int4_bench import random_packed

    V, D, fmt = shape
    pw = random_packed(fmt, V, D, 7, torch.device("cuda"))
    g = _gen(200 + R)
    ids = torch.randint(0, V, (R,), generator=g)
    ids[: min(R, 3)] = torch.tensor([0, V - 1, 0])[: min(R, 3)]
    ids = ids.cuda()
    want = embedding_ref(ids, pw).to(torch.bfloat16)
    out = torch.empty(R, D, dtype=torch.bfloat16, device="cuda")
    _exact(embedding_triton(ids, pw, out=out), want, f"{shape} R={R}")
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        embedding_triton(ids, pw, out=out)
    graph.replay()
    torch.cuda.synchronize()
    _exact(out, want, f"{shape} R={R} graphed")


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_MODELS))
@pytest.mark.parametrize("R", GPU_ROWS)
def test_gpu_norms_swiglu_embedding(model, R):
    dim, _, _, _, ffn, vocab = GPU_MODELS[model]
    g = _gen(100 + R)
    x = _randn(g, R, dim, dtype=torch.bfloat16, scale=2.0)
    res0 = _randn(g, R, dim, dtype=torch.bfloat16, scale=4.0)
    w = _randn(g, dim, dtype=torch.bfloat16)
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), "rms_norm")
    res = res0.clone()
    normed, _ = add_rms_norm_triton(x, res, w, 1e-6)
    n_ref, r_ref = add_rms_norm_ref(x, res0, w, 1e-6)
    _exact(res, r_ref, "residual")
    _close(normed, n_ref, "add_rms_norm")
    res_1 = res0[:1].clone()
    _exact(add_rms_norm_triton(x[:1], res_1, w, 1e-6)[0], normed[:1], "row 0 alone")
    gu = _randn(g, R, 2 * ffn, dtype=torch.bfloat16, scale=3.0)
    act = swiglu_triton(gu)
    _close(act, swiglu_fused_ref(gu), "swiglu")
    _exact(swiglu_triton(gu[-1:]), act[-1:], "swiglu last row alone")
    table = _randn_dev(101, vocab, dim)
    ids = torch.randint(0, vocab, (R,), generator=g).to(DEV)
    _exact(embedding_triton(ids, table), embedding_ref(ids, table), "embedding")


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_MODELS))
@pytest.mark.parametrize("R", GPU_ROWS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qknorm"])
def test_gpu_rope_kv_write(model, R, paged, qk_norm):
    _, nh, kvh, D, _, _ = GPU_MODELS[model]
    g = _gen(200 + R + paged)
    case = _rope_case(g, R, nh, kvh, D, torch.bfloat16, paged, n_slots=max(8, R // 4), ctx=256, block_size=16,
                      max_pos=4096)
    qn = _randn(g, D, dtype=torch.bfloat16) if qk_norm else None
    kn = _randn(g, D, dtype=torch.bfloat16) if qk_norm else None
    q, k_c, v_c = _run_rope(rope_kv_write_triton, case, nh, kvh, D, qn, kn)
    q_r, k_r, v_r = _run_rope(rope_kv_write_ref, case, nh, kvh, D, qn, kn)
    _exact(v_c, v_r, "v cache")
    _close(q, q_r, "q", ulps=2, row_scale=True)
    _close(k_c, k_r, "k cache", ulps=2, row_scale=True)
    qkv, positions, slots, cs, k_cache, v_cache, bt = case
    k_1, v_1 = k_cache.clone(), v_cache.clone()
    q_1 = rope_kv_write_triton(qkv[:1], positions[:1], slots[:1], cs, k_1, v_1, nh, kvh, D, q_norm=qn, k_norm=kn,
                               eps=1e-6, block_table=bt)
    _exact(q_1, q[:1], "row 0 alone")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_cuda_graph_replay(paged):
    """embedding -> rms_norm -> rope/KV write (Qwen3 norms) -> swiglu -> add_rms_norm captured once on
    static buffers, replayed with new ids / positions / slots / activations copied in: each replay equals
    the eager calls on the same inputs."""
    dim, nh, kvh, D, ffn, vocab = GPU_MODELS["qwen3-1.7b"]
    R = 64
    g = _gen(300 + paged)
    case = _rope_case(g, R, nh, kvh, D, torch.bfloat16, paged, n_slots=R, ctx=256, block_size=16, max_pos=1024)
    qkv, positions, slots, cs, k_cache, v_cache, bt = case
    table, w = _randn_dev(301, vocab, dim), _randn(g, dim, dtype=torch.bfloat16)
    qn, kn = _randn(g, D, dtype=torch.bfloat16), _randn(g, D, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (R,), generator=g).to(DEV)
    gu, x = _randn(g, R, 2 * ffn, dtype=torch.bfloat16), _randn(g, R, dim, dtype=torch.bfloat16)
    e = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device=DEV)  # noqa: E731
    res, h, q, act, h2 = e(R, dim), e(R, dim), e(R, nh, D), e(R, ffn), e(R, dim)

    def step(kc, vc):
        embedding_triton(ids, table, out=res)
        rms_norm_triton(res, w, 1e-6, out=h)
        rope_kv_write_triton(qkv, positions, slots, cs, kc, vc, nh, kvh, D, q_norm=qn, k_norm=kn, eps=1e-6,
                             block_table=bt, q_out=q)
        swiglu_triton(gu, out=act)
        add_rms_norm_triton(x, res, w, 1e-6, out=h2)

    k_g, v_g = k_cache.clone(), v_cache.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(k_g, v_g)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(k_g, v_g)
    for it in range(3):
        ids.copy_(torch.randint(0, vocab, (R,), generator=g).to(DEV))
        qkv.copy_(_randn(g, *qkv.shape, dtype=torch.bfloat16))
        positions.copy_(torch.randint(0, 256, (R,), generator=g).to(DEV))
        slots.copy_(torch.randperm(R, generator=g).to(torch.int32).to(DEV))
        gu.copy_(_randn(g, *gu.shape, dtype=torch.bfloat16))
        x.copy_(_randn(g, *x.shape, dtype=torch.bfloat16))
        k_e, v_e = k_g.clone(), v_g.clone()
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in (res, h, q, act, h2, k_g, v_g)]
        step(k_e, v_e)
        want = [res, h, q, act, h2, k_e, v_e]
        for name, a, b in zip(("res", "h", "q", "act", "h2", "k", "v"), got, want):
            _exact(a, b, f"replay {it}: {name}")
