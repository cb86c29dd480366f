"""Rotary position embedding in the rotate-half (NEOX) pairing: dim i pairs with i + D/2.

llama.cpp's converter stores LLaMA q/k rows interleaved; the loader un-permutes them, so LLaMA and
Qwen3 share this one convention.
"""
import torch

from onepass.kernels import pdl
from onepass.kernels.rmsnorm import rms_norm_ref
from onepass.kernels.triton_compat import tl, triton


def rope_inv_freq(head_dim: int, theta: float, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies; `rope_freqs` (GGUF's llama3 scaling tensor) divides them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope_freqs is not None:
        inv = inv / rope_freqs.double().cpu()
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + (head_dim/2,), in fp32."""
    angles = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    return angles.cos(), angles.sin()


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., H, D]; cos/sin: [..., D/2] broadcast over heads."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_cache(inv_freq: torch.Tensor, max_pos: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 table [max_pos, head_dim] = cat(cos, sin) per position, computed exactly as rope_cos_sin
    does (so a table built on the same device is bitwise what the reference path uses)."""
    pos = torch.arange(max_pos, device=device if device is not None else inv_freq.device)
    cos, sin = rope_cos_sin(pos, inv_freq)
    return torch.cat((cos, sin), dim=-1).contiguous()


def _kv_index(positions: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor | None, block_size: int):
    """(dim0, dim1) cache indices of each row's token."""
    p, s = positions.long(), slots.long()
    if block_table is None:
        return s, p
    return block_table.long()[s, p // block_size], p % block_size


def rope_kv_write_ref(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos_sin_cache: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, kv_heads: int, head_dim: int, *,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                      block_table: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of rope_kv_write_triton, in the model's own ops (rms_norm_ref then apply_rope_ref).

    qkv [R, (n_heads + 2 kv_heads) * head_dim]: row r is a token of slot slots[r] at positions[r]. Per
    row: (Qwen3) RMSNorm over each q / k head, rotate-half RoPE of q and k with cos/sin read from
    cos_sin_cache [max_pos, head_dim] (= cat(cos, sin)); k and v are written into the cache at
    (slots[r], positions[r]): k_cache[slot, pos] for a contiguous cache [num_slots, ctx, KVH, D], or
    pool[block_table[slot, pos // bs], pos % bs] for a paged pool [num_blocks, bs, KVH, D]. Rows with
    slots[r] < 0 (padding) write nothing. Returns roped q [R, n_heads, head_dim] (into q_out if given)."""
    R, D = qkv.shape[0], head_dim
    q = qkv[:, : n_heads * D].reshape(R, n_heads, D)
    k = qkv[:, n_heads * D: (n_heads + kv_heads) * D].reshape(R, kv_heads, D)
    v = qkv[:, (n_heads + kv_heads) * D: (n_heads + 2 * kv_heads) * D].reshape(R, kv_heads, D)
    if q_norm is not None:
        q = rms_norm_ref(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_ref(k, k_norm, eps)
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, : D // 2], cs[:, D // 2:]
    q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
    keep = slots >= 0  # boolean indexing syncs: fine for a reference
    d0, d1 = _kv_index(positions[keep], slots[keep], block_table, k_cache.shape[1])
    k_cache[d0, d1] = k[keep].to(k_cache.dtype)
    v_cache[d0, d1] = v[keep].to(v_cache.dtype)
    if q_out is not None:
        return q_out.copy_(q)
    return q


# --------------------------------------------------------------------------------------------------
# Triton: grid (R, n_heads + kv_heads); program (r, h) takes q head h (h < n_heads) or kv head
# h - n_heads of row r: loads the head as two halves, optional RMSNorm (fp32, the result rounded to the
# activation dtype exactly like the reference's separate norm), rotate-half RoPE in fp32, then stores
# q into q_out, or k (roped) and v (copied) into the cache. Every (row, head) is independent: batch
# invariant. Launched with enable_fp_fusion=False so x1*c - x2*s rounds like torch's separate ops.

@triton.jit
def _head_rms_norm(x1, x2, w_ptr, offs, mask, HALF: tl.constexpr, eps, OUT_DTYPE: tl.constexpr):
    ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
    rstd = 1.0 / tl.sqrt(ss / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = ((x1 * rstd) * w1).to(OUT_DTYPE).to(tl.float32)
    y2 = ((x2 * rstd) * w2).to(OUT_DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, pos_ptr, slot_ptr, cs_ptr, k_ptr, v_ptr, q_ptr, qw_ptr, kw_ptr, bt_ptr,
                          n_heads, kv_heads, eps, block_size,
                          s_qkv, s_cs, s_q0, s_q1, s_k0, s_k1, s_k2, s_v0, s_v1, s_v2, s_bt,
                          HALF: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, PAGED: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(pos_ptr + r).to(tl.int64)
    c = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0)
    s = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0)
    src = qkv_ptr + r * s_qkv + h.to(tl.int64) * (2 * HALF)   # q head h, or k head h - n_heads
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    act_dtype = qkv_ptr.dtype.element_ty
    if h < n_heads:
        if HAS_QNORM:
            x1, x2 = _head_rms_norm(x1, x2, qw_ptr, offs, mask, HALF, eps, act_dtype)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        dst = q_ptr + r * s_q0 + h * s_q1
        tl.store(dst + offs, y1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, y2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + r).to(tl.int64)
        if slot >= 0:
            j = (h - n_heads).to(tl.int64)
            if HAS_KNORM:
                x1, x2 = _head_rms_norm(x1, x2, kw_ptr, offs, mask, HALF, eps, act_dtype)
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
            if PAGED:
                d0 = tl.load(bt_ptr + slot * s_bt + pos // block_size).to(tl.int64)
                d1 = pos % block_size
            else:
                d0 = slot
                d1 = pos
            kd = k_ptr + d0 * s_k0 + d1 * s_k1 + j * s_k2
            tl.store(kd + offs, y1.to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(kd + HALF + offs, y2.to(k_ptr.dtype.element_ty), mask=mask)
            vsrc = src + kv_heads * (2 * HALF)
            vd = v_ptr + d0 * s_v0 + d1 * s_v1 + j * s_v2
            v1 = tl.load(vsrc + offs, mask=mask, other=0.0)
            v2 = tl.load(vsrc + HALF + offs, mask=mask, other=0.0)
            tl.store(vd + offs, v1.to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(vd + HALF + offs, v2.to(v_ptr.dtype.element_ty), mask=mask)


def check_kv_write(qkv, positions, slots, k_cache, v_cache, n_heads: int, kv_heads: int, D: int, q_norm, k_norm,
                   q_out, norms_required: bool = False) -> torch.Tensor:
    """The checks every RoPE + KV-write wrapper makes on its caches, norms, rows and q output (shared by the
    plain and the gated kernels); returns q_out, made when None."""
    R = qkv.shape[0]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2:] != (kv_heads, D) or c.stride(3) != 1:
            raise ValueError(f"{name} must be [*, *, {kv_heads}, {D}] with a contiguous last dim, got {tuple(c.shape)}")
    for name, wt in (("q_norm", q_norm), ("k_norm", k_norm)):
        if (wt is None and norms_required) or (wt is not None and (wt.shape != (D,) or not wt.is_contiguous())):
            raise ValueError(f"{name} must be contiguous [{D}]")
    if positions.shape != (R,) or slots.shape != (R,):
        raise ValueError(f"positions and slots must be [{R}]")
    if q_out is None:
        q_out = torch.empty((R, n_heads, D), dtype=qkv.dtype, device=qkv.device)
    if q_out.shape != (R, n_heads, D) or q_out.stride(2) != 1:
        raise ValueError(f"q_out must be [{R}, {n_heads}, {D}] with a contiguous last dim")
    return q_out


def rope_kv_write_triton(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos_sin_cache: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, kv_heads: int, head_dim: int, *,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                         block_table: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """See rope_kv_write_ref for the semantics. positions/slots: [R] int32/int64 on device (positions
    must be < cos_sin_cache.shape[0], and < ctx / within the slot's blocks; not checked: no sync).
    Caches need a contiguous last dim (any other strides). q_out: [R, n_heads, head_dim] with a
    contiguous last dim (default: new tensor in qkv's dtype). Returns q_out."""
    R, D = qkv.shape[0], head_dim
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    width = (n_heads + 2 * kv_heads) * D
    if qkv.dim() != 2 or qkv.shape[1] != width or (qkv.stride(1) != 1 and width > 1):
        raise ValueError(f"qkv must be [R, {width}] with a contiguous last dim, got {tuple(qkv.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != D or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {D}] with a contiguous last dim")
    q_out = check_kv_write(qkv, positions, slots, k_cache, v_cache, n_heads, kv_heads, D, q_norm, k_norm, q_out)
    if R == 0:
        return q_out
    paged = block_table is not None
    bt = block_table if paged else positions  # dummy pointer when contiguous
    HALF = D // 2
    BLOCK = triton.next_power_of_2(HALF)
    _rope_kv_write_kernel[(R, n_heads + kv_heads)](
        qkv, positions, slots, cos_sin_cache, k_cache, v_cache, q_out,
        q_norm if q_norm is not None else cos_sin_cache, k_norm if k_norm is not None else cos_sin_cache, bt,
        n_heads, kv_heads, float(eps), k_cache.shape[1] if paged else 1,
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        HALF=HALF, BLOCK=BLOCK, HAS_QNORM=q_norm is not None, HAS_KNORM=k_norm is not None, PAGED=paged,
        num_warps=1 if BLOCK <= 64 else 2, enable_fp_fusion=False, **pdl.triton_opts(qkv.device))
    return q_out
