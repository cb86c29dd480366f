"""Attention of new query tokens over each slot's own cached keys/values (GQA)."""
import torch


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """q: [B, T, H, D] at positions q_pos [B, T]; k, v: [B, S, KVH, D] holding positions 0..S-1 of
    each slot. Key j is visible to a query at position p iff j <= p (causal over the slot's history).
    Softmax in fp32; returns [B, T, H, D] in q's dtype."""
    B, T, H, D = q.shape
    S, kvh = k.shape[1], k.shape[2]
    group = H // kvh
    qf = q.float().view(B, T, kvh, group, D)
    scores = torch.einsum("btkgd,bskd->bkgts", qf, k.float()) * (D ** -0.5)
    visible = torch.arange(S, device=q.device).view(1, 1, S) <= q_pos.unsqueeze(-1)  # [B, T, S]
    scores = scores.masked_fill(~visible.view(B, 1, 1, T, S), float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bkgts,bskd->btkgd", probs, v.float())
    return out.reshape(B, T, H, D).to(q.dtype)
