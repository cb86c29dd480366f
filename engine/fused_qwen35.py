"""The hybrid (qwen35: Gated DeltaNet + gated attention) decode step as a flat kernel sequence over rows.

Same math as engine/models/qwen35.py, arranged as engine/fused_model.py arranges llama/qwen3: row r is
one token of slot `slots[r]` at position `positions[r]`, every activation lives in preallocated buffers,
and the interface is FusedDecoder's (`buffers(rows)`, `hidden(...)`, `logits(...)`, `weight_bytes()`), so
the step (engine/step.py) captures it in CUDA graphs unchanged. `kv` is a HybridCache (engine/state_pool.py): its KV
cache (contiguous, or paged through `block_table`) serves the attention layers, its StatePool the GDN
layers (state [slots, Hv, Dk, Dv] and conv ring [slots, conv_dim, K-1] per GDN layer).

Per layer (h = the normed residual; every projection is `kernels.linear`, dense or packed int4):
  GDN:        [qkv | z | beta | alpha] = h @ W_in   (one GEMM: attn_qkv, attn_gate, ssm_beta, ssm_alpha)
              conv_ring_update(qkv)                  causal conv + SiLU over the slot's ring, ring shifted
              gdn_step(q, k, v, alpha, beta)         l2norm, gates, delta rule in place in the pool (state
                                                     read once, written once), o = S^T q
              gated_rms_norm(o, z) -> ssm_out       (a packed ssm_out of a file with Hv != Hk keeps the file's
                                                     column order: the norm writes its output in that order)
  attention:  [q|gate per head | k | v] = h @ W_in  (one GEMM: attn_q, attn_k, attn_v)
              gated_rope_kv_write                    q/k RMSNorm, NEOX RoPE on rotary_dim dims, KV write
              decode_attention (kernels/decode_attention.py, shared with the plain decoders)
              sigmoid_gate_mul(o, gate) -> attn_output
  FFN:        residual add fused into the pre-FFN RMSNorm; gate|up GEMM, SwiGLU, down.
A projection whose GEMM splits K leaves its partials for the next kernel (the output and down projections' to the
residual add + RMSNorm, gate|up's to SwiGLU, the GDN input projection's packed q|k|v|z to the conv ring and the
gated norm: kernels/splitk.py), which adds them as the reduce would: same bits, one launch less.

What the kernels between the GEMMs cost in a step: kernels/PROBES.md, engine/fused_qwen35.py.

Sequences start at position 0: a row (run) at position 0 makes the GDN kernels start its slot from zero
state and zero conv history, inside the kernels (no host sync, graph-safe); the attention layers simply
overwrite KV from position 0. So static batching and continuous refill need no reset call. Nothing here
keeps the StatePool's host-side token counts (`seen`): the reference model checks continuity, the fused
step trusts its rows (each slot's rows must continue its sequence or restart it at position 0).

Rows per slot: in token mode (decode, token prefill) each slot has at most one row per step. A step may
also carry runs of `seq_len` consecutive tokens per slot, slot-major (rows n*T .. n*T+T-1 of one slot:
a whole prompt, Engine.teacher_forced_logits), or ragged runs (`runs`, int32 row offsets: a step's decode
rows and prompt chunks of unequal lengths, each slot's rows together; engine/step.py builds them); the GDN
kernels walk each run in order.

Speculative verify (`spec`: the step's SpecRows, kernels/gdn.py): a slot's k + 1 rows of its newest token and drafts
are a run like any other; the GDN layers keep a verify run's updates in the pool's draft logs instead of the state,
and fold in the kept ones at the slot's next run (its `kept` count), so rejected drafts never reach the state. The
attention layers write every row's KV; a rejected row's position is simply written again later.

The MTP block's weights (blk.{n_layers}.*, `mtp_weights`) are kept as they were loaded, for engine/mtp_drafts.py.
"""
from __future__ import annotations

import torch

from onepass.engine.config import LAYER_ATTENTION, ModelConfig
from onepass.engine.gguf_loader import INPUT_ORDER
from onepass.engine.fused_model import FusedBase
from onepass.engine.projection import Projection, _nbytes
from onepass.kernels.backend import StepKernels
from onepass.kernels.errors import ConfigError
from onepass.kernels.gated_attention import gate_view
from onepass.kernels.gdn import SpecRows
from onepass.kernels.rope import rope_cache, rope_inv_freq
from onepass.kernels.splitk import SplitSums


