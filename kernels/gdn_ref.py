"""The Gated DeltaNet's math in plain torch: what the GDN kernels (kernels/gdn.py) must compute, and what the
qwen35 reference model (engine/models/qwen35.py) runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # HF / FLA l2norm: x * rsqrt(sum(x^2) + 1e-6)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def causal_conv(x: torch.Tensor, w: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x [B, T, C] (pre-conv inputs, fp32 math). ring [slots, C, K-1]
    holds each slot's previous K-1 inputs, oldest first; it is advanced to the newest K-1.
    out[t, c] = silu(sum_j w[c, j] * win[c, t + j]) with win = ring ++ x (tap K-1 = the newest)."""
    K, T = w.shape[1], x.shape[1]
    win = torch.cat((ring[slots].float(), x.float().transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    wf = w.float()
    out = win[..., 0:T] * wf[:, 0:1]
    for j in range(1, K):
        out = out + win[..., j:j + T] * wf[:, j:j + 1]
    if K > 1:
        ring[slots] = win[..., T:].to(ring.dtype)  # the last K-1 columns
    return F.silu(out).transpose(1, 2)


def delta_rule(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gated delta rule, one token at a time, fp32. q, k [B, T, Hv, Dk] (already expanded to the value
    heads), v [B, T, Hv, Dv], g (log decay) and beta [B, T, Hv]; pool [slots, Hv, Dk, Dv] is read for
    `slots` and written back. A bf16 pool is rounded after every token, as decode would store it.
    Returns o [B, T, Hv, Dv]."""
    S = pool[slots].float()
    round_each = pool.dtype != torch.float32
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        recall = (S * k_t[..., None]).sum(-2)  # S^T k   [B, Hv, Dv]
        delta = beta[:, t, :, None] * (v[:, t] - recall)
        S = S + k_t[..., None] * delta[..., None, :]  # + k (x) delta
        if round_each:
            S = S.to(pool.dtype).float()
        out.append((S * q[:, t, ..., None]).sum(-2))  # S^T q, read after the update
    pool[slots] = S.to(pool.dtype)
    return torch.stack(out, dim=1)
