"""Gated DeltaNet (GDN) decode kernels: one token per row, slot-indexed state pools updated in place.

A *row* r is one decode token of slot ``slots[r]``; ``slots[r] < 0`` marks a padding row (CUDA-graph
batches): its pools are not touched and its output rows are left as they are. The rows of one call must
name distinct slots (a decode step does): two rows of one slot would race on the slot's state.

conv_ring_update_{ref,triton}(x, conv_state, conv_weight, slots) -> [R, conv_dim] fp32
    x [R, C] pre-conv qkv of the token, conv_state [slots, C, K-1] (oldest first), conv_weight [C, K].
    out[r, c] = silu(sum_j w[c, j] * win[c, j]),  win = ring[slot] ++ x[r]  (tap K-1 = the new input);
    the ring is shifted in place to the newest K-1 inputs. Same math as Qwen35Model.causal_conv (T = 1).
    Kernel grid (R, cdiv(C, BLOCK_C)).

gdn_step_{ref,triton}(q, k, v, a, b, A, dt_bias, state, slots) -> o [R, Hv, Dv] fp32
    q, k [R, Hk, Dk] post-conv (not yet normalised), v [R, Hv, Dv], a (ssm_alpha(x)) and b (ssm_beta(x))
    [R, Hv], A = ssm_a = -exp(A_log) [Hv], dt_bias = ssm_dt [Hv], state pool [slots, Hv, Dk, Dv] (fp32, or
    bf16 rounded once per step). Exactly Qwen35Model.gated_delta_net's recurrence, fp32:
        q = l2norm(q) * Dk**-0.5, k = l2norm(k)        (value head h reads key head h // (Hv / Hk))
        g = A * softplus(a + dt_bias), beta = sigmoid(b)
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q     (o read after the update)
    Kernel grid (R, Hv, cdiv(Dv, BV)): each program holds one [Dk, BV] fp32 tile of S, reads it once and
    writes it once; q/k normalisation and the gates are recomputed per program (a few hundred FLOPs).
    Every program depends only on its own row, so results are batch invariant (bitwise).

Both Triton entry points take an optional ``out`` and allocate nothing else, read nothing on the host,
and accept non-contiguous row/head views (unit stride in the last dim): they can be captured in a CUDA
graph and replayed with new inputs/slots written in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.qwen35 import L2NORM_EPS, Qwen35Model, l2norm
from kernels.triton_compat import tl, triton

SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus default (beta=1): x above it passes through


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --------------------------------------------------------------------------------------------------
# torch references (the model's own functions)

def conv_ring_update_ref(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """Qwen35Model.causal_conv for one token per row; rows with slot < 0 are skipped (output 0)."""
    slots = slots.to(torch.long)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    live = slots >= 0
    if bool(live.any()):
        out[live] = Qwen35Model.causal_conv(x[live][:, None], conv_weight, conv_state, slots[live])[:, 0]
    return out


def gdn_step_ref(q, k, v, a, b, A, dt_bias, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of Qwen35Model.gated_delta_net's recurrence per row (see module doc); rows with slot < 0
    are skipped (output 0). Returns o [R, Hv, Dv] fp32; `state` is updated in place."""
    R, hk, dk = q.shape
    hv = v.shape[1]
    slots = slots.to(torch.long)
    qn = l2norm(q.float()) * dk ** -0.5
    kn = l2norm(k.float())
    r = hv // hk
    qn, kn = qn.repeat_interleave(r, dim=1), kn.repeat_interleave(r, dim=1)
    beta = torch.sigmoid(b.float())
    g = A.float() * F.softplus(a.float() + dt_bias.float())
    out = torch.zeros(R, hv, v.shape[2], dtype=torch.float32, device=v.device)
    live = slots >= 0
    if bool(live.any()):
        o = Qwen35Model.delta_rule(qn[live][:, None], kn[live][:, None], v.float()[live][:, None],
                                   g[live][:, None], beta[live][:, None], state, slots[live])
        out[live] = o[:, 0]
    return out


# --------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _conv_ring_kernel(x_ptr, ring_ptr, w_ptr, out_ptr, slots_ptr,
                      C, stride_xr, stride_or,
                      K: tl.constexpr, BK: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    cb = tl.program_id(1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    if slot >= 0:
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        j = tl.arange(0, BK)
        cm = c < C
        c2 = c[:, None]
        j2 = j[None, :]
        m2 = cm[:, None]
        x = tl.load(x_ptr + r * stride_xr + c, mask=cm, other=0.0).to(tl.float32)
        ring = ring_ptr + slot * C * (K - 1) + c2 * (K - 1)
        # window [BLOCK_C, BK]: taps 0..K-2 from the ring, tap K-1 = x, padding taps 0
        win = tl.load(ring + j2, mask=m2 & (j2 < K - 1), other=0.0).to(tl.float32)
        win = tl.where(j2 == K - 1, x[:, None], win)
        w = tl.load(w_ptr + c2 * K + j2, mask=m2 & (j2 < K), other=0.0).to(tl.float32)
        acc = tl.sum(win * w, axis=1)
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + r * stride_or + c, y, mask=cm)
        # shifted ring: new[j] = win[j + 1] (ring[j + 1] for j < K-2, x for j = K-2); loaded before the store
        nxt = tl.load(ring + j2 + 1, mask=m2 & (j2 < K - 2), other=0.0).to(tl.float32)
        nxt = tl.where(j2 == K - 2, x[:, None], nxt)
        tl.store(ring + j2, nxt.to(ring_ptr.dtype.element_ty), mask=m2 & (j2 < K - 1))


