"""Rotary position embedding in the rotate-half (NEOX) pairing: dim i pairs with i + D/2.

llama.cpp's converter stores LLaMA q/k rows interleaved; the loader un-permutes them, so LLaMA and
Qwen3 share this one convention.
"""
import torch


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
