"""Per-slot contiguous KV cache: every slot owns ctx positions in every layer (the seed's layout).

k[layer] has shape [slots, ctx, kv_heads, head_dim]; a token of slot s at position p lives at
k[layer][s, p]. Writes and reads go through slot ids, so a step may touch any subset of slots.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig


class ContiguousKVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, ctx: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, ctx, cfg.n_kv_heads, cfg.head_dim)
        self.num_slots, self.ctx = num_slots, ctx
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, T, KVH, D] for tokens at positions [B, T] of slots [B]."""
        rows = slots.unsqueeze(1).expand_as(positions)
        self.k[layer][rows, positions] = k.to(self.k[layer].dtype)
        self.v[layer][rows, positions] = v.to(self.v[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..length-1 of each slot: two [B, length, KVH, D] tensors."""
        return self.k[layer][slots, :length], self.v[layer][slots, :length]
