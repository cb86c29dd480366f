"""The hybrid (qwen35: Gated DeltaNet + gated attention) decode step as a flat kernel sequence over rows.

Same math as engine/models/qwen35.py, arranged as engine/fused_model.py arranges llama/qwen3: row r is
one token of slot `slots[r]` at position `positions[r]`, every activation lives in preallocated buffers,
and the interface is FusedDecoder's (`buffers(rows)`, `hidden(...)`, `logits(...)`, `weight_bytes()`), so
GraphStepper captures it in CUDA graphs unchanged. `kv` is a HybridCache (engine/state_pool.py): its KV
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

What the kernels between the GEMMs cost (H200 probe at d2384f5, 27B Q4_K graphed steps, switch_ab, each kernel
skipped outright, outputs wrong; ms a step saved at B = 1 / 32 / 128): gated norm 0.04 / 0.10 / 0.37, conv ring
0.06 / 0.27 / 1.02 (before its ring went to bf16), SwiGLU 0.05 / 0.06 / 0.28, sigmoid gate 0.03 / 0.03 / 0.04, all
four 0.19 / 0.51 / 1.59, the 128 residual add + RMSNorms 0.23 / 0.13 / 0.54. Against steps of 6.56 / 11.45 / 24.54
ms the rest is the GEMMs and, at 32 and 128, the GDN step's state traffic: removing every one of these kernels would
still leave B = 32 and 128 short of 3,000 and 6,000 tok/s with fp32 state. Again at 4106835 on Q4_0 weights (the same
method; steps of 5.82 / 10.80 / 23.14 ms): conv ring 0.00 / 0.17 / 0.33, gated norm 0.00 / 0.08 / 0.27, the RMSNorms
0.35 / 0.15 / 0.43, all five kinds 0.53 / 0.52 / 1.34.

Sequences start at position 0: a row (run) at position 0 makes the GDN kernels start its slot from zero
state and zero conv history, inside the kernels (no host sync, graph-safe); the attention layers simply
overwrite KV from position 0. So static batching and continuous refill need no reset call. Nothing here
keeps the StatePool's host-side token counts (`seen`): the reference model checks continuity, the fused
step trusts its rows (each slot's rows must continue its sequence or restart it at position 0).

Rows per slot: in token mode (decode, token prefill) each slot has at most one row per step. A step may
also carry runs of `seq_len` consecutive tokens per slot, slot-major (rows n*T .. n*T+T-1 of one slot:
GraphStepper's batched prefill of a static batch), or ragged runs (`runs`, int32 row offsets: a serving
step's decode rows and prompt chunks of unequal lengths, each slot's rows together; engine/row_step.py
builds them); the GDN kernels walk each run in order.
"""
from __future__ import annotations

import contextlib

import torch

from onepass.engine.config import LAYER_ATTENTION, ModelConfig
from onepass.engine.errors import ConfigError, GGUFError
from onepass.engine.gguf_loader import INPUT_ORDER
from onepass.engine.models.base import DecoderBase
from onepass.kernels.backend import StepKernels
from onepass.kernels.gated_attention import gate_view
from onepass.kernels.hybrid import HybridKernels, get_hybrid_kernels
from onepass.kernels.rope import rope_cache, rope_inv_freq
from onepass.kernels.splitk import SplitSums


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)  # PackedWeight (engine/quant_pack.py)


def _fusable(a, b) -> bool:
    """Whether two projection weights can share one GEMM: dense of one dtype, or packed of one format and K."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape[1] == b.shape[1]
    return type(a) is type(b) and getattr(a, "fmt", None) == getattr(b, "fmt", None) and a.shape[1] == b.shape[1]


def _fuse(parts: list):
    """Row concatenation of projection weights (torch tensors, or PackedWeights of one format)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts).contiguous()
    from onepass.engine.quant_pack import cat_rows

    try:
        return cat_rows(parts)
    except GGUFError:
        return None


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for Projection's concurrent parts (CUDA-graph capture follows the fork)."""
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return s