class FusedQwen35Decoder(FusedBase):
    hybrid = True  # the step passes its prompt rows as runs; the cache must be a HybridCache

    def __init__(self, cfg: ModelConfig, weights, kernels: StepKernels, max_pos: int):
        if cfg.arch != "qwen35":
            raise ConfigError(f"FusedQwen35Decoder runs arch qwen35, got {cfg.arch!r} (use FusedDecoder)")
        self.cfg, self.k = cfg, kernels
        self._init_head(weights)
        inv = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, weights.get("rope_freqs.weight"))
        self.rope = rope_cache(inv, max_pos).to(self.embed.device)  # [max_pos, rotary_dim] = cat(cos, sin)
        self.layers = [self._layer(weights, i, kind, kernels) for i, kind in enumerate(cfg.layer_kinds)]
        self.gdn_index = {i: j for j, i in enumerate(cfg.gdn_layers)}
        # the MTP block: no trunk layer; built into a draft head only when speculation asks for it
        # (by name: weights made on access, harness/synth.py LazyWeights, are then made for these only)
        self.mtp_weights = {n: weights[n] for n in weights
                            if n.startswith("blk.") and int(n.split(".")[1]) >= cfg.n_layers}

    @staticmethod
    def _layer(weights, i: int, kind: str, k: StepKernels) -> dict:
        def w(n):
            return weights[f"blk.{i}.{n}"]

        def proj(*names):
            return Projection([w(f"{n}.weight") for n in names], k)

        layer = {"kind": kind, "attn_norm": w("attn_norm.weight"), "ffn_norm": w("post_attention_norm.weight"),
                 "gate_up": proj("ffn_gate", "ffn_up"), "down": proj("ffn_down")}
        if kind == LAYER_ATTENTION:
            layer.update(in_proj=proj("attn_q", "attn_k", "attn_v"),
                         q_norm=w("attn_q_norm.weight").contiguous(), k_norm=w("attn_k_norm.weight").contiguous(),
                         out=proj("attn_output"))
        else:
            layer.update(in_proj=proj("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
                         conv=w("ssm_conv1d.weight").contiguous(), A=w("ssm_a").contiguous(),
                         dt=w("ssm_dt.bias").contiguous(), ssm_norm=w("ssm_norm.weight").contiguous(),
                         out=proj("ssm_out"))
            # a packed ssm_out from a file with Hv != Hk keeps the file's (tiled) V-head column order (gguf_loader):
            # its input column c is the gated norm's grouped column order[c], so the norm writes grouped column j
            # to column argsort(order)[j]
            order = weights.get(f"blk.{i}.ssm_out{INPUT_ORDER}")
            if order is not None:
                order = order.to(device=w("ssm_norm.weight").device, dtype=torch.long)
                layer["out_cols"] = order.argsort().to(torch.int32).contiguous()
        return layer

    def weight_bytes(self) -> int:
        """Bytes one step reads from weights (embedding rows are a gather: not counted)."""
        n = _nbytes(self.lm_head) + _nbytes(self.out_norm)
        for layer in self.layers:
            for v in layer.values():
                if isinstance(v, Projection):
                    n += v.nbytes
                elif isinstance(v, torch.Tensor):
                    n += _nbytes(v)
        return n

    def buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """Every activation of a step with `rows` rows, allocated once (a CUDA graph replays on them)."""
        c, dev, dt = self.cfg, self.device, self.dtype
        e = lambda *s, dtype=dt: torch.empty(*s, device=dev, dtype=dtype)  # noqa: E731
        buf = {"residual": e(rows, c.dim), "h": e(rows, c.dim), "x": e(rows, c.dim),
               "gate_up": e(rows, 2 * c.ffn_dim), "act": e(rows, c.ffn_dim)}
        if c.gdn_layers:
            buf.update(gdn_in=e(rows, c.gdn_conv_dim + c.gdn_value_dim + 2 * c.gdn_v_heads),
                       conv=e(rows, c.gdn_conv_dim, dtype=torch.float32),
                       gdn_o=e(rows, c.gdn_v_heads, c.gdn_v_dim, dtype=torch.float32),
                       gdn_y=e(rows, c.gdn_value_dim))
            if any("out_cols" in layer for layer in self.layers):
                buf["gdn_y_file"] = e(rows, c.gdn_value_dim)  # ssm_out's input in the file's column order
        if len(c.gdn_layers) < c.n_layers:
            buf.update(attn_in=e(rows, 2 * c.q_dim + 2 * c.kv_dim), q=e(rows, c.n_heads, c.head_dim),
                       attn=e(rows, c.n_heads, c.head_dim))
        return buf

    def hidden(self, tokens, positions, slots, kv, buf, attn_ws=None, block_table=None, max_len=None,
               seq_len: int = 1, runs: torch.Tensor | None = None, spec: SpecRows | None = None) -> torch.Tensor:
        """Run every layer over the rows; returns the final residual stream [R, dim] (before the last norm).
        Every position must be < max_len (default: the cache's ctx). seq_len > 1: the rows are slot-major
        runs of seq_len consecutive positions of one slot; runs: ragged runs instead, int32 row offsets (a serving
        step's decode rows and prompt chunks; see the module docstring). spec: speculative verify (module doc), with
        the pool's draft logs reserved (StatePool.reserve_drafts)."""
        state = getattr(kv, "state", None)
        if state is None:
            raise ConfigError("the hybrid decoder keeps per-slot recurrent state: pass kv=HybridCache(kv_cache, "
                              "StatePool(...)) (engine/state_pool.py)")
        if spec is not None and state.layers and state.draft[0] is None:
            raise ConfigError("speculative verify keeps its rows' updates in the state pool's draft logs: call "
                              "StatePool.reserve_drafts(k + 1) first")
        R = tokens.shape[0]
        if seq_len < 1 or R % seq_len:
            raise ConfigError(f"{R} rows do not split into runs of seq_len={seq_len}")
        k, eps = self.k, self.cfg.norm_eps
        cache = kv.kv
        res, h = buf["residual"], buf["h"]
        k.embedding(tokens, self.embed, out=res)
        # x: a projection's output, or its split-K partials left for the next kernel to add (kernels/splitk.py):
        # every deferred GEMM is consumed before the next GEMM runs
        # img: the next GEMM's staged x, written by the kernel that makes x (Projection.image, kernels/x_image.py)
        x = buf["x"]
        for i, layer in enumerate(self.layers):
            img = layer["in_proj"].image(h)
            if i == 0:
                k.rms_norm(res, layer["attn_norm"], eps, out=h, image=img)
            else:
                k.add_rms_norm(x, res, layer["attn_norm"], eps, out=h, image=img)  # res += x (the last FFN output)
            if layer["kind"] == LAYER_ATTENTION:
                x = self._attention(i, layer, h, img, positions, slots, cache, buf, attn_ws, block_table, max_len)
            else:
                x = self._gdn(self.gdn_index[i], layer, h, img, positions, slots, state, buf, seq_len, runs, spec)
            x = self.feed_forward(layer, x, res, h, buf, defer=i + 1 < len(self.layers))   # the last: a tensor
        k.add_residual(x, res)
        return res

    def _attention(self, i, layer, h, h_image, positions, slots, cache, buf, attn_ws, block_table, max_len):
        c, k = self.cfg, self.k
        qkv = layer["in_proj"](h, buf["attn_in"], x_image=h_image)
        k.gated_rope_kv_write(qkv, positions, slots, self.rope, cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads,
                               c.head_dim, c.rope_dim, layer["q_norm"], layer["k_norm"], c.norm_eps,
                               block_table=block_table, q_out=buf["q"])
        k.decode_attention(buf["q"], cache.k[i], cache.v[i], slots, positions, block_table=block_table,
                           out=buf["attn"], workspace=attn_ws, max_len=max_len or cache.ctx)
        attn = buf["attn"].view(-1, c.q_dim)
        img = layer["out"].image(attn)
        k.sigmoid_gate_mul(buf["attn"], gate_view(qkv, c.n_heads, c.head_dim), out=buf["attn"], image=img)
        return layer["out"](attn, buf["x"], defer=True, x_image=img)

    def _gdn(self, j, layer, h, h_image, positions, slots, state, buf, seq_len: int, runs: torch.Tensor | None = None,
             spec: SpecRows | None = None):
        c, k = self.cfg, self.k
        R = h.shape[0]
        C, V, Hv = c.gdn_conv_dim, c.gdn_value_dim, c.gdn_v_heads
        # [qkv (C) | z (V) | beta (Hv) | alpha (Hv)]. The packed q|k|v|z GEMM beside the dense beta|alpha rows leaves
        # its split-K partials unreduced: the conv ring and the gated norm add their columns' (kernels/splitk.py),
        # a launch less per layer; no GEMM runs between it and them
        proj_w = layer["in_proj"]
        proj = proj_w(h, buf["gdn_in"], defer=proj_w.main_cols() == (0, C + V), x_image=h_image)
        if isinstance(proj, SplitSums):                               # beta|alpha: written into the buffer
            qkv, z, ba = proj.cols(0, C), proj.cols(C, C + V), buf["gdn_in"]
        else:
            qkv, z, ba = proj[:, :C], proj[:, C:C + V], proj
        beta, alpha = ba[:, C + V:C + V + Hv], ba[:, C + V + Hv:C + V + 2 * Hv]
        # speculative verify: a verify run's rows wait in the draft log; kept ones are folded in first
        drafts = {} if spec is None else {"spec": spec, "draft": state.draft[j]}
        conv = k.conv_ring_update(qkv, state.conv[j], layer["conv"], slots, positions, seq_len, out=buf["conv"],
                                   runs=runs, **drafts)
        kd = c.gdn_key_dim
        q = conv[:, :kd].view(R, c.gdn_k_heads, c.gdn_k_dim)
        kk = conv[:, kd:2 * kd].view(R, c.gdn_k_heads, c.gdn_k_dim)
        v = conv[:, 2 * kd:].view(R, Hv, c.gdn_v_dim)
        o = k.gdn_step(q, kk, v, alpha, beta, layer["A"], layer["dt"], state.ssm[j], slots, positions, seq_len,
                        out=buf["gdn_o"], runs=runs, log=state.log[j], **drafts)
        # a packed ssm_out in the file's column order reads its input in that order: the norm writes it so
        out_cols = layer.get("out_cols")
        z = z if isinstance(z, SplitSums) else z.unflatten(1, (Hv, c.gdn_v_dim))
        y = buf["gdn_y"] if out_cols is None else buf["gdn_y_file"]
        img = layer["out"].image(y)
        y = k.gated_rms_norm(o, z, layer["ssm_norm"], c.norm_eps, out_cols=out_cols, out=y, image=img)
        return layer["out"](y, buf["x"], defer=True, x_image=img)
