"""The typed model description every other module reads (built from GGUF metadata)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from onepass.kernels.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1/3.2); `None` on the config means plain RoPE."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


LAYER_ATTENTION = "attention"  # full (softmax) attention over the slot's KV
LAYER_GDN = "gdn"  # Gated DeltaNet: per-slot recurrent state + conv ring, no KV


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen3" | "qwen35"
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
    # --- hybrid models (qwen35: Gated DeltaNet + gated attention). The defaults describe a plain
    # decoder (every layer full attention, full rotary, no gate, no MTP), so llama/qwen3 are unchanged.
    full_attention_interval: int = 1  # layer i is full attention iff (i + 1) % interval == 0; others GDN
    rotary_dim: int | None = None  # dims of each q/k head that RoPE rotates (NEOX pairs); None = head_dim
    rope_sections: tuple[int, ...] = ()  # qwen35 M-RoPE sections (kept for the file; text-only RoPE ignores them)
    attn_output_gate: bool = False  # attn_q packs [q | gate] per head; output *= sigmoid(gate)
    gdn_k_heads: int = 0  # GDN query/key heads (GGUF ssm.group_count)
    gdn_v_heads: int = 0  # GDN value heads (ssm.time_step_rank), a multiple of gdn_k_heads
    gdn_k_dim: int = 0  # per-head key dim = recurrent state rows (ssm.state_size)
    gdn_v_dim: int = 0  # per-head value dim = state columns (ssm.inner_size / ssm.time_step_rank)
    gdn_conv_kernel: int = 0  # causal depthwise conv width K (ssm.conv_kernel); the ring keeps K-1 inputs
    mtp_layers: int = 0  # multi-token-prediction blocks stored after the trunk (GGUF nextn_predict_layers)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def __post_init__(self) -> None:
        sizes = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size")
        problems = [f"{k} {getattr(self, k)} < 1" for k in sizes if getattr(self, k) < 1]
        problems += [f"{k} {getattr(self, k)} must be finite and > 0" for k in ("norm_eps", "rope_theta")
                     if not 0 < getattr(self, k) < math.inf]
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_kv_heads {self.n_kv_heads} does not divide n_heads {self.n_heads}")
        if problems or self.arch != "qwen35":
            if problems:
                raise ConfigError(f"model config {self.name!r}: " + "; ".join(problems))
            return
        problems = [msg for bad, msg in (
            (self.full_attention_interval < 1, f"full_attention_interval {self.full_attention_interval} < 1"),
            (min(self.gdn_k_heads, self.gdn_v_heads, self.gdn_k_dim, self.gdn_v_dim) < 1 and self.gdn_layers,
             "GDN head counts and dims must be >= 1"),
            (self.gdn_k_heads > 0 and self.gdn_v_heads % self.gdn_k_heads != 0,
             f"gdn_v_heads {self.gdn_v_heads} is not a multiple of gdn_k_heads {self.gdn_k_heads}"),
            (self.gdn_conv_kernel < 1 and self.gdn_layers, f"gdn_conv_kernel {self.gdn_conv_kernel} < 1"),
            (not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2,
             f"rotary_dim {self.rope_dim} must be even and in 1..head_dim {self.head_dim}"),
            (self.n_heads % max(self.n_kv_heads, 1) != 0, f"n_heads {self.n_heads} not a multiple of n_kv_heads"),
            (self.mtp_layers < 0, f"mtp_layers {self.mtp_layers} < 0"),
        ) if bad]
        if problems:
            raise ConfigError(f"qwen35 config {self.name!r}: " + "; ".join(problems))

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """LAYER_ATTENTION or LAYER_GDN for each trunk layer (MTP blocks are not trunk layers)."""
        n = max(self.full_attention_interval, 1)
        return tuple(LAYER_ATTENTION if (i + 1) % n == 0 else LAYER_GDN for i in range(self.n_layers))

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices of the GDN (recurrent) trunk layers, in order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LAYER_GDN)

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_k_heads * self.gdn_k_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_v_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv and its ring: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every weight, in torch (out, in) order, keyed by GGUF tensor name."""
        if self.arch == "qwen35":
            return self._qwen35_shapes()
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

    def _qwen35_attention_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        q_rows = self.q_dim * (2 if self.attn_output_gate else 1)
        return {
            p + "attn_q.weight": (q_rows, self.dim),
            p + "attn_k.weight": (self.kv_dim, self.dim),
            p + "attn_v.weight": (self.kv_dim, self.dim),
            p + "attn_output.weight": (self.dim, self.q_dim),
            p + "attn_q_norm.weight": (self.head_dim,),
            p + "attn_k_norm.weight": (self.head_dim,),
        }

    def _qwen35_shapes(self) -> dict[str, tuple[int, ...]]:
        """qwen35 as llama.cpp's converter writes it: `post_attention_norm` is the pre-FFN norm; GDN
        layers carry attn_qkv / attn_gate (= z) / ssm_*; `ssm_a` has no `.weight` suffix; MTP blocks
        follow the trunk at blk.{n_layers + j} (a full-attention block plus nextn.*)."""
        d, f = self.dim, self.ffn_dim
        s: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.vocab_size, d), "output_norm.weight": (d,)}
        if not self.tie_embeddings:
            s["output.weight"] = (self.vocab_size, d)
        blocks = list(enumerate(self.layer_kinds))
        blocks += [(self.n_layers + j, "mtp") for j in range(self.mtp_layers)]
        for i, kind in blocks:
            p = f"blk.{i}."
            s[p + "attn_norm.weight"] = (d,)
            if kind == LAYER_GDN:
                hv = self.gdn_v_heads
                s[p + "attn_qkv.weight"] = (self.gdn_conv_dim, d)
                s[p + "attn_gate.weight"] = (self.gdn_value_dim, d)
                s[p + "ssm_conv1d.weight"] = (self.gdn_conv_dim, self.gdn_conv_kernel)
                s[p + "ssm_dt.bias"] = (hv,)
                s[p + "ssm_a"] = (hv,)
                s[p + "ssm_beta.weight"] = (hv, d)
                s[p + "ssm_alpha.weight"] = (hv, d)
                s[p + "ssm_norm.weight"] = (self.gdn_v_dim,)
                s[p + "ssm_out.weight"] = (d, self.gdn_value_dim)
            else:
                s.update(self._qwen35_attention_shapes(p))
            s[p + "post_attention_norm.weight"] = (d,)
            s[p + "ffn_gate.weight"] = (f, d)
            s[p + "ffn_up.weight"] = (f, d)
            s[p + "ffn_down.weight"] = (d, f)
            if kind == "mtp":
                s[p + "nextn.eh_proj.weight"] = (d, 2 * d)
                s[p + "nextn.enorm.weight"] = (d,)
                s[p + "nextn.hnorm.weight"] = (d,)
                s[p + "nextn.shared_head_norm.weight"] = (d,)
        return s

    def optional_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensors a file may carry (loaded and shape-checked when present): the MTP block's own
        embedding and head, which Qwen3.5 leaves out (the block shares token_embd / output)."""
        s: dict[str, tuple[int, ...]] = {}
        for j in range(self.mtp_layers if self.arch == "qwen35" else 0):
            p = f"blk.{self.n_layers + j}.nextn."
            s[p + "embed_tokens.weight"] = (self.vocab_size, self.dim)
            s[p + "shared_head_head.weight"] = (self.vocab_size, self.dim)
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
