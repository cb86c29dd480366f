"""Qwen3.5 / 3.6 / 3.8 hybrid decoder (GGUF arch `qwen35`): Gated DeltaNet layers with every
`full_attention_interval`-th layer a gated full-attention layer. Plain torch that reads like the math.

Block (both kinds):   h += Mixer(rms_norm(h) * attn_norm);  h += SwiGLU(rms_norm(h) * post_attention_norm)
Gated attention:      attn_q rows per head = [q | gate]; per-head RMSNorm of q and k; NEOX RoPE over the
                      first rotary_dim dims only; GQA softmax attention over the slot's KV;
                      out = o * sigmoid(gate) -> attn_output
Gated DeltaNet (GDN): qkv = attn_qkv(a) -> causal depthwise conv (K taps over the slot's last K-1
                      pre-conv rows + the new ones) -> SiLU -> split [q | k | v]; q, k l2-normalised
                      (q also scaled by Dk^-1/2); beta = sigmoid(ssm_beta(a)),
                      g = ssm_a * softplus(ssm_alpha(a) + ssm_dt) <= 0, per value head h (k head h // (Hv/Hk)):
                          S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q      (S: [Dk, Dv], fp32)
                      out = ssm_out( rms_norm(o) * ssm_norm * silu(z) ),  z = attn_gate(a)

Weights follow the loader's convention (engine/gguf_loader.py): GGUF names and values (norm gains
already hold HF's 1 + w, ssm_a = -exp(A_log)), value heads in HF grouped order.

Calling convention is LlamaModel's: forward(tokens [B, T], positions [B, T], slots [B], kv). The
attention layers read/write `kv` at their trunk layer index; the GDN layers keep their state in a
StatePool (engine/state_pool.py), taken from `state=` or else from `kv.state` (a HybridCache), so
reference_generate (engine/models/generate.py) drives this model unchanged. A row starting at position 0 starts
a new sequence in its slot (its state is zeroed); other rows must continue their slot's sequence. T may
be anything: the conv and the delta rule run token by token inside the forward, so prefill in chunks
of any width walks the same recurrence as decode (agreeing to GEMM rounding, not bit for bit).

MTP head (multi-token prediction, blk.{n_layers + j}.*: one gated full-attention block plus nextn.*), a draft model
for speculative decoding (../shared/notes/qwen35-hybrid.md section 3; vLLM qwen3_5_mtp.py, llama.cpp graph_mtp):
    e   = rms_norm(embed(t_{p+1})) * enorm        h = rms_norm(h_p) * hnorm
    x   = eh_proj(cat[e, h])                      the embedding first; h_p the trunk's *final-normed* hidden at p
    x  += GatedAttn(rms_norm(x) * attn_norm, position p)    over the block's own KV cache
    x  += SwiGLU(rms_norm(x) * post_attention_norm)
    out = rms_norm(x) * shared_head_norm ;  draft logits = lm_head(out)     (shared embedding and head)
The draft for t_{p+2}. Chained for more drafts: the next row is (the draft, out, position p + 1). `mtp_forward` is the
block; `mtp_reference_drafts` the whole draft from scratch for a known sequence.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from onepass.engine.config import LAYER_ATTENTION, ModelConfig
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.state_pool import HybridCache
from onepass.kernels.errors import ConfigError
from onepass.engine.models.base import DecoderBase
from onepass.kernels.gdn_ref import causal_conv, delta_rule, l2norm
from onepass.kernels.rope import rope_cos_sin, rope_inv_freq
from onepass.kernels.attention import attention_ref as attention
from onepass.kernels.rmsnorm import rms_norm_ref as rms_norm
from onepass.kernels.rope import apply_rope_ref as apply_rope
from onepass.kernels.swiglu import swiglu_ref as swiglu

_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_GDN = ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_beta", "ssm_alpha", "ssm_norm", "ssm_out")
_COMMON = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")


class Qwen35Model(DecoderBase):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        self._init_head(weights)
        self.inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, weights.get("rope_freqs.weight"))
        self.layers = [self._layer(i, kind) for i, kind in enumerate(cfg.layer_kinds)]
        # MTP blocks (blk.{n_layers + j}.*): loaded and kept for a draft head, never run by forward()
        self.mtp_weights = {n: t for n, t in weights.items()
                            if n.startswith("blk.") and int(n.split(".")[1]) >= cfg.n_layers}

    def _layer(self, i: int, kind: str) -> dict:
        p = f"blk.{i}."
        names = _COMMON + (_ATTENTION if kind == LAYER_ATTENTION else _GDN)
        layer = {n: self.w[p + n + ".weight"] for n in names}
        if kind != LAYER_ATTENTION:
            layer["ssm_a"] = self.w[p + "ssm_a"]  # -exp(A_log); no .weight suffix in GGUF
            layer["ssm_dt"] = self.w[p + "ssm_dt.bias"]
        layer["kind"] = kind
        return layer

    # --- gated full attention -----------------------------------------------------------------------

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE over the first rotary_dim dims of each head; the rest pass through."""
        rd = self.cfg.rope_dim
        if rd == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)

    def attention(self, i: int, layer: dict, a: torch.Tensor, positions, slots, kv, cos, sin,
                  span: int) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.norm_eps
        B, T, _ = a.shape
        H, hd = cfg.n_heads, cfg.head_dim
        if cfg.attn_output_gate:
            qg = F.linear(a, layer["attn_q"]).view(B, T, H, 2 * hd)  # per head [q | gate]
            q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, H * hd)
        else:
            q, gate = F.linear(a, layer["attn_q"]).view(B, T, H, hd), None
        k = F.linear(a, layer["attn_k"]).view(B, T, cfg.n_kv_heads, hd)
        v = F.linear(a, layer["attn_v"]).view(B, T, cfg.n_kv_heads, hd)
        q, k = rms_norm(q, layer["attn_q_norm"], eps), rms_norm(k, layer["attn_k_norm"], eps)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        kv.write(i, slots, positions, k, v)
        k_all, v_all = kv.read(i, slots, span)
        o = attention(q, k_all, v_all, positions).reshape(B, T, H * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return F.linear(o, layer["attn_output"])

    # --- Gated DeltaNet -----------------------------------------------------------------------------

    causal_conv = staticmethod(causal_conv)
    delta_rule = staticmethod(delta_rule)

    def gated_delta_net(self, j: int, layer: dict, a: torch.Tensor, slots, state) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = a.shape
        hk, hv, dk, dv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
        qkv = F.linear(a, layer["attn_qkv"])  # [B, T, conv_dim]: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]
        z = F.linear(a, layer["attn_gate"]).view(B, T, hv, dv)
        beta = torch.sigmoid(F.linear(a, layer["ssm_beta"]).float())  # [B, T, Hv]
        g = layer["ssm_a"].float() * F.softplus(F.linear(a, layer["ssm_alpha"]).float() + layer["ssm_dt"].float())

        c = self.causal_conv(qkv, layer["ssm_conv1d"], state.conv[j], slots)
        q, k, v = c.split((cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim), dim=-1)
        q = l2norm(q.reshape(B, T, hk, dk)) * dk ** -0.5
        k = l2norm(k.reshape(B, T, hk, dk))
        r = hv // hk  # grouped value heads: v head h reads q/k head h // r
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        o = self.delta_rule(q, k, v.reshape(B, T, hv, dv), g, beta, state.ssm[j], slots)

        o = rms_norm(o, layer["ssm_norm"], cfg.norm_eps) * F.silu(z.float())  # norm, then SiLU gate
        return F.linear(o.reshape(B, T, cfg.gdn_value_dim).to(a.dtype), layer["ssm_out"])

    # --- the step -----------------------------------------------------------------------------------

    def feed_forward(self, layer: dict, h: torch.Tensor) -> torch.Tensor:
        act = swiglu(F.linear(h, layer["ffn_gate"]), F.linear(h, layer["ffn_up"]))
        return F.linear(act, layer["ffn_down"])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv,
                last_only: bool = True, state=None, return_hidden: bool = False):
        """tokens, positions: [B, T]; slots: [B]. Returns fp32 logits [B, V] (last token) or [B, T, V]; with
        return_hidden also the final-normed hidden states they come from ([B, dim] or [B, T, dim]: the MTP's h_p)."""
        eps = self.cfg.norm_eps
        state = state if state is not None else getattr(kv, "state", None)
        if state is None and self.cfg.gdn_layers:
            raise ConfigError("qwen35 keeps per-slot recurrent state: pass kv=HybridCache(kv, StatePool(...)) "
                              "or state=StatePool(...) (engine/state_pool.py)")
        if state is not None and state.writeback != 1:
            raise ConfigError(f"the reference qwen35 model reads and writes every slot's whole state each token; its "
                              f"pool is written back every {state.writeback} tokens (a fused-decoder option): build "
                              "it with writeback=1 (kv_cache.state_writeback=1)")
        if state is not None:
            state.begin(slots, positions)  # zero slots starting at position 0; check continuity
        x = self.embed[tokens]
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        span = int(positions.max()) + 1
        for i, layer in enumerate(self.layers):
            a = rms_norm(x, layer["attn_norm"], eps)
            if layer["kind"] == LAYER_ATTENTION:
                x = x + self.attention(i, layer, a, positions, slots, kv, cos, sin, span)
            else:
                x = x + self.gated_delta_net(state.index[i], layer, a, slots, state)
            x = x + self.feed_forward(layer, rms_norm(x, layer["post_attention_norm"], eps))
        if state is not None:
            state.advance(slots, tokens.shape[1])
        if last_only:
            x = x[:, -1]
        normed = rms_norm(x, self.out_norm, eps)
        logits = F.linear(normed, self.lm_head).float()
        return (logits, normed) if return_hidden else logits

    # --- the MTP head -------------------------------------------------------------------------------

    @torch.inference_mode()
    def mtp_forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    kv, j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP block j (module doc): tokens [B, T] = t_{p+1}, hidden [B, T, dim] = h_p (the trunk's final-normed
        hidden state, or when chaining the block's own `out` one position back), positions p [B, T], slots [B]; kv: the
        block's own KV (mtp_cache), written at p. Returns (fp32 draft logits [B, T, V] for t_{p+2}, out [B, T, dim])."""
        cfg, eps = self.cfg, self.cfg.norm_eps
        if not 0 <= j < cfg.mtp_layers:
            raise ConfigError(f"MTP block {j}: the model has {cfg.mtp_layers}")
        p = f"blk.{cfg.n_layers + j}."
        embed = self.w.get(p + "nextn.embed_tokens.weight", self.embed)
        head = self.w.get(p + "nextn.shared_head_head.weight", self.lm_head)
        e = rms_norm(embed[tokens], self.w[p + "nextn.enorm.weight"], eps)
        h = rms_norm(hidden, self.w[p + "nextn.hnorm.weight"], eps)
        x = F.linear(torch.cat((e, h), dim=-1), self.w[p + "nextn.eh_proj.weight"])   # embedding first
        layer = self._layer(cfg.n_layers + j, LAYER_ATTENTION)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        span = int(positions.max()) + 1
        x = x + self.attention(j, layer, rms_norm(x, layer["attn_norm"], eps), positions, slots, kv, cos, sin, span)
        x = x + self.feed_forward(layer, rms_norm(x, layer["post_attention_norm"], eps))
        out = rms_norm(x, self.w[p + "nextn.shared_head_norm.weight"], eps)
        return F.linear(out, head).float(), out


def mtp_cache(cfg: ModelConfig, slots: int, ctx: int, dtype: torch.dtype, device) -> ContiguousKVCache:
    """The MTP blocks' own KV: one attention layer a block, layer j for block j."""
    return ContiguousKVCache(replace(cfg, n_layers=cfg.mtp_layers, mtp_layers=0, full_attention_interval=1), slots,
                             ctx, dtype, device)


@torch.inference_mode()
def mtp_reference_drafts(model: Qwen35Model, tokens: list[int], k: int) -> list[int]:
    """k greedy MTP drafts after `tokens` (the newest last, not fed to the trunk yet), from scratch: the trunk over
    tokens[:-1] gives h_0 .. h_{L-2}; the block is fed (t_{q+1}, h_q) at q = 0 .. L-2, whose last row drafts t_L; then
    each draft and the block's own output, one position on, draft the next."""
    cfg, L = model.cfg, len(tokens)
    if L < 2 or k < 1:
        raise ConfigError(f"an MTP draft needs a fed token and the newest one (got {L} tokens) and k >= 1 (got {k})")
    dev, dt = model.embed.device, model.out_norm.dtype
    t = lambda x: torch.tensor(x, device=dev)   # noqa: E731
    slots, pos = t([0]), torch.arange(L - 1, device=dev)[None]
    _, h = model.forward(t([tokens[:-1]]), pos, slots, HybridCache.create(cfg, 1, L + k, dt, dev), last_only=False,
                         return_hidden=True)
    kv = mtp_cache(cfg, 1, L + k, dt, dev)
    logits, out = model.mtp_forward(t([tokens[1:]]), h, pos, slots, kv)
    drafts, out = [int(logits[0, -1].argmax())], out[:, -1:]
    for i in range(1, k):
        logits, out = model.mtp_forward(t([[drafts[-1]]]), out, t([[L - 2 + i]]), slots, kv)
        drafts.append(int(logits[0, -1].argmax()))
    return drafts
