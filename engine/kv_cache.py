"""Per-slot contiguous KV cache: every slot owns ctx positions in every layer (the seed's layout).

k[layer] has shape [slots, ctx, kv_heads, head_dim]; a token of slot s at position p lives at
k[layer][s, p]. Writes and reads go through slot ids, so a step may touch any subset of slots.
"""
from __future__ import annotations

import torch

from onepass.engine.config import ModelConfig


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


class PagedKVCache:
    """KV in a shared pool of fixed-size blocks: k[layer] is [num_blocks, block_size, kv_heads, head_dim].

    Slot s reads and writes through row s of `block_table` [num_slots + 1, max_blocks] (int32, on the
    device): position p lives in block block_table[s, p // block_size] at offset p % block_size. The
    last row belongs to the scratch slot and points at block 0, the scratch block, as do unused entries.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int, ctx: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots + 1
        self.max_blocks = -(-ctx // block_size)
        self.ctx = self.max_blocks * block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.block_table = torch.zeros(self.num_slots, self.max_blocks, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def set_tables(self, tables: dict[int, list[int]]) -> None:
        """Rewrite the block-table rows of the given slots (one small host-to-device copy)."""
        if not tables:
            return
        rows = torch.tensor([blocks + [0] * (self.max_blocks - len(blocks)) for blocks in tables.values()],
                            dtype=torch.int32)
        idx = torch.tensor(list(tables), dtype=torch.long)
        self.block_table[idx.to(self.block_table.device)] = rows.to(self.block_table.device, non_blocking=True)
