"""Decode attention kernel (kernels/decode_attention.py) against the torch reference (attention_ref).

Where the kernels run:
* CUDA available: every test runs on the GPU (the small ones too).
* CPU only: Triton decides when a kernel is decorated (i.e. when kernels.decode_attention is imported)
  whether it is compiled for a GPU or run by its CPU interpreter (TRITON_INTERPRET=1), and that choice
  can't be undone inside a process; setting the variable from here would be too late whenever another
  test module imported the kernels first, and would leak into the rest of the session. So:
  - with TRITON_INTERPRET=1 already set (e.g. `TRITON_INTERPRET=1 pytest tests/test_kernels_decode_attention.py`)
    the kernel tests run in-process, one report per test;
  - otherwise (plain `pytest` / CI on CPU) they are skipped in-process and
    `test_cpu_kernels_in_interpreter_subprocess` reruns this file in a child pytest with
    TRITON_INTERPRET=1 and fails with the child's output if any of them fails. Nothing is left unrun.

Inputs are fresh random each run: the seed comes from os.urandom (set DECODE_ATTN_SEED to replay one)
and is printed in every failure message.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from onepass.kernels.attention import attention_ref
from onepass.kernels.decode_attention import (
    MIN_CHUNK,
    chunk_size,
    decode_attention,
    decode_attention_ref,
    make_workspace,
    max_num_splits,
    num_splits,
    paged_attention_ref,
)
from tests.interpreter import run_in_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
SEED = int(os.environ.get("DECODE_ATTN_SEED") or int.from_bytes(os.urandom(4), "little"))

needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET),
    reason="CPU without TRITON_INTERPRET=1: run by test_cpu_kernels_in_interpreter_subprocess in a child process")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1000 + salt)


def _msg(what: str) -> str:
    return f"{what} (seed {SEED}; rerun with DECODE_ATTN_SEED={SEED})"


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _to_paged(k_cache, v_cache, block_size, g, spare_blocks=3):
    """Same contents in a paged pool: a shuffled block table over a pool with spare (garbage) blocks."""
    S, ctx, kvh, d = k_cache.shape
    nb = ctx // block_size
    total = S * nb + spare_blocks
    perm = torch.randperm(total, generator=g)[: S * nb].view(S, nb)
    k_pool = _randn(g, total, block_size, kvh, d, dtype=k_cache.dtype) * 100
    v_pool = _randn(g, total, block_size, kvh, d, dtype=k_cache.dtype) * 100
    k_pool[perm.to(DEV)] = k_cache.view(S, nb, block_size, kvh, d)
    v_pool[perm.to(DEV)] = v_cache.view(S, nb, block_size, kvh, d)
    return k_pool, v_pool, perm.to(torch.int32).to(DEV)


def _case(salt, H, KVH, D, dtype, layout, ctx=320, n_slots=4):
    """Rows at mixed positions: short ones, consecutive positions of one slot (prefill as rows), and a
    long one that needs several splits (ctx 320 > MIN_CHUNK)."""
    g = _gen(salt)
    k = _randn(g, n_slots, ctx, KVH, D, dtype=dtype)
    v = _randn(g, n_slots, ctx, KVH, D, dtype=dtype)
    slots = torch.tensor([0, 1, 2, 2, 2, 2, 3, 1, 0], dtype=torch.int32)
    positions = torch.tensor([1, 5, 37, 38, 39, 40, 0, ctx - 1, 200], dtype=torch.int32)
    q = _randn(g, len(slots), H, D, dtype=dtype)
    slots, positions = slots.to(DEV), positions.to(DEV)
    if layout == "paged":
        kp, vp, bt = _to_paged(k, v, 16, g)
        return dict(q=q, k=kp, v=vp, bt=bt, slots=slots, positions=positions, k_dense=k, v_dense=v)
    return dict(q=q, k=k, v=v, bt=None, slots=slots, positions=positions, k_dense=k, v_dense=v)


def _run(c, **kw):
    return decode_attention(c["q"], c["k"], c["v"], c["slots"], c["positions"], block_table=c["bt"], **kw)


def _ref(c, scale=None):
    """fp32 reference through the row's own layout."""
    q = c["q"].float()
    if c["bt"] is None:
        return decode_attention_ref(q, c["k"].float(), c["v"].float(), c["slots"], c["positions"], scale)
    return paged_attention_ref(q, c["k"].float(), c["v"].float(), c["bt"], c["slots"], c["positions"], scale)


