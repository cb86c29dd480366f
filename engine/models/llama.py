"""LLaMA decoder (also the base of Qwen3): plain torch that reads like the math.

One forward serves every phase: `tokens[b, t]` sits at `positions[b, t]` of slot `slots[b]`, writes
its K/V there and attends to that slot's positions <= its own. Decode is T = 1 with each slot at its
own position; prefill is either T = 1 per step (the seed's way) or T = prompt length at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass.engine.config import ModelConfig
from onepass.engine.models.base import DecoderBase
from onepass.kernels.rope import rope_cos_sin, rope_inv_freq
from onepass.kernels.attention import attention_ref as attention
from onepass.kernels.rmsnorm import rms_norm_ref as rms_norm
from onepass.kernels.rope import apply_rope_ref as apply_rope
from onepass.kernels.swiglu import swiglu_ref as swiglu


class LlamaModel(DecoderBase):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        self._init_head(weights)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, weights.get("rope_freqs.weight"))
        self.layers = [self._layer(i) for i in range(cfg.n_layers)]

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        p = f"blk.{i}."
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
        return {n: self.w[p + n + ".weight"] for n in names}

    def qk_norm(self, layer: dict, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # LLaMA has none; Qwen3 overrides

    def attention(self, i: int, layer: dict, h: torch.Tensor, positions, slots, kv, cos, sin,
                  span: int) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = h.shape
        q = F.linear(h, layer["attn_q"]).view(B, T, cfg.n_heads, cfg.head_dim)
        k = F.linear(h, layer["attn_k"]).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = F.linear(h, layer["attn_v"]).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        q, k = self.qk_norm(layer, q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(i, slots, positions, k, v)
        k_all, v_all = kv.read(i, slots, span)
        out = attention(q, k_all, v_all, positions)
        return F.linear(out.reshape(B, T, cfg.q_dim), layer["attn_output"])

    def feed_forward(self, layer: dict, h: torch.Tensor) -> torch.Tensor:
        act = swiglu(F.linear(h, layer["ffn_gate"]), F.linear(h, layer["ffn_up"]))
        return F.linear(act, layer["ffn_down"])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv,
                last_only: bool = True) -> torch.Tensor:
        """tokens, positions: [B, T]; slots: [B]. Returns fp32 logits [B, V] (last token) or [B, T, V]."""
        eps = self.cfg.norm_eps
        x = self.embed[tokens]
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        span = int(positions.max()) + 1  # keys beyond the newest position are never visible
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, layer, rms_norm(x, layer["attn_norm"], eps), positions, slots, kv, cos, sin, span)
            x = x + self.feed_forward(layer, rms_norm(x, layer["ffn_norm"], eps))
        if last_only:
            x = x[:, -1]
        return F.linear(rms_norm(x, self.out_norm, eps), self.lm_head).float()
