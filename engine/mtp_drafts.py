"""Draft tokens from a qwen35 model's own MTP head (multi-token prediction: blk.{n_layers}.*, one gated
full-attention block with nextn.eh_proj / enorm / hnorm / shared_head_norm; its math: engine/models/qwen35.py,
Qwen35Model.mtp_forward).

The head drafts t_{p+2} from t_{p+1} and h_p, the trunk's final-normed hidden state at p; k drafts chain it k times,
each next row the draft just made, the head's own output and the next position. It keeps a KV cache of its own, one
attention layer over every slot's positions, which must hold, at each position q before the newest, the head's row for
the true (t_{q+1}, h_q). So after every step the runner shows it the step's rows (`observe`): for each request, the
rows whose tokens the target has now settled (a prompt chunk, a decode row, or a verify run's newest token and the
drafts it kept) are fed through the head at their positions, with the trunk's hidden states of those rows; rows the
target rejected are not fed, and the positions the chained drafts wrote are written again by the next feed before any
row reads them (a row attends to positions up to its own). The last fed row of a request about to decode starts its
chain; the drafts wait for the scheduler's next `__call__`.

A pinned prefix (kv_cache.prefix=pinned) is fed through the head once, into a spare slot (`pin`), and copied into
each slot whose request starts with it (`restore`), like the recurrent state's snapshot; the prefix's last position,
whose next token is each request's own, is fed with the request's first rows.

Everything here runs eagerly through the model's step kernels (torch references on the CPU, Triton on a GPU), after
the step whose rows it reads: speculation keeps the loop in step with the host anyway (engine/runner.py). The drafts
are the head's argmax, a point mass, so the target's check (engine/drafts.py) keeps sampling exact too. A file with
more than one MTP block drafts with the first (llama.cpp's graph_mtp supports one).
"""
from __future__ import annotations

import torch

from onepass.engine.config import LAYER_ATTENTION, ModelConfig
from onepass.engine.scheduler import Request
from onepass.kernels.errors import ConfigError


def check_mtp(cfg: ModelConfig) -> None:
    """speculative=mtp needs a qwen35 model whose file carries its MTP block."""
    if cfg.arch != "qwen35" or cfg.mtp_layers < 1:
        name = cfg.name or "this model"
        raise ConfigError(f"speculative=mtp drafts with the model's own MTP head, and {name} ({cfg.arch}) has none "
                          "(GGUF nextn_predict_layers = 0): use a qwen35 GGUF that keeps its MTP block (llama.cpp's "
                          "converter without --no-mtp), or speculative=ngram")