class Projection:
    """One GEMM over several weights' rows, writing one [R, sum(N)] buffer. Adjacent weights that can be
    fused are (dense ones always; packed ones of one format); the rest get a GEMM each into column slices
    of the buffer (e.g. packed q|k|v|z beside the tiny dense beta|alpha rows).

    On a GPU the small dense slices of a packed projection run on a side stream beside the packed GEMM
    (forked after x is written, joined before the buffer is read): in the step's chain a launch of their own
    cost more than their bytes. H200, 27B Q4_K, graphed step with the dense beta|alpha GEMM and its split-K
    reduce removed outright: -0.27 / -0.53 / -1.16 ms at B = 1 / 32 / 128, and no tile choice for it moved the
    step by more than 1%; on the side stream: 7.20 -> 7.04 / 8.96 -> 8.66 / 12.57 -> 12.27 / 27.51 -> 27.13 ms
    at B = 1 / 8 / 32 / 128, the same tokens. Only dense parts beside a packed main part go there, so the side
    stream's GEMMs (kernels/gemm.py's split-K workspace) never meet another dense GEMM. Joining the side stream
    after the conv ring instead (beta|alpha are first read by the GDN step) gained nothing: H200 probe at 752171e,
    ms per step joined before / after the conv ring, B = 1 6.80-6.90 / 6.90, B = 8 8.40 / 8.44, B = 32 11.58-11.62 /
    11.60-11.61, B = 128 26.18-26.25 / 26.21-26.29. The side stream now hides them whole, so computing beta|alpha
    anywhere else could not pay: H200 probe at d2384f5, switch_ab, ms a step as is / beta|alpha skipped outright
    (outputs wrong) / on the main stream: B = 1 6.569 / 6.552 / 6.812, B = 32 11.471 / 11.448 / 11.974, B = 128
    24.506 / 24.492 / 25.013."""

    concurrent = True   # class switch (probes compare with it off)

    def __init__(self, parts: list):
        self.width = sum(int(p.shape[0]) for p in parts)
        groups = [[parts[0]]]
        for p in parts[1:]:
            if _fusable(groups[-1][-1], p):
                groups[-1].append(p)
            else:
                groups.append([p])
        self.weights = []
        for g in groups:
            fused = _fuse(g)
            self.weights.extend([fused] if fused is not None else g)
        cols, col = [], 0
        for w in self.weights:
            cols.append((col, col + int(w.shape[0])))
            col += int(w.shape[0])
        self.cols = cols
        big = max(range(len(self.weights)), key=lambda i: _nbytes(self.weights[i]))
        side = [i for i in range(len(self.weights)) if i != big]
        # a side stream only for dense parts beside a packed main GEMM (see the class docstring)
        self.main, self.side = (big, side) if side and not isinstance(self.weights[big], torch.Tensor) and all(
            isinstance(self.weights[i], torch.Tensor) for i in side) else (None, [])

    def image(self, k: StepKernels, x: torch.Tensor):
        """Where the kernel making x should also write it (k.x_image: the only or main GEMM's staged x,
        kernels/x_image.py), or None. Asked just before that kernel runs, and passed to the call as x_image."""
        w = self.weights[0] if len(self.weights) == 1 else None if self.main is None else self.weights[self.main]
        return None if w is None else k.x_image(x, w)

    def __call__(self, k: StepKernels, x: torch.Tensor, out: torch.Tensor, defer: bool = False, x_image=None):
        """x @ W^T into out; defer: the only GEMM, or the main one beside dense side parts, may hand back its
        split-K partials unreduced (kernels/splitk.py) for the next kernels to add. A main GEMM's partials cover
        its columns only, self.cols[self.main]; the side parts are written into out as always. x_image: image(k, x),
        written by the kernel that made x (the only or main GEMM then skips its staging launch)."""
        if len(self.weights) == 1:
            return k.linear(x, self.weights[0], out=out, defer=defer, x_image=x_image)
        if self.main is not None:
            concurrent = self.concurrent and x.is_cuda
            if concurrent:
                main = torch.cuda.current_stream(x.device)
                side = _side_stream(x.device)
                side.wait_stream(main)            # x is written
            with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
                for i in self.side:
                    c0, c1 = self.cols[i]
                    k.linear(x, self.weights[i], out=out[:, c0:c1])
            c0, c1 = self.cols[self.main]
            y = k.linear(x, self.weights[self.main], out=out[:, c0:c1], defer=defer, x_image=x_image)
            if concurrent:
                main.wait_stream(side)            # every slice is written before the buffer is read
            return y if isinstance(y, SplitSums) else out
        for w, (c0, c1) in zip(self.weights, self.cols):  # unfusable parts: one GEMM each, into column slices
            k.linear(x, w, out=out[:, c0:c1])
        return out

    def main_cols(self) -> tuple[int, int] | None:
        """The columns a deferred call's partials cover (None: no main GEMM beside side parts)."""
        return None if self.main is None else self.cols[self.main]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(w) for w in self.weights)


