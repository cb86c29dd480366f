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

A step's feed and chain are one routine over device tensors (`_feed_chain`): the rows' tokens, positions and slots
go to the device in one copy, the drafts come back in one. With graphs (the runner's CUDA graphs on a GPU) it is
captured at `bind` for every pair of row buckets a step can meet (fed rows, drafting rows), padded rows computing on a
scratch slot of the head's cache; a step whose rows fit no captured pair (a long prompt chunk, a pinned prefix's first
rows) runs it eagerly, through the same kernels. The drafts are the head's argmax, a point mass, so the target's check
(engine/drafts.py) keeps sampling exact too. A file with more than one MTP block drafts with the first (llama.cpp's
graph_mtp supports one).
"""
from __future__ import annotations

import torch

from onepass.engine.config import LAYER_ATTENTION, ModelConfig
from onepass.engine.scheduler import Request
from onepass.engine.step import BUCKETS, bucket_for
from onepass.kernels import pdl
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


class _Staged:
    """A step's head inputs on the device, padded to a pair of row buckets (R fed rows, L drafting rows): per fed row
    its token, hidden row, position and slot; per drafting row its last fed row, first chained position and slot. The
    host fills one of two pinned copies (alternating) and sends it in one copy."""

    FED, DRAFTING = ("tok", "hid", "pos", "slot"), ("last", "cpos", "cslot")

    def __init__(self, R: int, L: int, scratch: int, device):
        self.R, self.L, self.scratch = R, L, scratch
        n = 4 * R + 3 * L
        self.flat = torch.zeros(n, dtype=torch.long, device=device)
        pin = torch.device(device).type == "cuda"
        self.host = [torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.flip = 0

    def views(self, r: int, l: int) -> dict[str, torch.Tensor]:
        R, L, f = self.R, self.L, self.flat
        v = {name: f[i * R:i * R + r] for i, name in enumerate(self.FED)}
        v.update({name: f[4 * R + i * L:4 * R + i * L + l] for i, name in enumerate(self.DRAFTING)})
        return v

    def send(self, fed: list[list[int]], drafting: list[list[int]], r: int, l: int) -> None:
        """fed: (tokens, hidden rows, positions, slots); drafting: (last rows, first chained positions, slots); each
        padded to r / l rows (tokens, rows and positions 0, slots the scratch one)."""
        h = self.host[self.flip]
        self.flip ^= 1
        a = h.numpy()
        R, L = self.R, self.L
        for i, (col, pad) in enumerate(zip(fed, (0, 0, 0, self.scratch))):
            a[i * R:i * R + len(col)] = col
            a[i * R + len(col):i * R + r] = pad
        for i, (col, pad) in enumerate(zip(drafting, (0, 0, self.scratch))):
            a[4 * R + i * L:4 * R + i * L + len(col)] = col
            a[4 * R + i * L + len(col):4 * R + i * L + l] = pad
        self.flat.copy_(h, non_blocking=True)


class MTPDrafts:
    """The draft source for speculative=mtp; unbound until a runner binds it to its model and slots (`bind`)."""

    MAX_GRAPH_ROWS = 128   # fed rows beyond this (prompt chunks) run eagerly

    def __init__(self):
        self.model = None
        self.k = 0
        self.ready: dict[int, tuple[int, list[int]]] = {}         # rid -> (output length when drafted, drafts)
        self.carry: dict[int, tuple[int, torch.Tensor]] = {}     # rid -> a pinned prefix's last (position, h)
        self.pinned: tuple[int, torch.Tensor] | None = None      # (prefix positions, h of its last) in the spare slot
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    # -- setup ------------------------------------------------------------------------------------------
    def bind(self, model, num_slots: int, ctx: int, k: int, max_len: int | None = None, hidden=None,
             policy=None) -> None:
        """Build the head from `model`'s MTP weights (a FusedQwen35Decoder) for `num_slots` KV slots of ctx positions
        (+ a spare slot for a pinned prefix, + a scratch slot for padded rows) and up to k drafts a step; forgets every
        earlier sequence. hidden: the trunk's step buffer of final residual rows that `observe` will be shown (a
        runner's Step.buf["residual"]): given on a GPU, the head's feed and chain are captured as CUDA graphs over it,
        under launch policy `policy` (kernels/pdl.py; default: the one in force)."""
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
        self.cache = _HeadCache(self.index, num_slots + 2, ctx, cfg, model.dtype, model.device)
        self.spare, self.scratch, self.k, self.max_len = num_slots, num_slots + 1, k, min(max_len or ctx, ctx)
        self.ready, self.carry, self.pinned = {}, {}, None
        self.graphs, self.src = {}, None
        if hidden is not None and hidden.is_cuda and k > 0:
            self._capture(hidden, num_slots, policy or pdl.current())

    def _buffers(self, n: int) -> dict[str, torch.Tensor]:
        """Activations for n rows (the eager path): views of buffers grown to the most rows asked for so far."""
        if not self.bufs or n > self.bufs["e"].shape[0]:
            self.bufs = self._allocate(n)
        return {name: b[:n] for name, b in self.bufs.items()}

    def _allocate(self, n: int) -> dict[str, torch.Tensor]:
        m, d = self.model, self.model.cfg.dim
        e = lambda *s: torch.empty(*s, device=m.device, dtype=m.dtype)  # noqa: E731
        return {**m.buffers(n), "e": e(n, d), "en": e(n, d), "hn": e(n, d), "cat": e(n, 2 * d), "out": e(n, d)}

    # -- the head -------------------------------------------------------------------------------------
    def forward(self, tokens: list[int], hidden: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """The head over rows (t_{p+1}, h_p, p, slot), its KV written at (slot, p): returns each row's output, the
        shared-head-normed hidden state [n, dim] that drafts and chains (Qwen35Model.mtp_forward's `out`)."""
        t = lambda x: torch.as_tensor(x, dtype=torch.long, device=self.model.device)   # noqa: E731
        return self._forward(t(tokens), hidden, t(positions), t(slots), self._buffers(len(tokens)))

    def _forward(self, tokens, hidden, positions, slots, buf) -> torch.Tensor:
        """forward over device tensors, on buffers `buf` of at least as many rows."""
        m, k, eps = self.model, self.model.k, self.model.cfg.norm_eps
        buf = {name: b[:tokens.shape[0]] for name, b in buf.items()}
        k.embedding(tokens, self.embed, out=buf["e"])
        k.rms_norm(buf["e"], self.enorm, eps, out=buf["en"])
        k.rms_norm(hidden, self.hnorm, eps, out=buf["hn"])
        torch.cat((buf["en"], buf["hn"]), dim=1, out=buf["cat"])          # the embedding first
        res, h, layer = buf["residual"], buf["h"], self.layer
        self.eh_proj(buf["cat"], res)
        img = layer["in_proj"].image(h)
        k.rms_norm(res, layer["attn_norm"], eps, out=h, image=img)
        x = m._attention(self.index, layer, h, img, positions, slots, self.cache, buf, None, None, self.max_len)
        x = m.feed_forward(layer, x, res, h, buf, defer=False)
        k.add_residual(x, res)
        return k.rms_norm(res, self.head_norm, eps, out=buf["out"])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits of the head's output rows (the shared LM head)."""
        return self.model.k.linear(out, self.head)

    def _feed_chain(self, x: dict[str, torch.Tensor], hidden: torch.Tensor, buf: dict, drafts: torch.Tensor,
                    carried=()) -> None:
        """One step's head work over device tensors x (_Staged's names): the fed rows through the head (their hidden
        rows taken from `hidden` and final-normed, a pinned prefix's carried rows put in), then k drafts for each
        drafting row into drafts[0..k-1]: the argmax at its last fed row, then the head fed its last draft and output
        one position on. Every drafting row chains k times (a row that can use fewer drafts has the rest dropped by
        the host); positions past max_len are clamped, their rows written again before any row reads them."""
        m = self.model
        h = m.k.rms_norm(hidden.index_select(0, x["hid"]), m.out_norm, m.cfg.norm_eps)
        for row, hc in carried:
            h[row] = hc
        out = self._forward(x["tok"], h, x["pos"], x["slot"], buf)
        if not x["last"].numel():
            return
        o = out.index_select(0, x["last"])
        for j in range(self.k):
            m.k.argmax(self.logits(o), out=drafts[j])
            if j + 1 < self.k:
                pos = (x["cpos"] + j).clamp_(max=self.max_len - 1)
                o = self._forward(drafts[j], o, pos, x["cslot"], buf)

    def _capture(self, hidden: torch.Tensor, num_slots: int, policy) -> None:
        """CUDA graphs of _feed_chain over `hidden` for every (fed, drafting) row-bucket pair a step of num_slots
        requests (the runner's slots, its scratch one among them) can meet, on buffers of their own."""
        L = bucket_for(max(1, num_slots - 1))
        R = min(self.MAX_GRAPH_ROWS, bucket_for(L * (self.k + 1)))
        L = min(L, R)
        self.stage = _Staged(R, L, self.scratch, hidden.device)
        self.gbufs = self._allocate(R)
        self.drafts = torch.zeros(self.k, L, dtype=torch.long, device=hidden.device)
        pairs = [(r, l) for r in BUCKETS if r <= R for l in (0, *BUCKETS) if l <= min(r, L)]
        fn = lambda r, l: self._feed_chain(self.stage.views(r, l), hidden, self.gbufs, self.drafts[:, :l])  # noqa
        with pdl.applied(policy):
            self.stage.send([[]] * 4, [[]] * 3, R, L)   # every padded row on the scratch slot
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # compile every kernel at every shape before capture
                for r, l in pairs:
                    fn(r, l)
            torch.cuda.current_stream().wait_stream(stream)
            pool = None
            for r, l in reversed(pairs):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    fn(r, l)
                pool = pool or g.pool()
                self.graphs[r, l] = g
        self.src = hidden

    def _run(self, toks, hid_rows, positions, slots, drafting, hidden, carried) -> list[list[int]]:
        """_feed_chain for these rows (drafting: (last fed row, first chained position, slot) per drafting request):
        a captured graph's replay where one fits, else eagerly. Returns each drafting request's k drafts."""
        n, nl = len(toks), len(drafting)
        cols = [list(c) for c in zip(*drafting)] if drafting else [[]] * 3
        if self.graphs and hidden is self.src and not carried and n <= self.stage.R and nl <= self.stage.L:
            key = (bucket_for(n), bucket_for(nl) if nl else 0)
            self.stage.send([toks, hid_rows, positions, slots], cols, *key)
            self.graphs[key].replay()
            drafts = self.drafts[:, :nl]
        else:
            t = lambda v: torch.as_tensor(v, dtype=torch.long, device=self.model.device)   # noqa: E731
            x = dict(zip(_Staged.FED + _Staged.DRAFTING, map(t, [toks, hid_rows, positions, slots, *cols])))
            drafts = torch.zeros(self.k, nl, dtype=torch.long, device=self.model.device)
            self._feed_chain(x, hidden, self._buffers(n), drafts, carried)
        return drafts.t().tolist() if nl else []

    # -- the runner's side ----------------------------------------------------------------------------
    def observe(self, fed: list[tuple[Request, int, int]], hidden: torch.Tensor) -> None:
        """After a step whose tokens are settled: fed holds (request, its first row in the step, its first position)
        for every request the step ran; hidden the step's final residual rows (before the trunk's final norm). Feeds
        each request's settled rows through the head and drafts for those about to decode."""
        toks, hid_rows, positions, slots, carried = [], [], [], [], []
        drafting: list[tuple[int, int, int]] = []   # (its last fed row, first chained position, slot) of each
        reqs: list[Request] = []
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
            toks.extend(seq[start + 1:start + n + 1])
            hid_rows.extend(range(row0, row0 + n))
            positions.extend(range(start, start + n))
            slots.extend([req.slot] * n)
            if req.pending == 1 and self._wanted(req) > 0:
                drafting.append((len(toks) - 1, req.computed, req.slot))
                reqs.append(req)
        if not toks:
            return
        for req, d in zip(reqs, self._run(toks, hid_rows, positions, slots, drafting, hidden, carried)):
            self.ready[req.rid] = (len(req.output), d[:self._wanted(req)])

    def _wanted(self, req: Request) -> int:
        """Drafts the request can use at its next step: k, or fewer near its max-gen."""
        return min(self.k, req.max_new_tokens - len(req.output) - 1)

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