class _HeadCache:
    """The head's KV as the fused decoder's attention reads a cache: k[i], v[i] at the block's layer index i."""

    def __init__(self, i: int, slots: int, ctx: int, cfg: ModelConfig, dtype, device):
        shape = (slots, ctx, cfg.n_kv_heads, cfg.head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device)}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device)}
        self.ctx = ctx

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class MTPDrafts:
    """The draft source for speculative=mtp; unbound until a runner binds it to its model and slots (`bind`)."""

    def __init__(self):
        self.model = None
        self.k = 0
        self.ready: dict[int, tuple[int, list[int]]] = {}         # rid -> (output length when drafted, drafts)
        self.carry: dict[int, tuple[int, torch.Tensor]] = {}     # rid -> a pinned prefix's last (position, h)
        self.pinned: tuple[int, torch.Tensor] | None = None      # (prefix positions, h of its last) in the spare slot

    # -- setup ------------------------------------------------------------------------------------------
    def bind(self, model, num_slots: int, ctx: int, k: int, max_len: int | None = None) -> None:
        """Build the head from `model`'s MTP weights (a FusedQwen35Decoder) for `num_slots` KV slots of ctx positions
        (+ a spare slot for a pinned prefix) and up to k drafts a step; forgets every earlier sequence."""
        check_mtp(model.cfg)
        cfg, kern = model.cfg, model.k
        if model is not self.model:
            from onepass.engine.fused_qwen35 import FusedQwen35Decoder
            from onepass.engine.projection import Projection

            i = cfg.n_layers
            w = model.mtp_weights
            self.index = i
            self.layer = FusedQwen35Decoder._layer(w, i, LAYER_ATTENTION, kern)
            self.eh_proj = Projection([w[f"blk.{i}.nextn.eh_proj.weight"]], kern)
            self.enorm, self.hnorm = w[f"blk.{i}.nextn.enorm.weight"], w[f"blk.{i}.nextn.hnorm.weight"]
            self.head_norm = w[f"blk.{i}.nextn.shared_head_norm.weight"]
            self.embed = w.get(f"blk.{i}.nextn.embed_tokens.weight", model.embed)
            self.head = w.get(f"blk.{i}.nextn.shared_head_head.weight", model.lm_head)
            self.model, self.bufs = model, {}
        self.cache = _HeadCache(self.index, num_slots + 1, ctx, cfg, model.dtype, model.device)
        self.spare, self.k, self.max_len = num_slots, k, min(max_len or ctx, ctx)
        self.ready, self.carry, self.pinned = {}, {}, None

    def _buffers(self, n: int) -> dict[str, torch.Tensor]:
        """Activations for n rows: views of buffers grown to the most rows asked for so far."""
        if not self.bufs or n > self.bufs["e"].shape[0]:
            m, d = self.model, self.model.cfg.dim
            e = lambda *s: torch.empty(*s, device=m.device, dtype=m.dtype)  # noqa: E731
            self.bufs = {**m.buffers(n), "e": e(n, d), "en": e(n, d), "hn": e(n, d), "cat": e(n, 2 * d),
                         "out": e(n, d)}
        return {name: b[:n] for name, b in self.bufs.items()}

    # -- the head -------------------------------------------------------------------------------------
    def forward(self, tokens: list[int], hidden: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """The head over rows (t_{p+1}, h_p, p, slot), its KV written at (slot, p): returns each row's output, the
        shared-head-normed hidden state [n, dim] that drafts and chains (Qwen35Model.mtp_forward's `out`)."""
        m, k, eps = self.model, self.model.k, self.model.cfg.norm_eps
        dev, n = m.device, len(tokens)
        buf = self._buffers(n)
        t = lambda x: torch.as_tensor(x, dtype=torch.long, device=dev)   # noqa: E731
        pos, sl = t(positions), t(slots)
        k.embedding(t(tokens), self.embed, out=buf["e"])
        k.rms_norm(buf["e"], self.enorm, eps, out=buf["en"])
        k.rms_norm(hidden, self.hnorm, eps, out=buf["hn"])
        torch.cat((buf["en"], buf["hn"]), dim=1, out=buf["cat"])          # the embedding first
        res, h, layer = buf["residual"], buf["h"], self.layer
        self.eh_proj(buf["cat"], res)
        img = layer["in_proj"].image(h)
        k.rms_norm(res, layer["attn_norm"], eps, out=h, image=img)
        x = m._attention(self.index, layer, h, img, pos, sl, self.cache, buf, None, None, self.max_len)
        x = m.feed_forward(layer, x, res, h, buf, defer=False)
        k.add_residual(x, res)
        return k.rms_norm(res, self.head_norm, eps, out=buf["out"])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits of the head's output rows (the shared LM head)."""
        return self.model.k.linear(out, self.head)

    def _argmax(self, out: torch.Tensor) -> list[int]:
        return self.model.k.argmax(self.logits(out)).tolist()

    # -- the runner's side ----------------------------------------------------------------------------
    def observe(self, fed: list[tuple[Request, int, int]], hidden: torch.Tensor) -> None:
        """After a step whose tokens are settled: fed holds (request, its first row in the step, its first position)
        for every request the step ran; hidden the step's final residual rows (before the trunk's final norm). Feeds
        each request's settled rows through the head and drafts for those about to decode."""
        toks, hid_rows, positions, slots, carried = [], [], [], [], []
        last: list[tuple[Request, int]] = []      # (request, its last row here) for those that draft
        for req, row0, start in fed:
            n = req.computed - start                # rows now settled: a verify run's rejected ones are not
            if req.retired or req.slot < 0 or n <= 0:
                continue
            seq = req.tokens
            if req.rid in self.carry:               # a pinned prefix's last position, before its own rows
                q, h = self.carry.pop(req.rid)
                carried.append((len(toks), h))
                toks.append(seq[q + 1])
                hid_rows.append(0)
                positions.append(q)
                slots.append(req.slot)
            for i in range(n):
                toks.append(seq[start + i + 1])
                hid_rows.append(row0 + i)
                positions.append(start + i)
                slots.append(req.slot)
            if req.pending == 1 and self._wanted(req):
                last.append((req, len(toks) - 1))
        if not toks:
            return
        m = self.model
        h = m.k.rms_norm(hidden.index_select(0, torch.as_tensor(hid_rows, device=hidden.device)), m.out_norm,
                         m.cfg.norm_eps)         # the trunk's final-normed hidden states h_q
        for row, hc in carried:
            h[row] = hc
        out = self.forward(toks, h, positions, slots)
        if last:
            self._chain([r for r, _ in last], out[[i for _, i in last]])

    def _wanted(self, req: Request) -> int:
        """Drafts the request can use at its next step: k, or fewer near its max-gen."""
        return min(self.k, req.max_new_tokens - len(req.output) - 1)

    def _chain(self, reqs: list[Request], out: torch.Tensor) -> None:
        """Each request's drafts: the head's argmax at its last fed row (position computed - 1, whose token is the
        newest), then its last draft and the head's output fed one position on, until it has as many as it can use."""
        want = [self._wanted(r) for r in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        live = list(range(len(reqs)))          # the requests still drafting; out[i] is live[i]'s head output
        while True:
            for j, tok in zip(live, self._argmax(out)):
                drafts[j].append(tok)
            more = [i for i, j in enumerate(live) if len(drafts[j]) < want[j]]
            if not more:
                break
            live = [live[i] for i in more]
            out = self.forward([drafts[j][-1] for j in live], out[more],
                               [reqs[j].computed - 1 + len(drafts[j]) for j in live], [reqs[j].slot for j in live])
        for r, d in zip(reqs, drafts):
            self.ready[r.rid] = (len(r.output), d)

    def pin(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """A pinned prefix of len(tokens) positions and the trunk's final residual rows there: its head rows for
        positions 0 .. n-2 go into the spare slot; the last position waits for each request's next token."""
        n = len(tokens)
        m = self.model
        h = m.k.rms_norm(hidden, m.out_norm, m.cfg.norm_eps)
        if n > 1:
            self.forward(tokens[1:], h[:n - 1], list(range(n - 1)), [self.spare] * (n - 1))
        self.pinned = (n, h[n - 1].clone())

    def restore(self, req: Request) -> None:
        """Give an admitted request that starts with the pinned prefix the prefix's head KV."""
        if self.pinned is None:
            raise ConfigError("the MTP draft head has no pinned prefix to restore: Runner.pin_prefix feeds it")
        n, h = self.pinned
        for c in (*self.cache.k.values(), *self.cache.v.values()):
            c[req.slot, :n - 1].copy_(c[self.spare, :n - 1])
        self.carry[req.rid] = (n - 1, h)

    # -- the scheduler's side -------------------------------------------------------------------------
    def __call__(self, req: Request, k: int) -> list[int]:
        made_at, drafts = self.ready.get(req.rid, (-1, []))
        return drafts[:k] if made_at == len(req.output) else []

    def forget(self, rid: int) -> None:
        self.ready.pop(rid, None)
        self.carry.pop(rid, None)


class ScriptedMTPDrafts(MTPDrafts):
    """Controlled acceptance at the MTP head's cost (speculative=mtp_scripted): the head runs exactly as for
    speculative=mtp (fed every kept row, chained k times), and where it drafts n tokens, n scripted tokens
    (engine/drafts.py ScriptedDrafts: the target's own future, each wrong with probability 1 - acceptance) are fed
    instead. On random weights the head's own drafts are almost never right; this sets the acceptance and keeps
    every cost: the head, the k + 1-row verify and the rollback."""

    def __init__(self, script):
        super().__init__()
        self.script = script

    def __call__(self, req: Request, k: int) -> list[int]:
        n = len(super().__call__(req, k))
        return self.script(req, n) if n else []