class FusedQwen35Decoder(DecoderBase):
    hybrid = True  # GraphStepper passes seq_len to batched prefill; the cache must be a HybridCache

    def __init__(self, cfg: ModelConfig, weights, kernels: StepKernels, max_pos: int,
                 hybrid_kernels: HybridKernels | None = None):
        if cfg.arch != "qwen35":
            raise ConfigError(f"FusedQwen35Decoder runs arch qwen35, got {cfg.arch!r} (use FusedDecoder)")
        self.cfg, self.k = cfg, kernels
        self.hk = hybrid_kernels or get_hybrid_kernels(kernels.name)
        self._init_head(weights)
        inv = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, weights.get("rope_freqs.weight"))
        self.rope = rope_cache(inv, max_pos).to(self.embed.device)  # [max_pos, rotary_dim] = cat(cos, sin)
        self.layers = [self._layer(weights, i, kind) for i, kind in enumerate(cfg.layer_kinds)]
        self.gdn_index = {i: j for j, i in enumerate(cfg.gdn_layers)}

    @staticmethod
    def _layer(weights, i: int, kind: str) -> dict:
        w = lambda n: weights[f"blk.{i}.{n}"]  # noqa: E731
        layer = {"kind": kind, "attn_norm": w("attn_norm.weight"), "ffn_norm": w("post_attention_norm.weight"),
                 "gate_up": Projection([w("ffn_gate.weight"), w("ffn_up.weight")]),
                 "down": Projection([w("ffn_down.weight")])}
        if kind == LAYER_ATTENTION:
            layer.update(in_proj=Projection([w("attn_q.weight"), w("attn_k.weight"), w("attn_v.weight")]),
                         q_norm=w("attn_q_norm.weight").contiguous(), k_norm=w("attn_k_norm.weight").contiguous(),
                         out=Projection([w("attn_output.weight")]))
        else:
            layer.update(in_proj=Projection([w("attn_qkv.weight"), w("attn_gate.weight"), w("ssm_beta.weight"),
                                             w("ssm_alpha.weight")]),
                         conv=w("ssm_conv1d.weight").contiguous(), A=w("ssm_a").contiguous(),
                         dt=w("ssm_dt.bias").contiguous(), ssm_norm=w("ssm_norm.weight").contiguous(),
                         out=Projection([w("ssm_out.weight")]))
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
               seq_len: int = 1, runs: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over the rows; returns the final residual stream [R, dim] (before the last norm).
        Every position must be < max_len (default: the cache's ctx). seq_len > 1: the rows are slot-major
        runs of seq_len consecutive positions of one slot; runs: ragged runs instead, int32 row offsets (a serving
        step's decode rows and prompt chunks; see the module docstring)."""
        state = getattr(kv, "state", None)
        if state is None:
            raise ConfigError("the hybrid decoder keeps per-slot recurrent state: pass kv=HybridCache(kv_cache, "
                              "StatePool(...)) (engine/state_pool.py)")
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
            img = layer["in_proj"].image(k, h)
            if i == 0:
                k.rms_norm(res, layer["attn_norm"], eps, out=h, image=img)
            else:
                k.add_rms_norm(x, res, layer["attn_norm"], eps, out=h, image=img)  # res += x (the last FFN output)
            if layer["kind"] == LAYER_ATTENTION:
                x = self._attention(i, layer, h, img, positions, slots, cache, buf, attn_ws, block_table, max_len)
            else:
                x = self._gdn(self.gdn_index[i], layer, h, img, positions, slots, state, buf, seq_len, runs)
            img = layer["gate_up"].image(k, h)
            k.add_rms_norm(x, res, layer["ffn_norm"], eps, out=h, image=img)
            gate_up = layer["gate_up"](k, h, buf["gate_up"], defer=True, x_image=img)
            img = layer["down"].image(k, buf["act"])
            k.swiglu(gate_up, out=buf["act"], image=img)
            # the last layer's down projection: a tensor
            x = layer["down"](k, buf["act"], buf["x"], defer=i + 1 < len(self.layers), x_image=img)
        k.add_residual(x, res)
        return res

    def _attention(self, i, layer, h, h_image, positions, slots, cache, buf, attn_ws, block_table, max_len):
        c, k, hk = self.cfg, self.k, self.hk
        qkv = layer["in_proj"](k, h, buf["attn_in"], x_image=h_image)
        hk.gated_rope_kv_write(qkv, positions, slots, self.rope, cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads,
                               c.head_dim, c.rope_dim, layer["q_norm"], layer["k_norm"], c.norm_eps,
                               block_table=block_table, q_out=buf["q"])
        k.decode_attention(buf["q"], cache.k[i], cache.v[i], slots, positions, block_table=block_table,
                           out=buf["attn"], workspace=attn_ws, max_len=max_len or cache.ctx)
        attn = buf["attn"].view(-1, c.q_dim)
        img = layer["out"].image(k, attn)
        hk.sigmoid_gate_mul(buf["attn"], gate_view(qkv, c.n_heads, c.head_dim), out=buf["attn"], image=img)
        return layer["out"](k, attn, buf["x"], defer=True, x_image=img)

    def _gdn(self, j, layer, h, h_image, positions, slots, state, buf, seq_len: int, runs: torch.Tensor | None = None):
        c, k, hk = self.cfg, self.k, self.hk
        R = h.shape[0]
        C, V, Hv = c.gdn_conv_dim, c.gdn_value_dim, c.gdn_v_heads
        # [qkv (C) | z (V) | beta (Hv) | alpha (Hv)]. The packed q|k|v|z GEMM beside the dense beta|alpha rows leaves
        # its split-K partials unreduced: the conv ring and the gated norm add their columns' (kernels/splitk.py),
        # a launch less per layer; no GEMM runs between it and them
        proj_w = layer["in_proj"]
        proj = proj_w(k, h, buf["gdn_in"], defer=proj_w.main_cols() == (0, C + V), x_image=h_image)
        if isinstance(proj, SplitSums):                               # beta|alpha: written into the buffer
            qkv, z, ba = proj.cols(0, C), proj.cols(C, C + V), buf["gdn_in"]
        else:
            qkv, z, ba = proj[:, :C], proj[:, C:C + V], proj
        beta, alpha = ba[:, C + V:C + V + Hv], ba[:, C + V + Hv:C + V + 2 * Hv]
        conv = hk.conv_ring_update(qkv, state.conv[j], layer["conv"], slots, positions, seq_len, out=buf["conv"],
                                   runs=runs)
        kd = c.gdn_key_dim
        q = conv[:, :kd].view(R, c.gdn_k_heads, c.gdn_k_dim)
        kk = conv[:, kd:2 * kd].view(R, c.gdn_k_heads, c.gdn_k_dim)
        v = conv[:, 2 * kd:].view(R, Hv, c.gdn_v_dim)
        o = hk.gdn_step(q, kk, v, alpha, beta, layer["A"], layer["dt"], state.ssm[j], slots, positions, seq_len,
                        out=buf["gdn_o"], runs=runs, log=state.log[j])
        # a packed ssm_out in the file's column order reads its input in that order: the norm writes it so
        out_cols = layer.get("out_cols")
        z = z if isinstance(z, SplitSums) else z.unflatten(1, (Hv, c.gdn_v_dim))
        y = buf["gdn_y"] if out_cols is None else buf["gdn_y_file"]
        img = layer["out"].image(k, y)
        y = hk.gated_rms_norm(o, z, layer["ssm_norm"], c.norm_eps, out_cols=out_cols, out=y, image=img)
        return layer["out"](k, y, buf["x"], defer=True, x_image=img)

    def logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None,
               normed: torch.Tensor | None = None) -> torch.Tensor:
        img = self.k.x_image(hidden_rows, self.lm_head)
        normed = self.k.rms_norm(hidden_rows, self.out_norm, self.cfg.norm_eps, out=normed, image=img)
        return self.k.linear(normed, self.lm_head, out=out, x_image=img)
