"""The typed model description every other module reads (built from GGUF metadata)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1/3.2); `None` on the config means plain RoPE."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen3"
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    context_length: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    name: str = ""
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every weight, in torch (out, in) order, keyed by GGUF tensor name."""
        s: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, self.dim),
            "output_norm.weight": (self.dim,),
        }
        if not self.tie_embeddings:
            s["output.weight"] = (self.vocab_size, self.dim)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            s[p + "attn_norm.weight"] = (self.dim,)
            s[p + "attn_q.weight"] = (self.q_dim, self.dim)
            s[p + "attn_k.weight"] = (self.kv_dim, self.dim)
            s[p + "attn_v.weight"] = (self.kv_dim, self.dim)
            s[p + "attn_output.weight"] = (self.dim, self.q_dim)
            s[p + "ffn_norm.weight"] = (self.dim,)
            s[p + "ffn_gate.weight"] = (self.ffn_dim, self.dim)
            s[p + "ffn_up.weight"] = (self.ffn_dim, self.dim)
            s[p + "ffn_down.weight"] = (self.dim, self.ffn_dim)
            if self.qk_norm:
                s[p + "attn_q_norm.weight"] = (self.head_dim,)
                s[p + "attn_k_norm.weight"] = (self.head_dim,)
        return s

    def param_count(self) -> int:
        n = 0
        for shape in self.tensor_shapes().values():
            k = 1
            for d in shape:
                k *= d
            n += k
        return n


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """llama.cpp's `rope_freqs` tensor for Llama 3.1/3.2: per frequency pair, the divisor applied
    to inv_freq (1 for short wavelengths, `factor` for long ones, smooth blend in between),
    computed in float32 as convert_hf_to_gguf does."""
    import torch  # keeps this module importable without loading torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_context / scaling.low_freq_factor
    high_wavelen = scaling.original_context / scaling.high_freq_factor
    smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = 1 / ((1 - smooth) / scaling.factor + smooth)
    out = torch.where(wavelen > low_wavelen, torch.full_like(wavelen, scaling.factor), blended)
    return torch.where(wavelen < high_wavelen, torch.ones_like(wavelen), out)
