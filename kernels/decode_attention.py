"""Decode attention over rows (flash-decoding: split-KV, two Triton stages), contiguous or paged KV.

A *row* r is one query token of slot ``slots[r]`` at position ``positions[r]``; it attends to keys
0..positions[r] of its slot (its own K/V is already written at positions[r]). A step's rows may be
many slots at one position each (decode) or consecutive positions of one slot (prefill flattened to
rows): every row is computed on its own.

KV addressing (a constexpr switch of the same kernels):
  contiguous  cache [num_slots, ctx, kv_heads, head_dim]; token (slot, p) at cache[slot, p]
  paged       pool  [num_blocks, block_size, kv_heads, head_dim] + block_table [num_slots, max_blocks];
              token (slot, p) at pool[block_table[slot, p // block_size], p % block_size]

Stage 1, grid (R, kv_heads, MAX_SPLITS): one program takes all q heads of one kv head (the GQA group,
padded to >= 16 rows for tl.dot) over one chunk of keys, online softmax in fp32 (base 2), and writes a
normalised partial output + log2-sum-exp per (row, head, split). Programs whose chunk starts beyond
the row's length exit at once. A row that needs one split writes its final output directly.
Stage 2, grid (R, n_heads): merges the splits of rows with more than one, in split order 0, 1, ...

Split rule (``num_splits``; the kernel evaluates the same formula on device from ``positions``):
    target = max(1, num_sms // kv_heads)
    chunk  = max(MIN_CHUNK, roundup(cdiv(length, target), MIN_CHUNK))
    splits = cdiv(length, chunk)
It depends only on the row's length and the device (SM count, a plain int) and the model (kv_heads),
never on R or on the other rows, so a row's arithmetic is identical whatever the batch holds (batch
invariance), and the grid is static: MAX_SPLITS = min(target, cdiv(max_len, MIN_CHUNK)) bounds every
row of length <= max_len. Nothing is read on the host, and with ``out`` and ``workspace`` passed in
nothing is allocated, so the call can be captured in a CUDA graph and replayed at any positions
< max_len (rows beyond max_len would need more splits than the grid has: the caller's bound).

Workspace: partial_out [R, n_heads, MAX_SPLITS, head_dim] fp32 + lse [R, n_heads, MAX_SPLITS] fp32;
make_workspace(..., kv_heads=KVH) sizes MAX_SPLITS exactly, without kv_heads it assumes KVH = 1
(up to kv_heads x more memory, same results). Splits never read are never written.
"""
from __future__ import annotations

import functools
import math

import torch

from onepass.kernels import pdl
from onepass.kernels.attention import attention_ref
from onepass.kernels.triton_compat import tl, triton

MIN_CHUNK = 128          # keys; every chunk is a multiple of this (and of BLOCK_N)
DEFAULT_NUM_SMS = 132    # H200; used off-GPU (CPU interpreter) so CPU runs mirror the H200 split rule


