"""The two kernels that make qwen35's gated full attention out of the shared decode-attention kernel.

gated_rope_kv_write_{ref,triton}(qkv, positions, slots, cos_sin_cache, k_cache, v_cache, n_heads, kv_heads,
                                 head_dim, rotary_dim, q_norm, k_norm, eps, block_table=None, q_out=None)
    qkv [R, 2 * n_heads * D + 2 * kv_heads * D] is one GEMM's output: attn_q (per q head h the 2D columns
    [q_h | gate_h], as the GGUF packs them), then attn_k, then attn_v. Per row: RMSNorm over each q and k
    head (q_norm / k_norm gains), NEOX RoPE over the first `rotary_dim` dims of each head (pairs (i,
    i + rotary_dim/2); cos/sin from cos_sin_cache [max_pos, rotary_dim] = cat(cos, sin)), the other dims
    passed through; k (roped) and v written to the cache at (slots[r], positions[r]) (contiguous, or paged
    through block_table, exactly as kernels/rope.py addresses it); rows with slot < 0 write nothing.
    Returns roped q [R, n_heads, D]. The gate is not touched: `gate_view(qkv, ...)` is a strided view of it.

sigmoid_gate_mul_{ref,triton}(o, gate, out=None) -> out [R, H, D] = o * sigmoid(gate)
    o [R, H, D] attention output, gate [R, H, D] (any row/head strides, e.g. gate_view). Two roundings to
    the activation dtype as torch's `o * torch.sigmoid(gate)` does (sigmoid, then the product). `out` may be o.

Rounding mirrors the reference model (engine/models/qwen35.py) op by op: the norm's output is rounded to
the activation dtype before RoPE, RoPE runs in fp32 and is rounded once; launched with
enable_fp_fusion=False so x1*c - x2*s rounds like torch's separate ops. Every (row, head) program is
independent of the others: batch invariant, no host sync, nothing allocated when outputs are given.
"""
from __future__ import annotations

import torch

from onepass.kernels.rmsnorm import rms_norm_ref
from onepass.kernels.rope import _kv_index, apply_rope_ref, check_kv_write
from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton
from onepass.kernels.x_image import XImage, check_image, image_args, image_offsets


def split_gated_qkv(qkv: torch.Tensor, n_heads: int, kv_heads: int, head_dim: int):
    """Views (q [R, H, D], gate [R, H, D], k [R, KVH, D], v [R, KVH, D]) of a fused gated q|k|v row block."""
    R, D = qkv.shape[0], head_dim
    qg = qkv[:, : 2 * n_heads * D].unflatten(1, (n_heads, 2 * D))
    k = qkv[:, 2 * n_heads * D: (2 * n_heads + kv_heads) * D].unflatten(1, (kv_heads, D))
    v = qkv[:, (2 * n_heads + kv_heads) * D: (2 * n_heads + 2 * kv_heads) * D].unflatten(1, (kv_heads, D))
    assert qkv.shape[1] == (2 * n_heads + 2 * kv_heads) * D, f"gated qkv width {qkv.shape[1]} for R={R}"
    return qg[..., :D], qg[..., D:], k, v


