"""Qwen3: LLaMA plus an RMSNorm over each query and key head before RoPE."""
from __future__ import annotations

import torch

from onepass.engine.models.llama import LlamaModel
from onepass.kernels.rmsnorm import rms_norm_ref as rms_norm


class Qwen3Model(LlamaModel):
    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        layer = super()._layer(i)
        layer["attn_q_norm"] = self.w[f"blk.{i}.attn_q_norm.weight"]
        layer["attn_k_norm"] = self.w[f"blk.{i}.attn_k_norm.weight"]
        return layer

    def qk_norm(self, layer, q, k):
        eps = self.cfg.norm_eps
        return rms_norm(q, layer["attn_q_norm"], eps), rms_norm(k, layer["attn_k_norm"], eps)