def _assert_close(out, ref, dtype, what):
    tol = TOL[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), \
        _msg(f"{what}: max abs err {err:.3g} > tol {tol}")


def _bitwise(a, b):
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


# ------------------------------------------------------------------------------------------------
# split rule (host only)

def test_num_splits_rule():
    sms = 132
    for kvh in (1, 4, 8):
        assert num_splits(1, sms, kvh) == 1
        assert num_splits(MIN_CHUNK, sms, kvh) == 1
        assert num_splits(4096, sms, kvh) >= 2
    assert num_splits(512, sms, 8) >= 2 and num_splits(37, sms, 8) == 1
    for kvh in (1, 2, 4, 8):
        for max_len in (1, 100, 512, 4096, 40000):
            bound = max_num_splits(max_len, sms, kvh)
            for length in range(1, max_len + 1, max(1, max_len // 997)):
                n, c = num_splits(length, sms, kvh), chunk_size(length, sms, kvh)
                assert c % MIN_CHUNK == 0 and (n - 1) * c < length <= n * c
                assert 1 <= n <= bound, (length, max_len, kvh)
    assert max_num_splits(512, sms, 8) == num_splits(512, sms, 8)


def test_paged_reference_matches_contiguous_reference():
    """paged_attention_ref over a shuffled pool == the contiguous reference on the same contents."""
    for layout_seed in range(2):
        c = _case(50 + layout_seed, 8, 2, 32, torch.float32, "paged")
        dense = decode_attention_ref(c["q"], c["k_dense"], c["v_dense"], c["slots"], c["positions"])
        paged = paged_attention_ref(c["q"], c["k"], c["v"], c["bt"], c["slots"], c["positions"])
        assert torch.equal(dense, paged), _msg("paged ref != contiguous ref")
    # and both equal attention_ref called on each row alone
    q, s, p = c["q"], c["slots"].long(), c["positions"].long()
    for r in range(len(s)):
        one = attention_ref(q[r:r + 1, None], c["k_dense"][s[r:r + 1], : p[r] + 1],
                            c["v_dense"][s[r:r + 1], : p[r] + 1], p[r:r + 1, None])[:, 0]
        assert torch.allclose(one, dense[r:r + 1], atol=1e-6, rtol=1e-6), _msg(f"row {r}")


# ------------------------------------------------------------------------------------------------
# kernel vs reference (CPU interpreter or GPU), tiny shapes

SHAPES = [(4, 2, 16), (8, 2, 32)]  # (n_heads, kv_heads, head_dim): GQA group 2 and 4


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}".format(*s))
def test_matches_reference(shape, layout, dtype):
    H, KVH, D = shape
    c = _case(1, H, KVH, D, dtype, layout)
    out = _run(c)
    assert out.shape == c["q"].shape and out.dtype == dtype
    assert max(num_splits(int(p) + 1, 132, KVH) for p in c["positions"]) >= 2  # the merge stage is exercised
    _assert_close(out, _ref(c), dtype, f"{layout} {shape}")
    if layout == "paged":  # same contents through the contiguous kernel
        dense = decode_attention(c["q"], c["k_dense"], c["v_dense"], c["slots"], c["positions"])
        _assert_close(out, dense, dtype, "paged vs contiguous kernel")


@needs_kernel
def test_custom_scale_and_preallocated_buffers():
    c = _case(2, 8, 2, 32, torch.float32, "contiguous")
    R, H, D = c["q"].shape
    ws = make_workspace(R, H, D, 320, 132, DEV)  # worst-case split dim (kv_heads not given)
    out = torch.full_like(c["q"], float("nan"))
    res = _run(c, scale=0.3, out=out, workspace=ws)
    assert res.data_ptr() == out.data_ptr()
    _assert_close(out, _ref(c, scale=0.3), torch.float32, "scale 0.3")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_batch_invariance(layout, dtype):
    """Each row alone (R=1), and in a reversed batch, is bitwise the same row of the full batch."""
    c = _case(3, 8, 2, 32, dtype, layout)
    full = _run(c)
    R = c["q"].shape[0]
    rev = torch.arange(R - 1, -1, -1, device=DEV)
    c_rev = dict(c, q=c["q"][rev].contiguous(), slots=c["slots"][rev].contiguous(),
                 positions=c["positions"][rev].contiguous())
    assert _bitwise(_run(c_rev)[rev], full), _msg("reversed batch differs")
    for r in range(R):
        one = dict(c, q=c["q"][r:r + 1].clone(), slots=c["slots"][r:r + 1].clone(),
                   positions=c["positions"][r:r + 1].clone())
        assert _bitwise(_run(one), full[r:r + 1]), _msg(f"row {r} alone differs from the batch")


@needs_kernel
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (interpreter) on the NaN garbage rows
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_row_ignores_other_slots_later_positions_and_stale_buffers(layout):
    """Garbage (NaN) in other slots, in the row's own positions > pos, in its block-table entries beyond
    its last block and in the output/workspace buffers leaves the row's result bitwise unchanged. The
    other rows of the batch keep their positions but read a fully garbage slot (valid addresses)."""
    dtype = torch.bfloat16
    c = _case(4, 4, 2, 16, dtype, layout)
    R, H, D = c["q"].shape
    n_slots = c["k_dense"].shape[0]
    base = _run(c)
    for r in (1, 2, 7, 8):  # short, first of a consecutive run, the long row, a mid-length row
        slot, pos = int(c["slots"][r]), int(c["positions"][r])
        k = torch.full_like(c["k_dense"], float("nan"))
        v = torch.full_like(c["v_dense"], float("nan"))
        k[slot, : pos + 1] = c["k_dense"][slot, : pos + 1]
        v[slot, : pos + 1] = c["v_dense"][slot, : pos + 1]
        slots = torch.full_like(c["slots"], (slot + 1) % n_slots)
        slots[r] = slot
        dirty = dict(c, k=k, v=v, slots=slots)
        if layout == "paged":
            kp, vp, bt = _to_paged(k, v, 16, _gen(40 + r))
            kp.fill_(float("nan")), vp.fill_(float("nan"))
            used = pos // 16 + 1
            blocks = bt[slot, :used].long()
            kp[blocks] = c["k_dense"][slot].view(-1, 16, *k.shape[2:])[:used]
            vp[blocks] = c["v_dense"][slot].view(-1, 16, *v.shape[2:])[:used]
            k_last = kp[blocks[-1]]
            k_last[pos % 16 + 1:] = float("nan")  # the row's own later positions in its last block
            vp[blocks[-1], pos % 16 + 1:] = float("nan")
            bt[slot, used:] = 1 << 30  # beyond the row's last block: must never be dereferenced
            dirty = dict(dirty, k=kp, v=vp, bt=bt)
        ws = make_workspace(R, H, D, 320, 132, DEV, kv_heads=2)
        ws["partial_out"].fill_(float("nan")), ws["lse"].fill_(float("nan"))
        out = torch.full_like(c["q"], float("nan"))
        _run(dirty, out=out, workspace=ws)
        assert _bitwise(out[r], base[r]), _msg(f"row {r} (slot {slot}, pos {pos}) changed by garbage")
        assert torch.isnan(out[torch.arange(R, device=DEV) != r]).any()  # the garbage really was read


# ------------------------------------------------------------------------------------------------
# CPU-only: the kernel tests above, in a child process under the Triton interpreter

@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), DECODE_ATTN_SEED=str(SEED))