# --------------------------------------------------------------------------------------------------
# split rule (host mirror of the in-kernel formula)

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _target_splits(num_sms: int, kv_heads: int) -> int:
    return max(1, int(num_sms) // int(kv_heads))


def chunk_size(length: int, num_sms: int, kv_heads: int) -> int:
    """Keys per split for a row of ``length`` keys (= position + 1)."""
    t = _target_splits(num_sms, kv_heads)
    return max(MIN_CHUNK, _cdiv(_cdiv(length, t), MIN_CHUNK) * MIN_CHUNK)


def num_splits(length: int, num_sms: int, kv_heads: int) -> int:
    """How many splits stage 1 uses for a row of ``length`` keys (= position + 1)."""
    return _cdiv(max(int(length), 1), chunk_size(length, num_sms, kv_heads))


def max_num_splits(max_len: int, num_sms: int, kv_heads: int) -> int:
    """Upper bound of num_splits(length) over 1 <= length <= max_len: the static grid's split dim."""
    return max(1, min(_target_splits(num_sms, kv_heads), _cdiv(int(max_len), MIN_CHUNK)))


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_num_sms(device: torch.device | str) -> int:
    """SM count of a CUDA device (read once and cached), DEFAULT_NUM_SMS elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def _block_n(head_dim: int) -> int:
    # tile of keys per loop iteration; must divide MIN_CHUNK. Tuning knob for the H200.
    return 64 if head_dim <= 128 else 32


# --------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _row_splits(length, target_splits, MIN_CHUNK: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(length, target_splits), MIN_CHUNK) * MIN_CHUNK
    chunk = tl.maximum(chunk, MIN_CHUNK)
    return chunk, tl.cdiv(length, chunk)


@triton.jit
def _decode_attn_stage1(
    q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, bt_ptr,
    out_ptr, po_ptr, plse_ptr,
    qk_scale,            # scale * log2(e)
    target_splits,
    stride_qr, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_or, stride_oh,
    stride_por, stride_poh, stride_pos,
    stride_lr, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.load(pos_ptr + r).to(tl.int32) + 1
    chunk, n_splits = _row_splits(length, target_splits, MIN_CHUNK)
    start = split * chunk
    if start >= length:
        return
    end = tl.minimum(start + chunk, length)
    slot = tl.load(slot_ptr + r).to(tl.int64)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    r64 = r.to(tl.int64)

    q = tl.load(q_ptr + r64 * stride_qr + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        nmask = offs < end
        if PAGED:
            blk = tl.load(bt_ptr + slot * stride_bt + offs // PAGE, mask=nmask, other=0).to(tl.int64)
            tok = (offs % PAGE).to(tl.int64)
            k_row = blk * stride_kb + tok * stride_kt
            v_row = blk * stride_vb + tok * stride_vt
        else:
            offs64 = offs.to(tl.int64)
            k_row = slot * stride_kb + offs64 * stride_kt
            v_row = slot * stride_vb + offs64 * stride_vt
        k = tl.load(k_ptr + k_row[:, None] + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        # every block holds >= 1 valid key (n0 < end), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_row[:, None] + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if UPCAST:  # same rounding of p as the GPU path, product in fp32
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=DOT_PREC)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / l_i[:, None]
    if n_splits == 1:
        tl.store(out_ptr + r64 * stride_or + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(po_ptr + r64 * stride_por + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :],
                 o, mask=gmask[:, None])
        tl.store(plse_ptr + r64 * stride_lr + heads * stride_lh + split, m_i + tl.log2(l_i), mask=gmask)


@triton.jit
def _decode_attn_stage2(
    pos_ptr, out_ptr, po_ptr, plse_ptr,
    target_splits,
    stride_or, stride_oh,
    stride_por, stride_poh, stride_pos,
    stride_lr, stride_lh,
    HEAD_DIM: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(pos_ptr + r).to(tl.int32) + 1
    chunk, n_splits = _row_splits(length, target_splits, MIN_CHUNK)
    if n_splits == 1:
        return  # stage 1 wrote the output
    r64 = r.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    lse_base = plse_ptr + r64 * stride_lr + h * stride_lh
    po_base = po_ptr + r64 * stride_por + h * stride_poh
    # max is exact whatever the reduction order; the sums below run in split order
    m = tl.max(tl.load(lse_base + offs_s, mask=offs_s < n_splits, other=float("-inf")), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    den = 0.0
    for s in range(0, n_splits):
        w = tl.exp2(tl.load(lse_base + s) - m)
        acc += w * tl.load(po_base + s * stride_pos + offs_d)
        den += w
    tl.store(out_ptr + r64 * stride_or + h * stride_oh + offs_d, (acc / den).to(out_ptr.dtype.element_ty))


# whether triton.jit produced interpreter objects (TRITON_INTERPRET=1 when this module was imported)
_INTERPRETED = type(_decode_attn_stage1).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------------------------------
# host API

def make_workspace(R: int, n_heads: int, head_dim: int, max_len: int, num_sms: int, device,
                   *, kv_heads: int | None = None) -> dict:
    """Partial-output / log-sum-exp buffers for up to R rows of length <= max_len (static grid).

    Without ``kv_heads`` the split dim is sized for the worst case (kv_heads = 1); pass the model's
    kv_heads to size it exactly."""
    splits = max_num_splits(max_len, num_sms, kv_heads or 1)
    return {
        "partial_out": torch.empty((R, n_heads, splits, head_dim), dtype=torch.float32, device=device),
        "lse": torch.empty((R, n_heads, splits), dtype=torch.float32, device=device),
        "max_len": int(max_len),
        "num_sms": int(num_sms),
    }


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, *, block_table: torch.Tensor | None = None,
                     scale: float | None = None, out: torch.Tensor | None = None, workspace: dict | None = None,
                     num_sms: int | None = None, max_len: int | None = None) -> torch.Tensor:
    """q [R, n_heads, head_dim]; slots, positions [R] (int32/int64, on q's device).
    Contiguous (block_table None): k_cache/v_cache [num_slots, ctx, kv_heads, head_dim].
    Paged: k_cache/v_cache pools [num_blocks, block_size, kv_heads, head_dim], block_table
    [num_slots, max_blocks] int. Returns [R, n_heads, head_dim] in q's dtype (``out`` if given).

    max_len bounds every row's length (positions < max_len); default: workspace's, else the cache's
    capacity. num_sms: default workspace's, else the device's. Rows beyond max_len are not supported."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [R, H, D] and k/v caches equal 4-D tensors; got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    R, H, D = q.shape
    paged = block_table is not None
    kvh = k_cache.shape[2]
    if k_cache.shape[3] != D or H % kvh:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kvh} kv heads x {k_cache.shape[3]}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dim")
    if slots.shape != (R,) or positions.shape != (R,):
        raise ValueError(f"slots {tuple(slots.shape)} and positions {tuple(positions.shape)} must be [{R}]")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    group = H // kvh
    if paged:
        page = k_cache.shape[1]
        if page < 16 or page & (page - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {page}")
        if block_table.dim() != 2 or block_table.dtype.is_floating_point:
            raise ValueError(f"block_table must be an integer [num_slots, max_blocks], got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        capacity = block_table.shape[1] * page
    else:
        page = 1
        capacity = k_cache.shape[1]
    if workspace is not None:
        num_sms = workspace["num_sms"] if num_sms is None else num_sms
        max_len = workspace["max_len"] if max_len is None else max_len
    if num_sms is None:
        num_sms = device_num_sms(q.device)
    if max_len is None:
        max_len = capacity
    scale = D ** -0.5 if scale is None else float(scale)
    splits = max_num_splits(max_len, num_sms, kvh)
    target = _target_splits(num_sms, kvh)

    if out is None:
        out = torch.empty((R, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if workspace is None:
        workspace = make_workspace(R, H, D, max_len, num_sms, q.device, kv_heads=kvh)
    po, plse = workspace["partial_out"], workspace["lse"]
    if po.shape[0] < R or po.shape[1] != H or po.shape[3] != D or po.shape[2] < splits \
            or plse.shape[:3] != po.shape[:3] or po.stride(3) != 1 or plse.stride(2) != 1:
        raise ValueError(f"workspace {tuple(po.shape)} too small for R={R}, H={H}, D={D}, {splits} splits "
                         f"(max_len {max_len}, {num_sms} SMs)")
    if R == 0:
        return out

    bt = block_table if paged else slots  # dummy pointer when contiguous (never read)
    # Triton's CPU interpreter multiplies bf16/fp16 dot operands as their raw 16-bit integers
    # (triton 3.9: create_dot runs np.matmul on the uint16 storage); there, dot in fp32 instead.
    upcast = _INTERPRETED and q.dtype != torch.float32
    dot_prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    _decode_attn_stage1[(R, kvh, splits)](
        q, k_cache, v_cache, slots, positions, bt,
        out, po, plse,
        scale * math.log2(math.e), target,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2),
        plse.stride(0), plse.stride(1),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
        BLOCK_N=_block_n(D), MIN_CHUNK=MIN_CHUNK, PAGED=paged, PAGE=page, DOT_PREC=dot_prec, UPCAST=upcast,
        num_warps=4, num_stages=2, **pdl.triton_opts(q.device))
    if splits > 1:
        _decode_attn_stage2[(R, H)](
            positions, out, po, plse,
            target,
            out.stride(0), out.stride(1),
            po.stride(0), po.stride(1), po.stride(2),
            plse.stride(0), plse.stride(1),
            HEAD_DIM=D, MIN_CHUNK=MIN_CHUNK, BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1 if D <= 64 else 2, **pdl.triton_opts(positions.device))
    return out


# --------------------------------------------------------------------------------------------------
# torch references (host reads allowed: tests and reports only)

def _rows_ref(q, k_rows, v_rows, positions, scale):
    """q [R, H, D]; k_rows/v_rows [R, S, KVH, D] holding each row's keys 0..S-1 (beyond pos: ignored)."""
    D = q.shape[-1]
    qq = q.unsqueeze(1)
    if scale is not None and float(scale) != D ** -0.5:
        qq = qq.float() * (float(scale) / D ** -0.5)  # attention_ref applies D ** -0.5
    out = attention_ref(qq, k_rows, v_rows, positions.view(-1, 1).to(torch.long))
    return out.squeeze(1).to(q.dtype)


def decode_attention_ref(q, k_cache, v_cache, slots, positions, scale=None):
    """Contiguous-cache reference: each row's keys cache[slot, :pos+1] through attention_ref."""
    S = int(positions.max()) + 1 if positions.numel() else 1
    slots = slots.to(torch.long)
    return _rows_ref(q, k_cache[slots, :S], v_cache[slots, :S], positions, scale)


def paged_attention_ref(q, k_pool, v_pool, block_table, slots, positions, scale=None):
    """Paged reference: gathers each row's keys 0..pos through block_table, then attention_ref."""
    S = int(positions.max()) + 1 if positions.numel() else 1
    page = k_pool.shape[1]
    p = torch.arange(S, device=q.device)
    nblk = block_table.shape[1]
    # positions beyond a row's pos are masked by attention_ref; clamp their block index to stay in range
    bidx = (p // page).clamp(max=nblk - 1)
    blocks = block_table.to(torch.long)[slots.to(torch.long)][:, bidx]          # [R, S]
    valid = p.view(1, S) <= positions.view(-1, 1).to(torch.long)
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks))               # never index garbage
    k_rows = k_pool[blocks, (p % page).view(1, S)]                              # [R, S, KVH, D]
    v_rows = v_pool[blocks, (p % page).view(1, S)]
    return _rows_ref(q, k_rows, v_rows, positions, scale)


# --------------------------------------------------------------------------------------------------
# bandwidth check (GPU): python -m kernels.decode_attention [--paged]

def bench(n_heads=32, kv_heads=8, head_dim=128, R=128, length=4096, paged=False, block_size=16,
          dtype=torch.bfloat16, iters=50) -> dict:
    """Every row at position length-1 in its own slot; times stage 1 + stage 2 in a CUDA graph and
    reports the KV bytes read per second (the quantity to hold near the HBM roofline)."""
    dev = torch.device("cuda")
    q = torch.randn(R, n_heads, head_dim, device=dev, dtype=dtype)
    slots = torch.arange(R, device=dev, dtype=torch.int32)
    positions = torch.full((R,), length - 1, device=dev, dtype=torch.int32)
    if paged:
        nb = _cdiv(length, block_size)
        k = torch.randn(R * nb, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        bt = torch.randperm(R * nb, device=dev).to(torch.int32).view(R, nb)
    else:
        k = torch.randn(R, length, kv_heads, head_dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        bt = None
    sms = device_num_sms(dev)
    ws = make_workspace(R, n_heads, head_dim, length, sms, dev, kv_heads=kv_heads)
    out = torch.empty_like(q)

    def run():
        return decode_attention(q, k, v, slots, positions, block_table=bt, out=out, workspace=ws)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    sec = t0.elapsed_time(t1) / 1e3 / iters
    kv_bytes = 2 * R * length * kv_heads * head_dim * k.element_size()
    return {"H": n_heads, "KVH": kv_heads, "D": head_dim, "R": R, "len": length, "paged": paged,
            "splits": num_splits(length, sms, kv_heads), "us": sec * 1e6, "TB/s": kv_bytes / sec / 1e12}


if __name__ == "__main__":  # pragma: no cover - GPU only
    import sys

    paged = "--paged" in sys.argv
    for h, kvh, d in ((32, 8, 64), (16, 8, 128), (32, 8, 128), (24, 4, 256)):
        for R, L in ((1, 4096), (8, 4096), (128, 512), (128, 4096), (512, 512), (512, 2048)):
            print(bench(h, kvh, d, R, L, paged=paged))
