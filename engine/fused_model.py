"""The decode step as a flat sequence of kernels over rows, on preallocated buffers.

Same math as engine/models/llama.py, arranged for the GPU: row r is one token of slot `slots[r]` at
position `positions[r]`, so a decode step is one row per slot and a batched prefill is many rows per
slot, through the same kernels. q|k|v and gate|up are fused into one GEMM each; RoPE, Qwen3's q/k
norm and the KV write are one kernel; the residual add is fused into the next RMSNorm. With the
Triton kernels every row's arithmetic is independent of how many rows the step holds, which is what
makes B streams bit-exact with a single-stream run.
"""
from __future__ import annotations

import torch

from onepass.engine.config import ModelConfig
from onepass.engine.models.base import DecoderBase
from onepass.engine.projection import Projection
from onepass.kernels.backend import StepKernels
from onepass.kernels.persistent_step import MAX_ROWS as PERSISTENT_ROWS
from onepass.kernels.persistent_step import PersistentStep, parse_form
from onepass.kernels.quant_pack import PackedWeight
from onepass.kernels.rope import rope_cache, rope_inv_freq


def tensor_bytes(t) -> int:
    return t.nbytes if isinstance(t, PackedWeight) else t.numel() * t.element_size()


class FusedBase(DecoderBase):
    """What both fused decoders share: each layer's feed-forward half, and the final norm and LM head over the rows
    that sample."""

    k: StepKernels

    def feed_forward(self, layer: dict, x, res: torch.Tensor, h: torch.Tensor, buf: dict, defer: bool):
        """res += x (the mixer's output, or its split-K partials); h = rms_norm(res); then the SwiGLU MLP of h. Returns
        the down projection's output, or with defer its split-K partials for the next kernel to add."""
        k = self.k
        img = layer["gate_up"].image(h)
        k.add_rms_norm(x, res, layer["ffn_norm"], self.cfg.norm_eps, out=h, image=img)
        gate_up = layer["gate_up"](h, buf["gate_up"], defer=True, x_image=img)
        img = layer["down"].image(buf["act"])
        k.swiglu(gate_up, out=buf["act"], image=img)
        return layer["down"](buf["act"], buf["x"], defer=defer, x_image=img)

    def logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None,
               normed: torch.Tensor | None = None) -> torch.Tensor:
        img = self.k.x_image(hidden_rows, self.lm_head)
        normed = self.k.rms_norm(hidden_rows, self.out_norm, self.cfg.norm_eps, out=normed, image=img)
        return self.k.linear(normed, self.lm_head, out=out, x_image=img)