# ------------------------------------------------------------------------------------------------
# GPU: full shapes, bf16

MODELS = {"llama1b": (32, 8, 64), "qwen3-1.7b": (16, 8, 128), "qwen3-4b": (32, 8, 128), "h24kv4d256": (24, 4, 256)}
GPU_CTX = 512


def _gpu_case(salt, H, KVH, D, R, layout, ctx=GPU_CTX, dtype=torch.bfloat16):
    g = _gen(salt)
    n_slots = max(1, min(R, 64))
    k = _randn(g, n_slots, ctx, KVH, D, dtype=dtype)
    v = _randn(g, n_slots, ctx, KVH, D, dtype=dtype)
    slots = torch.randint(0, n_slots, (R,), generator=g, dtype=torch.int32)
    positions = torch.randint(0, ctx, (R,), generator=g, dtype=torch.int32)
    positions[: min(R, 4)] = torch.tensor([0, ctx - 1, MIN_CHUNK - 1, MIN_CHUNK], dtype=torch.int32)[: min(R, 4)]
    if R >= 16:  # a prefill-like run of consecutive positions of one slot
        slots[8:16] = slots[8]
        positions[8:16] = torch.arange(300, 308, dtype=torch.int32)
    q = _randn(g, R, H, D, dtype=dtype)
    c = dict(q=q, k=k, v=v, bt=None, slots=slots.to(DEV), positions=positions.to(DEV), k_dense=k, v_dense=v)
    if layout == "paged":
        kp, vp, bt = _to_paged(k, v, 16, g)
        c.update(k=kp, v=vp, bt=bt)
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 8, 128, 512])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("model", list(MODELS))
def test_gpu_full_shapes(model, layout, R):
    H, KVH, D = MODELS[model]
    c = _gpu_case(10, H, KVH, D, R, layout)
    out = _run(c)
    torch.cuda.synchronize()
    _assert_close(out, _ref(c), torch.bfloat16, f"{model} {layout} R={R}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("model", list(MODELS))
def test_gpu_batch_invariance(model, layout):
    H, KVH, D = MODELS[model]
    c = _gpu_case(11, H, KVH, D, 512, layout)
    full = _run(c)
    small = dict(c, q=c["q"][:128].clone(), slots=c["slots"][:128].clone(), positions=c["positions"][:128].clone())
    assert _bitwise(_run(small), full[:128]), _msg("R=128 prefix differs from the R=512 batch")
    for r in range(0, 512, 7):
        one = dict(c, q=c["q"][r:r + 1].clone(), slots=c["slots"][r:r + 1].clone(),
                   positions=c["positions"][r:r + 1].clone())
        assert _bitwise(_run(one), full[r:r + 1]), _msg(f"row {r} alone differs")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("model", ["llama1b", "h24kv4d256"])
def test_gpu_cuda_graph_replay(model, layout):
    """One graph captured at max_len=512 serves any positions: replay after changing positions, slots
    (and the block table) in place; results match the reference and the eager call bitwise."""
    H, KVH, D = MODELS[model]
    R = 64
    c = _gpu_case(12, H, KVH, D, R, layout)
    ws = make_workspace(R, H, D, GPU_CTX, torch.cuda.get_device_properties(DEV).multi_processor_count, DEV,
                        kv_heads=KVH)
    out = torch.empty_like(c["q"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(c, out=out, workspace=ws)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(c, out=out, workspace=ws)
    for step in range(3):
        g = _gen(100 + step)
        c["positions"].copy_(torch.randint(0, GPU_CTX, (R,), generator=g, dtype=torch.int32))
        c["slots"].copy_(torch.randint(0, c["k_dense"].shape[0], (R,), generator=g, dtype=torch.int32))
        c["q"].copy_(_randn(g, R, H, D, dtype=torch.bfloat16))
        if layout == "paged":
            c["bt"].copy_(c["bt"][torch.randperm(c["bt"].shape[0], generator=g).to(DEV)])
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, _ref(c), torch.bfloat16, f"graph replay {step}")
        assert _bitwise(out, _run(c)), _msg(f"graph replay {step} differs from the eager call")