def conv_ring_update_triton(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                            slots: torch.Tensor, out: torch.Tensor | None = None,
                            block_c: int = 256) -> torch.Tensor:
    R, C = x.shape
    K = conv_weight.shape[1]
    assert K >= 2, "conv kernel needs K >= 2"
    assert conv_state.shape[1:] == (C, K - 1) and conv_state.is_contiguous(), conv_state.shape
    assert conv_weight.shape == (C, K) and conv_weight.is_contiguous()
    assert x.stride(1) == 1 and slots.shape == (R,)
    if out is None:
        out = torch.empty(R, C, dtype=torch.float32, device=x.device)
    assert out.shape == (R, C) and out.stride(1) == 1
    if R == 0:
        return out
    BLOCK_C = min(block_c, _next_pow2(C))
    grid = (R, triton.cdiv(C, BLOCK_C))
    _conv_ring_kernel[grid](x, conv_state, conv_weight, out, slots, C, x.stride(0), out.stride(0),
                            K=K, BK=_next_pow2(K), BLOCK_C=BLOCK_C, num_warps=4)
    return out


@triton.jit
def _gdn_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dt_ptr, s_ptr, o_ptr, slots_ptr,
                     stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                     stride_ar, stride_br, stride_or, stride_oh,
                     HV, DK, DV, scale, eps,
                     GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SP_THRESH: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    if slot >= 0:
        hk = h // GROUP
        kk = tl.arange(0, BK)
        vv = vb * BV + tl.arange(0, BV)
        km = kk < DK
        vm = vv < DV
        q = tl.load(q_ptr + r * stride_qr + hk * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + r * stride_kr + hk * stride_kh + kk, mask=km, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
        v = tl.load(v_ptr + r * stride_vr + h * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
        x = tl.load(a_ptr + r * stride_ar + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
        sp = tl.where(x > SP_THRESH, x, tl.log(1.0 + tl.exp(tl.minimum(x, SP_THRESH))))
        g = tl.load(A_ptr + h).to(tl.float32) * sp
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + r * stride_br + h).to(tl.float32)))

        sm = km[:, None] & vm[None, :]
        sp_ptrs = s_ptr + ((slot * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
        S = tl.load(sp_ptrs, mask=sm, other=0.0).to(tl.float32)       # [BK, BV]
        S = S * tl.exp(g)
        recall = tl.sum(S * k[:, None], axis=0)                           # S^T k  [BV]
        delta = beta * (v - recall)
        S = S + k[:, None] * delta[None, :]
        S = S.to(s_ptr.dtype.element_ty)                                  # bf16 pools: round, then read
        tl.store(sp_ptrs, S, mask=sm)
        o = tl.sum(S.to(tl.float32) * q[:, None], axis=0)                 # S^T q after the update
        tl.store(o_ptr + r * stride_or + h * stride_oh + vv, o.to(o_ptr.dtype.element_ty), mask=vm)


def gdn_step_triton(q, k, v, a, b, A, dt_bias, state: torch.Tensor, slots: torch.Tensor,
                    out: torch.Tensor | None = None, block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    R, hk, dk = q.shape
    _, hv, dv = v.shape
    assert k.shape == q.shape and hv % hk == 0
    assert state.shape[1:] == (hv, dk, dv) and state.is_contiguous(), state.shape
    assert a.shape == (R, hv) and b.shape == (R, hv) and A.shape == (hv,) and dt_bias.shape == (hv,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert slots.shape == (R,)
    if out is None:
        out = torch.empty(R, hv, dv, dtype=torch.float32, device=v.device)
    assert out.shape == (R, hv, dv) and out.stride(2) == 1
    if R == 0:
        return out
    BV = min(block_v, _next_pow2(dv))
    grid = (R, hv, triton.cdiv(dv, BV))
    _gdn_step_kernel[grid](q, k, v, a, b, A, dt_bias, state, out, slots,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           a.stride(0), b.stride(0), out.stride(0), out.stride(1),
                           hv, dk, dv, float(dk ** -0.5), L2NORM_EPS,
                           GROUP=hv // hk, BK=_next_pow2(dk), BV=BV, SP_THRESH=SOFTPLUS_THRESHOLD,
                           num_warps=num_warps)
    return out