class FusedDecoder(FusedBase):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], kernels: StepKernels, max_pos: int,
                 step: str = "kernels", persistent_form: str = ""):
        """step: the form of a step of up to PERSISTENT_ROWS rows (wider ones, a prompt's chunk, run kernel by
        kernel), persistent_form: the persistent step's settings: see set_step."""
        self.cfg, self.k = cfg, kernels
        self._persistent: tuple | None = None   # (the KV cache, its PersistentStep)
        self.persistent_form: dict[str, int] = {}
        # engine.step=auto's decision and measurements, kept while the step form changes and back (set_step)
        self.choice: bool | None = None    # True: the persistent form, for every step of up to PERSISTENT_ROWS rows
        self.pick_rows: tuple[int, ...] = ()   # the row counts whose times decided it
        self.pick_us: dict[int, tuple[float, float]] = {}
        self.pick_why: str | None = None   # why auto could not measure the persistent form (None: it did)
        self.set_step(step, persistent_form)
        self._init_head(weights)
        self.rope = rope_cache(rope_inv_freq(cfg.head_dim, cfg.rope_theta, weights.get("rope_freqs.weight")), max_pos)
        self.rope = self.rope.to(self.embed.device)
        self.layers = []
        for i in range(cfg.n_layers):
            def proj(*names, i=i):
                # q|k|v of mixed formats (a Q4_K_M file's Q6_K v) are dequantized into one GEMM
                return Projection([weights[f"blk.{i}.{n}.weight"] for n in names], kernels, dequant_mixed=self.dtype)

            self.layers.append({
                "attn_norm": weights[f"blk.{i}.attn_norm.weight"], "ffn_norm": weights[f"blk.{i}.ffn_norm.weight"],
                "qkv": proj("attn_q", "attn_k", "attn_v"), "o": proj("attn_output"),
                "gate_up": proj("ffn_gate", "ffn_up"), "down": proj("ffn_down"),
                "q_norm": weights.get(f"blk.{i}.attn_q_norm.weight"),
                "k_norm": weights.get(f"blk.{i}.attn_k_norm.weight"),
            })

    def weight_bytes(self) -> int:
        """Bytes one step reads from weights (embedding rows are a gather: not counted); packed weights
        count their packed bytes (quantized values + scales)."""
        n = tensor_bytes(self.lm_head) + tensor_bytes(self.out_norm)
        for layer in self.layers:
            n += sum(t.nbytes if isinstance(t, Projection) else tensor_bytes(t) for t in layer.values()
                     if t is not None)
        return n

    def packed_weights(self) -> list[PackedWeight]:
        """The projections kept quantized (for sizing the int4 workspaces before CUDA-graph capture)."""
        ws = [w for layer in self.layers for p in layer.values() if isinstance(p, Projection)
              for w in p.weights if isinstance(w, PackedWeight)]
        return ws + ([self.lm_head] if isinstance(self.lm_head, PackedWeight) else [])

    def buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """Every activation of a step with `rows` rows, allocated once (a CUDA graph replays on them)."""
        c, dev, dt = self.cfg, self.device, self.dtype
        e = lambda *s, dtype=dt: torch.empty(*s, device=dev, dtype=dtype)  # noqa: E731
        return {
            "residual": e(rows, c.dim), "h": e(rows, c.dim), "qkv": e(rows, c.q_dim + 2 * c.kv_dim),
            "q": e(rows, c.n_heads, c.head_dim), "attn": e(rows, c.n_heads, c.head_dim), "x": e(rows, c.dim),
            "gate_up": e(rows, 2 * c.ffn_dim), "act": e(rows, c.ffn_dim),
        }

    def set_step(self, step: str, persistent_form: str = "") -> None:
        """kernels: one kernel per op; persistent: every layer in one persistent kernel (kernels/persistent_step.py,
        in the settings of persistent_form, e.g. 'block_k=256,stages=3'; '': its defaults); auto: whichever form the
        first Step to capture measured faster over the row counts it runs (`choice`, decided over `pick_rows`;
        `pick_us`: rows -> (kernel-per-op us, persistent us) as measured). One form for every row count, never one
        per count: a request's tokens must not depend on how many rows share its step, and the two forms round
        differently. Another persistent form drops the built step and auto's decision."""
        form = parse_form(persistent_form)
        if form != self.persistent_form:
            self.persistent_form, self._persistent = form, None
            self.choice, self.pick_rows, self.pick_why = None, (), None
            self.pick_us.clear()
        self.persistent = step == "persistent"
        self.auto = step == "auto"

    def takes_persistent(self, rows: int) -> bool:
        if rows > PERSISTENT_ROWS:
            return False
        return bool(self.choice) if self.auto else self.persistent

    def persistent_unsupported(self, kv) -> str | None:
        """Why this model cannot take the persistent step over kv (None: it can)."""
        return PersistentStep.unsupported(self, kv)

    def persistent_step(self, kv) -> PersistentStep:
        """The persistent step over this KV cache's tensors (built on its first step: the cache's tensors are where
        it writes)."""
        if self._persistent is None or self._persistent[0] is not kv:
            self._persistent = (kv, PersistentStep(self, kv, **self.persistent_form))
        return self._persistent[1]

    def hidden(self, tokens, positions, slots, kv, buf, attn_ws=None, block_table=None, max_len=None) -> torch.Tensor:
        """Run every layer over the rows; returns the final residual stream [R, dim] (before the last norm).
        Every position must be < max_len (default: the cache's ctx)."""
        c, k, eps = self.cfg, self.k, self.cfg.norm_eps
        res, h, x = buf["residual"], buf["h"], buf["x"]
        k.embedding(tokens, self.embed, out=res)
        if self.takes_persistent(tokens.shape[0]):
            return self.persistent_step(kv)(positions, slots, res, block_table)
        # img: the next GEMM's staged x, written by the kernel that makes x (k.x_image, kernels/x_image.py)
        for i, layer in enumerate(self.layers):
            img = layer["qkv"].image(h)
            if i == 0:
                k.rms_norm(res, layer["attn_norm"], eps, out=h, image=img)
            else:
                k.add_rms_norm(x, res, layer["attn_norm"], eps, out=h, image=img)  # res += x (the last FFN output)
            layer["qkv"](h, buf["qkv"], x_image=img)
            k.rope_kv_write(buf["qkv"], positions, slots, self.rope, kv.k[i], kv.v[i], c.n_heads, c.n_kv_heads,
                            c.head_dim, q_norm=layer["q_norm"], k_norm=layer["k_norm"], eps=eps,
                            block_table=block_table, q_out=buf["q"])
            k.decode_attention(buf["q"], kv.k[i], kv.v[i], slots, positions, block_table=block_table,
                               out=buf["attn"], workspace=attn_ws, max_len=max_len or kv.ctx)
            # the o, gate|up and down GEMMs may leave split-K partials for the next kernel to add (kernels/splitk.py)
            x = layer["o"](buf["attn"].view(-1, c.q_dim), buf["x"], defer=True)
            x = self.feed_forward(layer, x, res, h, buf, defer=i + 1 < len(self.layers))   # the last: a tensor
        k.add_residual(x, res)
        return res