def gate_view(qkv: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """The output gates [R, H, D] inside a fused gated q|k|v block (a strided view, no copy)."""
    return qkv[:, : 2 * n_heads * head_dim].unflatten(1, (n_heads, 2 * head_dim))[..., head_dim:]


def partial_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NEOX RoPE over the first rotary_dim dims of each head (cos/sin [..., rotary_dim/2]); the rest pass."""
    if rotary_dim == x.shape[-1]:
        return apply_rope_ref(x, cos, sin)
    return torch.cat((apply_rope_ref(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def gated_rope_kv_write_ref(qkv, positions, slots, cos_sin_cache, k_cache, v_cache, n_heads: int, kv_heads: int,
                            head_dim: int, rotary_dim: int, q_norm, k_norm, eps: float, *, block_table=None,
                            q_out=None) -> torch.Tensor:
    q, _, k, v = split_gated_qkv(qkv, n_heads, kv_heads, head_dim)
    q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, :half], cs[:, half: 2 * half]
    q, k = partial_rope_ref(q, cos, sin, rotary_dim), partial_rope_ref(k, cos, sin, rotary_dim)
    keep = slots >= 0  # boolean indexing syncs: fine for a reference
    d0, d1 = _kv_index(positions[keep], slots[keep], block_table, k_cache.shape[1])
    k_cache[d0, d1] = k[keep].to(k_cache.dtype)
    v_cache[d0, d1] = v[keep].to(v_cache.dtype)
    return q if q_out is None else q_out.copy_(q)


def sigmoid_gate_mul_ref(o: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None,
                         image: XImage | None = None) -> torch.Tensor:
    """o * sigmoid(gate); image: the result's [R, H * D] rows also written there (kernels/x_image.py)."""
    y = o * torch.sigmoid(gate)
    y = y if out is None else out.copy_(y)
    if image is not None:
        image.write_ref(y.flatten(1))
    return y


# --------------------------------------------------------------------------------------------------
# Triton

@triton.jit
def _gated_rope_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cs_ptr, k_ptr, v_ptr, q_ptr, qw_ptr, kw_ptr, bt_ptr,
                          n_heads, kv_heads, eps, block_size,
                          s_qkv, s_cs, s_q0, s_q1, s_k0, s_k1, s_k2, s_v0, s_v1, s_v2, s_bt,
                          D: tl.constexpr, RD: tl.constexpr, BLOCK: tl.constexpr, PAGED: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = RD // 2
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    rot = offs < RD
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)  # NEOX pair of a rotated dim
    partner = tl.where(rot, partner, offs)
    fi = tl.where(first, offs, offs - HALF)              # frequency index of a rotated dim
    fi = tl.where(rot, fi, 0)
    pos = tl.load(pos_ptr + r).to(tl.int64)
    c = tl.load(cs_ptr + pos * s_cs + fi, mask=mask & rot, other=1.0)
    s = tl.load(cs_ptr + pos * s_cs + HALF + fi, mask=mask & rot, other=0.0)
    is_q = h < n_heads
    j = (h - n_heads).to(tl.int64)
    if is_q:
        src = qkv_ptr + r * s_qkv + h.to(tl.int64) * (2 * D)          # [q_h | gate_h]
        w_ptr = qw_ptr
    else:
        src = qkv_ptr + r * s_qkv + n_heads * (2 * D) + j * D
        w_ptr = kw_ptr
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    act = qkv_ptr.dtype.element_ty
    x = ((x * rstd) * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    xp = ((xp * rstd) * tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    y = tl.where(first, x * c - xp * s, x * c + xp * s)
    y = tl.where(rot, y, x)
    if is_q:
        tl.store(q_ptr + r * s_q0 + h * s_q1 + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + r).to(tl.int64)
        if slot >= 0:
            if PAGED:
                d0 = tl.load(bt_ptr + slot * s_bt + pos // block_size).to(tl.int64)
                d1 = pos % block_size
            else:
                d0 = slot
                d1 = pos
            tl.store(k_ptr + d0 * s_k0 + d1 * s_k1 + j * s_k2 + offs, y.to(k_ptr.dtype.element_ty), mask=mask)
            vsrc = qkv_ptr + r * s_qkv + n_heads * (2 * D) + kv_heads * D + j * D
            vv = tl.load(vsrc + offs, mask=mask, other=0.0)
            tl.store(v_ptr + d0 * s_v0 + d1 * s_v1 + j * s_v2 + offs, vv.to(v_ptr.dtype.element_ty), mask=mask)


def gated_rope_kv_write_triton(qkv, positions, slots, cos_sin_cache, k_cache, v_cache, n_heads: int, kv_heads: int,
                               head_dim: int, rotary_dim: int, q_norm, k_norm, eps: float, *, block_table=None,
                               q_out=None) -> torch.Tensor:
    R, D = qkv.shape[0], head_dim
    width = (2 * n_heads + 2 * kv_heads) * D
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [R, {width}] with a contiguous last dim, got {tuple(qkv.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in 1..{D}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {rotary_dim}] with a contiguous last dim")
    q_out = check_kv_write(qkv, positions, slots, k_cache, v_cache, n_heads, kv_heads, D, q_norm, k_norm, q_out,
                           norms_required=True)
    if R == 0:
        return q_out
    paged = block_table is not None
    BLOCK = triton.next_power_of_2(D)
    _gated_rope_kv_kernel[(R, n_heads + kv_heads)](
        qkv, positions, slots, cos_sin_cache, k_cache, v_cache, q_out, q_norm, k_norm,
        block_table if paged else positions,
        n_heads, kv_heads, float(eps), k_cache.shape[1] if paged else 1,
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        D=D, RD=rotary_dim, BLOCK=BLOCK, PAGED=paged,
        num_warps=1 if BLOCK <= 128 else 2, enable_fp_fusion=False, **pdl.triton_opts(qkv.device))
    return q_out


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, H, D, s_o0, s_o1, s_g0, s_g1, s_y0, s_y1, img_ptr, img_q,
                         BLOCK: tl.constexpr, IMG_BT: tl.constexpr = 1, IMG_NB: tl.constexpr = 1,
                         HAS_IMG: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    act = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + r * s_o0 + h * s_o1 + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * s_g0 + h * s_g1 + offs, mask=mask, other=0.0).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
    y = (o * sg).to(act)
    tl.store(out_ptr + r * s_y0 + h * s_y1 + offs, y, mask=mask)
    if HAS_IMG:     # the output projection's staged x too (kernels/x_image.py): row r, column h * D + d
        tl.store(img_ptr + image_offsets(r, h * D + offs, img_q, IMG_BT, IMG_NB), y, mask=mask)


def sigmoid_gate_mul_triton(o: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None,
                            image: XImage | None = None) -> torch.Tensor:
    R, H, D = o.shape
    if gate.shape != o.shape or o.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"o and gate must both be [R, H, D] with a contiguous last dim, got {tuple(o.shape)}, "
                         f"{tuple(gate.shape)}")
    if out is None:
        out = torch.empty_like(o)
    if out.shape != o.shape or out.stride(2) != 1:
        raise ValueError("out must match o with a contiguous last dim")
    if image is not None:
        check_image(image, R, H * D, out.dtype, "sigmoid_gate_mul")
    if R == 0:
        return out
    BLOCK = triton.next_power_of_2(D)
    img, img_q, img_bt, img_nb, has_img = image_args(image, out)
    _sigmoid_gate_kernel[(R, H)](o, gate, out, H, D, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1),
                                 out.stride(0), out.stride(1), img, img_q, BLOCK=BLOCK, IMG_BT=img_bt, IMG_NB=img_nb,
                                 HAS_IMG=has_img, num_warps=1 if BLOCK <= 128 else 2,
                                 enable_fp_fusion=False, **pdl.triton_opts(o.device))
    return out
