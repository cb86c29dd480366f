"""Speculative decoding on the qwen35 hybrid: the GDN state's rollback past rejected drafts (kernels/gdn.py,
"speculative verify"), the engine's speculation over it (prompt lookup, scripted drafts, the MTP head), and the MTP
head itself (engine/mtp_drafts.py) against its plain-torch transcription (engine/models/qwen35.py).

Rollback: a verify run leaves the slot's state and conv ring as they were and keeps its rows' updates aside; the
slot's next run folds in the ones the target kept. Checked on random inputs at the kernel level: every output row the
target keeps, the state and the ring after it, equal those of feeding only the kept rows (bit for bit: the same
operations in the same order), whatever was drafted after them, with the state written every token or every M.

Engine: greedy (and sampled) outputs with drafts equal those without, token for token, at B = 1..8, static and
continuous, token and chunked prefill, paged KV with preemption and a pinned prefix, on a tiny qwen35 model with an
MTP block (torch kernels, fp32). The Triton kernels run under the interpreter in a child process on the CPU; the fused
GPU path (Triton, CUDA graphs) is under `-m gpu`.
"""
from __future__ import annotations

import importlib.util
import itertools
import os
import random
from dataclasses import replace

import pytest
import torch

from onepass.engine.block_manager import BlockManager
from onepass.engine.config import ModelConfig
from onepass.engine.drafts import PromptLookup, ScriptedDrafts
from onepass.engine.fused_qwen35 import FusedQwen35Decoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.models import build_model
from onepass.engine.models.qwen35 import mtp_cache, mtp_reference_drafts
from onepass.engine.mtp_drafts import MTPDrafts, ScriptedMTPDrafts
from onepass.engine.runner import Runner, run_static
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.engine.state_pool import HybridCache, StatePool, drop_recurrent_kv, snapshot_slots
from onepass.kernels.backend import get_step_kernels
from onepass.kernels.errors import ConfigError
from onepass.kernels.gdn import (DraftLog, SpecRows, UpdateLog, conv_ring_update_ref, conv_ring_update_triton,
                                 gdn_step_ref, gdn_step_triton, materialize_state)
from tests.interpreter import run_in_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
SEED = int(os.environ.get("SPEC_SEED") or int.from_bytes(os.urandom(4), "little"))

needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET),
    reason="CPU without TRITON_INTERPRET=1: run by test_cpu_kernels_in_interpreter_subprocess in a child process")


def _msg(what: str) -> str:
    return f"{what} (seed {SEED}; rerun with SPEC_SEED={SEED})"


def _bitwise(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------------------------------
# kernel level: verify + accept a == the accepted rows alone

HK, HV, DK, DV, CONV_K = 2, 6, 16, 16, 4
C = 2 * HK * DK + HV * DV
N_SLOTS = 5
DRAFT_ROWS = 4           # k = 3 drafts + the newest token


class _Layer:
    """One GDN layer's pools (state, conv ring, update log, draft log) and its fixed weights, stepped through a
    backend's kernels with ragged runs, as the fused decoder calls them. shape: (Hk, Hv, Dk, Dv)."""

    def __init__(self, backend: str, M: int, state_dtype, g: torch.Generator, spec: bool, block_v: int | None = 8,
                 shape: tuple[int, int, int, int] = (HK, HV, DK, DV)):
        self.conv, self.gdn = ((conv_ring_update_ref, gdn_step_ref) if backend == "ref" else
                               (conv_ring_update_triton, gdn_step_triton))
        self.kw = {"block_v": block_v} if backend == "triton" else {}
        self.shape = hk, hv, dk, dv = shape
        self.C = c = 2 * hk * dk + hv * dv
        rnd = lambda *s: torch.randn(*s, generator=g).to(DEV)   # noqa: E731
        self.w, self.A, self.dt = rnd(c, CONV_K) * 0.5, -torch.exp(rnd(hv) * 0.5), rnd(hv) * 0.5
        self.ring = rnd(N_SLOTS, c, CONV_K - 1)         # stale contents: a sequence from position 0 must not read them
        self.state = (rnd(N_SLOTS, hv, dk, dv) * 0.3).to(state_dtype)
        self.log = UpdateLog.empty(N_SLOTS, hv, dk, dv, M, DEV, block_v=block_v) if M > 1 else None
        self.draft = DraftLog.empty(N_SLOTS, hv, dk, dv, c, DRAFT_ROWS, DEV, block_v=block_v) if spec else None
        for t in itertools.chain(self.log or (), self.draft or ()):
            t.copy_(rnd(*t.shape))                      # stale entries must never be read

    def __call__(self, runs: list[tuple[int, int, int, int, bool]], inputs):
        """runs: (slot, first position, rows, kept, verify) each; inputs: (qkv [R, C], a [R, Hv], b [R, Hv])."""
        qkv, a, b = inputs
        slots = torch.tensor([s for s, _, n, _, _ in runs for _ in range(n)], dtype=torch.int32, device=DEV)
        pos = torch.tensor([p + i for _, p, n, _, _ in runs for i in range(n)], dtype=torch.long, device=DEV)
        offs = torch.tensor([0, *itertools.accumulate(n for _, _, n, _, _ in runs)], dtype=torch.int32, device=DEV)
        spec = {}
        if self.draft is not None:
            kept = torch.tensor([kp for _, _, n, kp, _ in runs for _ in range(n)], dtype=torch.long, device=DEV)
            ver = torch.tensor([int(v) for _, _, n, _, v in runs for _ in range(n)], dtype=torch.long, device=DEV)
            spec = {"spec": SpecRows(kept, ver), "draft": self.draft}
        hk, hv, dk, dv = self.shape
        x = self.conv(qkv, self.ring, self.w, slots, pos, runs=offs, **spec)
        q, k, v = x.split((hk * dk, hk * dk, hv * dv), dim=-1)
        o = self.gdn(q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv), a, b, self.A, self.dt,
                     self.state, slots, pos, runs=offs, log=self.log, **self.kw, **spec)
        return x, o

    def state_at(self, slot: int, position: int) -> torch.Tensor:
        return materialize_state(self.state, self.log, slot, position)


def _rows(g, n, layer: _Layer):
    hv = layer.shape[1]
    return (torch.randn(n, layer.C, generator=g).to(DEV), torch.randn(n, hv, generator=g).to(DEV),
            torch.randn(n, hv, generator=g).to(DEV))


def _pick(inputs, idx):
    return tuple(t[idx] for t in inputs)


def _rollback_steps(backend: str, M: int, state_dtype, plain_backend: str | None = None, plain_spec: bool = False,
                    seed: int = SEED, **layer):
    """Slots [3, 0, 4]: a prompt each, then verify steps (k = 3 drafts, a set number kept per slot, verify after
    verify), verify runs beside a slot's prompt chunk, a slot restarting at position 0 while its old verify rows wait,
    then decode rows. `spec` runs the verify steps; `plain` (plain_backend's kernels; plain_spec: through the
    speculative path with nothing kept or verified) feeds only the rows the target kept. Returns (spec layer, plain
    layer, [((conv, o) of the kept rows, (conv, o) of plain)] per step, each slot's final position)."""
    g = torch.Generator().manual_seed(seed)
    spec = _Layer(backend, M, state_dtype, torch.Generator().manual_seed(seed + 1), spec=True, **layer)
    plain = _Layer(plain_backend or backend, M, state_dtype, torch.Generator().manual_seed(seed + 1), spec=plain_spec,
                   **layer)
    slots = [3, 0, 4]
    pos = {3: 0, 0: 0, 4: 0}
    kept = {3: 0, 0: 0, 4: 0}
    pairs = []
    # (rows, verify, accepted drafts) per slot and step; rows < 0: the slot restarts at position 0 with -rows rows
    steps = [[(5, False, 0), (7, False, 0), (2, False, 0)],
             [(4, True, 1), (4, True, 3), (4, True, 0)],
             [(4, True, 2), (3, True, 0), (2, False, 0)],
             [(1, False, 0), (4, True, 1), (4, True, 3)],
             [(4, True, 0), (-3, False, 0), (1, False, 0)],
             [(2, False, 0), (4, True, 2), (4, True, 1)],
             [(1, False, 0), (1, False, 0), (1, False, 0)]]
    for step in steps:
        runs_s, runs_p, keep = [], [], []
        rows = 0
        for slot, (n, verify, acc) in zip(slots, step):
            if n < 0:
                pos[slot], kept[slot], n = 0, 2, -n     # a stale kept count: position 0 must ignore it
            runs_s.append((slot, pos[slot], n, kept[slot], verify))
            used = acc + 1 if verify else n
            runs_p.append((slot, pos[slot], used, 0, False))
            keep += range(rows, rows + used)
            rows += n
            pos[slot] += used
            kept[slot] = used if verify else 0
        inputs = _rows(g, rows, spec)
        xs, os_ = spec(runs_s, inputs)
        xp, op = plain(runs_p, _pick(inputs, keep))
        pairs.append(((xs[keep], os_[keep]), (xp, op)))
    return spec, plain, pairs, pos


def _check_rollback(spec, plain, pairs, pos, exact: bool, what: str, tol: float = 2e-5):
    def same(a, b, name):
        ok = _bitwise(a, b) if exact else torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
        err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        assert ok, _msg(f"{what}: {name} differ (max abs {err:.3g}{'' if exact else f' > {tol}'})")

    for i, ((xs, os_), (xp, op)) in enumerate(pairs):
        same(xs, xp, f"step {i} conv outputs of the kept rows")
        same(os_, op, f"step {i} GDN outputs of the kept rows")
    for s, p in pos.items():
        same(spec.ring[s], plain.ring[s], f"slot {s} conv ring")
        same(spec.state_at(s, p), plain.state_at(s, p), f"slot {s} state at position {p}")


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_rollback_equals_feeding_only_the_kept_rows(M, state_dtype):
    """The torch references: every kept row's outputs, and each slot's state and ring after the steps, are bit for bit
    those of feeding only the kept rows (through the same reference), whatever was drafted and rejected; and within
    rounding of the plain reference (which batches its runs' arithmetic differently)."""
    _check_rollback(*_rollback_steps("ref", M, state_dtype, plain_spec=True), exact=True, what=f"ref M={M}")
    tol = 2e-5 if state_dtype == torch.float32 else 3e-2
    _check_rollback(*_rollback_steps("ref", M, state_dtype), exact=False, what=f"ref vs plain ref M={M}", tol=tol)


@needs_kernel
@pytest.mark.parametrize("M,state_dtype", [(3, torch.float32), (1, torch.bfloat16)] if INTERPRET else
                         list(itertools.product([1, 3, 4], [torch.float32, torch.bfloat16])))
def test_triton_rollback_keeps_the_bits(M, state_dtype):
    """The Triton kernels: verify + accept gives exactly the bits of the plain kernels fed only the kept rows, and
    agrees with the reference."""
    _check_rollback(*_rollback_steps("triton", M, state_dtype), exact=True, what=f"triton M={M}")
    tol = 2e-5 if state_dtype == torch.float32 else 3e-2
    _check_rollback(*_rollback_steps("triton", M, state_dtype, plain_backend="ref", plain_spec=True), exact=False,
                    what=f"triton vs ref M={M}", tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("M,state_dtype", [(4, torch.float32), (1, torch.bfloat16), (1, torch.float32)])
def test_gpu_rollback_at_27b_gdn_shapes(M, state_dtype):
    """The 27B's GDN heads (16 key / 48 value heads of 128, the kernel's default 64 columns a program): verify + accept
    keeps the bits of feeding only the kept rows, at the engine's default periods (fp32 every 4, bf16 every token)."""
    _check_rollback(*_rollback_steps("triton", M, state_dtype, block_v=None, shape=(16, 48, 128, 128)), exact=True,
                    what=f"27B shapes M={M}")


def test_draft_log_refusals():
    """A speculative call without positions, or with a draft log laid out for another pool, is refused by name."""
    layer = _Layer("ref", 1, torch.float32, torch.Generator().manual_seed(1), spec=True)
    qkv, a, b = _rows(torch.Generator().manual_seed(2), 2, layer)
    slots = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    zeros = torch.zeros(2, dtype=torch.long, device=DEV)
    spec = SpecRows(zeros, zeros)
    with pytest.raises(ValueError, match="needs positions"):
        conv_ring_update_ref(qkv, layer.ring, layer.w, slots, spec=spec, draft=layer.draft)
    other = DraftLog.empty(N_SLOTS, HV, DK, DV, C + 1, DRAFT_ROWS, DEV)
    with pytest.raises(ValueError, match="conv inputs"):
        conv_ring_update_ref(qkv, layer.ring, layer.w, slots, zeros, spec=spec, draft=other)
    q = torch.zeros(2, HK, DK, device=DEV)
    with pytest.raises(ValueError, match="draft log shapes"):
        gdn_step_ref(q, q, torch.zeros(2, HV, DV, device=DEV), a, b, layer.A, layer.dt, layer.state, slots, zeros,
                     spec=spec, draft=DraftLog.empty(N_SLOTS + 1, HV, DK, DV, C, DRAFT_ROWS, DEV))
    with pytest.raises(ValueError, match="at least one row"):
        DraftLog.empty(N_SLOTS, HV, DK, DV, C, 0, DEV)


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg("(speculative qwen35 under the Triton interpreter)"), only_skipped=True,
                       SPEC_SEED=str(SEED))


# ---------------------------------------------------------------------------------------------------
# the engine: drafts on a tiny qwen35 model with an MTP block (torch kernels, fp32)

# 3 GDN layers + 1 gated-attention layer, 3x value heads (tiled in the file), untied head, one MTP block
CFG = ModelConfig(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=256,
                  norm_eps=1e-6, rope_theta=1e7, context_length=256, qk_norm=True, rotary_dim=8,
                  rope_sections=(2, 1, 1, 0), attn_output_gate=True, gdn_conv_kernel=4, bos_id=1, eos_ids=(2,),
                  name="tiny-qwen35-mtp", full_attention_interval=4, gdn_k_heads=2, gdn_v_heads=6, gdn_k_dim=8,
                  gdn_v_dim=16, tie_embeddings=False, mtp_layers=1)
CTX = 96
K = 3
LOGIT_ATOL = 1e-4       # the fused decoder's tolerance against the reference model (tests/test_fused_qwen35.py)
KINDS = ["ngram", "wrong", "right", "mixed", "mtp"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(fused decoder on the torch kernels, reference model) of a GGUF written once."""
    path = tmp_path_factory.mktemp("spec_qwen35") / "tiny-qwen35-mtp.gguf"
    write_gguf(path, CFG, random_weights(CFG, seed=23), weight_type="f32")
    cfg, w, _ = load_gguf(path, progress=False)
    assert cfg.mtp_layers == 1
    return FusedQwen35Decoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1), build_model(cfg, w)


def motif_prompt(rng: random.Random, n: int) -> list[int]:
    """A prompt that repeats itself, so prompt lookup finds matches."""
    motif = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 5))]
    return (motif * (n // len(motif) + 1))[:n]


def drafts_of(kind: str, futures: dict[int, list[int]]):
    return {"ngram": lambda: PromptLookup(3), "wrong": lambda: ScriptedDrafts(futures, 0.0, CFG.vocab_size),
            "right": lambda: ScriptedDrafts(futures, 1.0, CFG.vocab_size),
            "mixed": lambda: ScriptedDrafts(futures, 0.5, CFG.vocab_size, seed=1), "mtp": MTPDrafts}[kind]()


def check_counters(kind: str, drafted: int, accepted: int) -> None:
    assert drafted > 0 and 0 <= accepted <= drafted, (kind, drafted, accepted)
    if kind == "wrong":
        assert accepted == 0
    if kind == "right":
        assert accepted == drafted


def static(model, prompts, n, drafts=None, k=0, prefill="batched", sampling=None, writeback=1, graphs=False):
    kv = HybridCache.create(model.cfg, len(prompts) + 1, CTX, model.dtype, model.device, writeback=writeback)
    return run_static(model, kv, prompts, n, sampling or SamplingParams(), prefill=prefill, drafts=drafts, spec_k=k,
                      use_graphs=graphs)


_PLAIN: dict = {}
# prompt seeds per B whose runs give prompt lookup something to propose: a random model's output seldom repeats a
# token, so some seeds propose nothing (and would check no draft at all)
STATIC_SEEDS = {1: 102, 2: 2, 4: 4, 8: 8}
QUEUE_SEEDS = {1: 11, 2: 2, 4: 14, 8: 8}


def plain_static(model, B: int, prefill: str):
    key = ("static", B, prefill)
    if key not in _PLAIN:
        rng = random.Random(STATIC_SEEDS[B])
        prompts = [motif_prompt(rng, 9) for _ in range(B)]
        _PLAIN[key] = prompts, static(model, prompts, 14, prefill=prefill)
    return _PLAIN[key]


@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_static_batch_with_drafts_equals_without(tiny, kind, B):
    """Static batching (batched prefill at B = 1, 4; token prefill at B = 2, 8): every slot's greedy tokens with up to
    k = 3 drafts a step equal those without, and the counters say what the drafts were."""
    model = tiny[0]
    prefill = "token" if B in (2, 8) else "batched"
    prompts, plain = plain_static(model, B, prefill)
    spec = static(model, prompts, 14, drafts_of(kind, dict(enumerate(plain.outputs))), K, prefill)
    assert spec.outputs == plain.outputs, (kind, B)
    check_counters(kind, spec.drafted, spec.accepted)
    assert spec.decode_tokens == plain.decode_tokens and len(spec.step_s) <= len(plain.step_s)
    if kind == "right":       # every draft kept: k + 1 tokens a step
        assert len(spec.step_s) <= -(-13 // (K + 1)) + 1


def serve(model, prompts, max_new, drafts=None, k=0, slots=3, prefill="token", layout="contiguous", blocks=0,
          pinned=None, stop_ids=(), sampling=None, budget=16, writeback=1, graphs=False, bs=4):
    """A continuous queue; paged KV in blocks of bs (blocks: the pool, 0 = every slot can reach CTX); pinned: a prefix
    pinned first (its KV blocks and state snapshots shared). Returns ({rid: output}, ServeResult, runner)."""
    cfg = model.cfg
    bm = None
    if layout == "paged":
        blocks = blocks or slots * CTX // bs + 1
        bm = BlockManager(blocks, bs, whole_pinned=pinned is not None)
        kv = PagedKVCache(cfg, blocks, bs, slots, CTX, model.dtype, model.device)
    else:
        kv = ContiguousKVCache(cfg, slots + 1, CTX, model.dtype, model.device)
    n_state = max(snapshot_slots(kv.num_slots, writeback, slots)) + 1 if pinned is not None else kv.num_slots
    kv = HybridCache(drop_recurrent_kv(kv, cfg), StatePool(cfg, n_state, model.device, conv_dtype=model.dtype,
                                                           writeback=writeback))
    sched = Scheduler(slots, "continuous", prefill, budget, bm, CTX, stop_ids, drafts=drafts, spec_k=k)
    runner = Runner(model, kv, sched, sampling or SamplingParams(), use_graphs=graphs)
    if pinned is not None:
        assert runner.pin_prefix(pinned) > 0
    res = runner.run([Request(i, list(p), n) for i, (p, n) in enumerate(zip(prompts, max_new))])
    assert not res.rejected
    return {r.rid: r.output for r in res.finished}, res, runner


def queue(seed: int, n: int = 6):
    rng = random.Random(seed)
    return [motif_prompt(rng, rng.randrange(3, 14)) for _ in range(n)], [rng.randrange(2, 13) for _ in range(n)]


# B, KV layout, prefill: chunked prefill under a budget of 16 rows, so at B = 8 some decoding slots get no row (or
# fewer drafts) in a step and fold their kept rows in a step later
SERVE_CASES = [(1, "contiguous", "chunked"), (2, "paged", "chunked"), (4, "paged", "token"),
               (8, "contiguous", "chunked")]


@pytest.mark.parametrize("B,layout,prefill", SERVE_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_served_queue_with_drafts_equals_without(tiny, kind, B, layout, prefill):
    """Continuous batching (slots refilled from position 0 while others verify) over contiguous or paged KV: every
    request's greedy tokens with drafts equal those without."""
    model = tiny[0]
    prompts, max_new = queue(QUEUE_SEEDS[B])
    key = ("serve", B, layout, prefill)
    if key not in _PLAIN:
        _PLAIN[key] = serve(model, prompts, max_new, slots=B, prefill=prefill, layout=layout)[0]
    plain = _PLAIN[key]
    spec, res, _ = serve(model, prompts, max_new, drafts_of(kind, plain), K, slots=B, prefill=prefill, layout=layout)
    assert spec == plain, (kind, B, layout, prefill)
    check_counters(kind, res.drafted, res.accepted)


def test_stop_token_inside_an_accepted_run(tiny):
    """A stop token among the kept drafts ends the request there, as without speculation."""
    model = tiny[0]
    prompts, _ = queue(5, 3)
    plain = serve(model, prompts, [12] * 3)[0]
    stop = plain[1][5]
    want = serve(model, prompts, [12] * 3, stop_ids=(stop,))[0]
    got = serve(model, prompts, [12] * 3, ScriptedDrafts(plain, 1.0, CFG.vocab_size), 4, stop_ids=(stop,))[0]
    assert got == want and got[1][-1] == stop and len(got[1]) <= 6


@pytest.mark.parametrize("kind,prefill", [("right", "token"), ("mixed", "chunked"), ("mtp", "token"),
                                          ("mtp", "chunked")])
def test_pinned_prefix_and_preemption_with_drafts(tiny, kind, prefill):
    """Paged KV with a pinned prefix (its KV blocks and recurrent-state snapshot shared; the MTP head's KV of it too),
    and a pool too small for every slot at once (requests preempted and recomputed, each time from the snapshot):
    drafts change no output, and the requests did share the prefix and were preempted."""
    model = tiny[0]
    rng = random.Random(9)
    shared = [rng.randrange(3, 256) for _ in range(17)]
    prompts = [shared + motif_prompt(rng, 2 + i) for i in range(4)] + [shared[:5] + motif_prompt(rng, 6), shared]
    max_new = [8, 4, 9, 6, 7, 5]
    plain = serve(model, prompts, max_new, slots=3, prefill=prefill, layout="paged", pinned=shared)[0]
    for blocks in (0, 11):
        spec, res, _ = serve(model, prompts, max_new, drafts_of(kind, plain), K, slots=3, prefill=prefill,
                             layout="paged", pinned=shared, blocks=blocks)
        assert spec == plain, (kind, prefill, blocks)
        check_counters(kind, res.drafted, res.accepted)
        assert res.prefill_rows < sum(map(len, prompts))            # the prefix was shared, not recomputed
        if blocks:
            assert sum(r.preemptions for r in res.finished) > 0


def test_state_written_back_every_few_tokens_with_drafts(tiny):
    """A pool written back every 3 tokens (the GPU's fp32 default is 4): verify runs keep their rows out of both the
    base state and the update log, and the kept rows are folded in by the period's schedule."""
    model = tiny[0]
    prompts, plain = plain_static(model, 4, "batched")
    for kind in ("mixed", "mtp"):
        spec = static(model, prompts, 14, drafts_of(kind, dict(enumerate(plain.outputs))), K, writeback=3)
        assert spec.outputs == plain.outputs, kind


@pytest.mark.parametrize("kind", ["mixed", "mtp"])
def test_sampled_tokens_equal_without_drafts(tiny, kind):
    """Temperature sampling: each token is drawn with its request's seed at its index whether a draft row or a plain
    step draws it, so the outputs are the same token for token."""
    model = tiny[0]
    sampling = SamplingParams(temperature=0.9, seed=5)
    prompts, _ = plain_static(model, 4, "batched")
    plain = static(model, prompts, 14, sampling=sampling)
    spec = static(model, prompts, 14, drafts_of(kind, dict(enumerate(plain.outputs))), K, sampling=sampling)
    assert spec.outputs == plain.outputs


def test_sampled_token_distribution_with_mtp_drafts(tiny):
    """Chi-square goodness of fit, not just agreement: over 240 requests (each its own seed) at temperature 0.7 with
    MTP drafts (k = 2), the first token and the second (the first one a draft can decide) follow their distributions
    under the plain-torch reference model, the second's being sum over first tokens v of P(v) softmax(logits after v
    / 0.3). Tokens are pooled into bins of about 10 expected draws in order of probability; p < 0.001 fails."""
    from scipy.stats import chisquare

    model, ref = tiny
    n, T, V = 240, 0.3, CFG.vocab_size
    prompt = motif_prompt(random.Random(31), 6)
    sampling = SamplingParams(temperature=T, seed=9)
    got, res, _ = serve(model, [prompt] * n, [3] * n, MTPDrafts(), 2, slots=8, sampling=sampling)
    assert res.drafted > 0
    P = len(prompt)
    kv = HybridCache.create(CFG, V, CTX, torch.float32, "cpu")
    ids = torch.tensor([prompt + [v] for v in range(V)])          # every first token after the prompt
    logits = ref.forward(ids, torch.arange(P + 1).expand(V, -1), torch.arange(V), kv, last_only=False)
    p_first = torch.softmax(logits[0, P - 1] / T, dim=-1).double()
    p_second = p_first @ torch.softmax(logits[:, P] / T, dim=-1).double()
    for draws, p in (([got[i][0] for i in range(n)], p_first), ([got[i][1] for i in range(n)], p_second)):
        # bins of tokens in order of probability, each closed once it expects 10 draws (the last takes the rest)
        bins, acc, cur = [], 0.0, []
        for v in torch.argsort(p, descending=True).tolist():
            cur.append(v)
            acc += float(p[v]) * n
            if acc >= 10:
                bins.append(cur)
                cur, acc = [], 0.0
        bins[-1] += cur
        assert len(bins) >= 8, "too few bins to test"
        observed = [sum(draws.count(v) for v in b) for b in bins]
        want = [float(p[b].sum()) * n for b in bins]
        assert chisquare(observed, want, sum_check=False).pvalue > 1e-3, (observed, want)


# ---------------------------------------------------------------------------------------------------
# the MTP head

class Recorded(MTPDrafts):
    """MTPDrafts that keeps each proposal with the sequence it was made for."""

    def __init__(self):
        super().__init__()
        self.proposals: list[tuple[list[int], int, list[int]]] = []

    def __call__(self, req, k):
        drafts = super().__call__(req, k)
        if drafts:
            self.proposals.append((req.tokens, k, drafts))
        return drafts


def test_mtp_head_matches_its_reference(tiny):
    """The engine's head (model kernels, its own KV) against Qwen35Model.mtp_forward, the notes' formula in plain
    torch: logits within LOGIT_ATOL = 1e-4 over rows of two slots at several positions, fed in two calls (the second
    attends to the first's KV)."""
    model, ref = tiny
    head = MTPDrafts()
    head.bind(model, 3, CTX, K)
    g = torch.Generator().manual_seed(3)
    T = 6
    tokens = torch.randint(3, 256, (2, T), generator=g)
    hidden = torch.randn(2, T, CFG.dim, generator=g)
    kv = mtp_cache(CFG, 3, CTX, torch.float32, "cpu")
    slots = [2, 0]
    for lo, hi in ((0, 4), (4, T)):
        want, _ = ref.mtp_forward(tokens[:, lo:hi], hidden[:, lo:hi], torch.arange(lo, hi).expand(2, -1),
                                  torch.tensor(slots), kv)
        rows = [(s, p) for s in range(2) for p in range(lo, hi)]
        out = head.forward([int(tokens[s, p]) for s, p in rows], torch.stack([hidden[s, p] for s, p in rows]),
                           [p for _, p in rows], [slots[s] for s, _ in rows])
        got = head.logits(out).float().view(2, hi - lo, -1)
        assert (got - want).abs().max().item() <= LOGIT_ATOL



def test_mtp_head_rows_padded_to_buckets_change_nothing(tiny):
    """What a captured graph runs (engine/mtp_drafts.py, _Staged): the rows padded to a pair of row buckets, the
    padding on the head's scratch slot, every drafting row chained k times with positions clamped below max_len. The
    drafts and every real slot's head KV equal the unpadded run's (to the CPU GEMMs' rounding, which varies with the
    row count; the GPU test test_gpu_graphed_mtp_head_drafts_as_eager asks the graphed head for bit-exact drafts)."""
    from onepass.engine.mtp_drafts import _Staged

    model, _ = tiny
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(16, CFG.dim, generator=g)
    # two requests: slot 2 feeds 3 rows at positions 0-2 and drafts from the last; slot 0 feeds one row at the
    # context's end, so its chained positions run past max_len and are clamped
    toks, hid, pos, slots = [7, 9, 11, 13], [4, 5, 6, 9], [0, 1, 2, CTX - 2], [2, 2, 2, 0]
    drafting = [(2, 3, 2), (3, CTX - 1, 0)]
    got = []
    for pad in (False, True):
        head = MTPDrafts()
        head.bind(model, 3, CTX, K)
        cols = [list(c) for c in zip(*drafting)]
        if pad:
            stage = _Staged(8, 4, head.scratch, "cpu")
            stage.send([toks, hid, pos, slots], cols, 8, 4)
            drafts = torch.zeros(K, 4, dtype=torch.long)
            head._feed_chain(stage.views(8, 4), hidden, head._allocate(8), drafts)
            drafts = drafts[:, :2]
        else:
            drafts = torch.zeros(K, 2, dtype=torch.long)
            x = dict(zip(_Staged.FED + _Staged.DRAFTING, (torch.tensor(c) for c in [toks, hid, pos, slots, *cols])))
            head._feed_chain(x, hidden, head._buffers(4), drafts)
        real = [c[:head.scratch] for c in (*head.cache.k.values(), *head.cache.v.values())]
        got.append((drafts.t().tolist(), real))
    assert got[0][0] == got[1][0]
    for a, b in zip(got[0][1], got[1][1]):   # the CPU's GEMMs round by row count: a wrong row is off by O(1)
        assert (a - b).abs().max().item() <= 1e-5 and torch.equal(a == 0, b == 0)


@pytest.mark.parametrize("B,mode", [(2, "static"), (4, "continuous")])
def test_mtp_drafts_equal_the_reference_drafts(tiny, B, mode):
    """Every proposal the engine's head made while serving (fed incrementally: prompt rows, then only the rows the
    target kept, its chained positions written again later) equals mtp_reference_drafts of the same sequence, which
    runs the trunk and the head from scratch."""
    model, ref = tiny
    drafts = Recorded()
    if mode == "static":
        prompts, plain = plain_static(model, B, "token" if B in (2, 8) else "batched")
        static(model, prompts, 14, drafts, K, "token" if B in (2, 8) else "batched")
    else:
        prompts, max_new = queue(QUEUE_SEEDS[B], 5)
        serve(model, prompts, max_new, drafts, K, slots=B, layout="paged", prefill="chunked")
    assert len(drafts.proposals) > 5
    for toks, k, got in drafts.proposals[::3]:
        assert mtp_reference_drafts(ref, toks, k)[:len(got)] == got


def _echo_model():
    """A model whose MTP head drafts exactly what the trunk will say: every layer's output projections zeroed, so
    the trunk's next token is a function of the current one, f(t) = argmax lm_head(rms_norm(embed t) * out_norm); and
    the head made to compute the same function of its input token (eh_proj = [I | 0], its mixer and MLP zeroed,
    enorm = 1, shared_head_norm = output_norm)."""
    cfg = CFG
    w = random_weights(cfg, seed=29)
    for name in list(w):
        if name.endswith(("ssm_out.weight", "attn_output.weight", "ffn_down.weight")):
            w[name] = torch.zeros_like(w[name])
    m = f"blk.{cfg.n_layers}.nextn."
    w[m + "eh_proj.weight"] = torch.cat((torch.eye(cfg.dim), torch.zeros(cfg.dim, cfg.dim)), dim=1)
    w[m + "enorm.weight"] = torch.ones(cfg.dim)
    w[m + "shared_head_norm.weight"] = w["output_norm.weight"].clone()
    return FusedQwen35Decoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1)


def test_mtp_drafts_all_kept_when_the_head_knows(tiny):
    """A head built to predict the trunk's next tokens exactly: every draft is kept (k + 1 tokens a step), the
    output is the output without drafts."""
    model = _echo_model()
    rng = random.Random(4)
    prompts = [motif_prompt(rng, 6) for _ in range(2)]
    plain = static(model, prompts, 17)
    spec = static(model, prompts, 17, MTPDrafts(), K)
    assert spec.outputs == plain.outputs
    assert spec.drafted > 0 and spec.accepted == spec.drafted
    assert len(spec.step_s) == -(-16 // (K + 1))
    got, res, _ = serve(model, prompts * 2, [17, 9, 5, 12], MTPDrafts(), K, slots=2, layout="paged")
    assert got == serve(model, prompts * 2, [17, 9, 5, 12], slots=2, layout="paged")[0]
    assert res.drafted > 0 and res.accepted == res.drafted


def test_scripted_tokens_at_the_mtp_heads_cost(tiny):
    """speculative=mtp_scripted: the head runs (fed and chained as for speculative=mtp), as many scripted drafts are
    fed as it drafted, and they are the scripted ones: all kept at acceptance 1, none at 0; the tokens equal the run
    without drafts either way."""
    model = tiny[0]
    prompts, plain = plain_static(model, 4, "batched")
    futures = dict(enumerate(plain.outputs))

    class Counted(ScriptedMTPDrafts):
        def __init__(self, script):
            super().__init__(script)
            self.head_rows, self.asked = 0, []

        def _forward(self, tokens, hidden, positions, slots, buf):
            self.head_rows += tokens.shape[0]
            return super()._forward(tokens, hidden, positions, slots, buf)

        def __call__(self, req, k):
            out = super().__call__(req, k)
            self.asked.append(len(out))
            return out

    for acc in (1.0, 0.0):
        drafts = Counted(ScriptedDrafts(futures, acc, CFG.vocab_size))
        spec = static(model, prompts, 14, drafts, K)
        assert spec.outputs == plain.outputs
        assert drafts.head_rows > 0 and all(n <= K for n in drafts.asked) and spec.drafted == sum(drafts.asked)
        check_counters("right" if acc else "wrong", spec.drafted, spec.accepted)


def test_mtp_refused_without_an_mtp_block(tiny, tiny_ggufs):
    """speculative=mtp on a model without an MTP block, or not qwen35, is refused when the runner is built, naming the
    model and the fix."""
    from onepass.engine.fused_model import FusedDecoder

    cfg = replace(CFG, mtp_layers=0, name="tiny-qwen35-no-mtp")
    w = {n: t for n, t in random_weights(CFG, seed=2).items() if not n.startswith(f"blk.{CFG.n_layers}.")}
    models = [FusedQwen35Decoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1)]
    lcfg, lw, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    models.append(FusedDecoder(lcfg, lw, get_step_kernels("torch"), max_pos=CTX + 1))
    for model in models:
        kv = ContiguousKVCache(model.cfg, 3, CTX, torch.float32, "cpu")
        if model.cfg.arch == "qwen35":
            kv = HybridCache(drop_recurrent_kv(kv, model.cfg), StatePool(model.cfg, 3))
        with pytest.raises(ConfigError, match=rf"{model.cfg.name} \({model.cfg.arch}\) has none .*speculative=ngram"):
            Runner(model, kv, Scheduler(2, drafts=MTPDrafts(), spec_k=2, ctx=CTX), SamplingParams(), use_graphs=False)


def test_harness_checks_speculation_on_qwen35(tmp_path):
    """The harness no longer refuses speculation on qwen35; speculative=mtp on a synthetic model without an MTP block
    is refused before anything loads; a tiny qwen35 job with drafts verifies token for token."""
    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR
    from onepass.harness.checks import check_speculative

    def cfg_of(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    for method in ("ngram", "scripted"):
        check_speculative(cfg_of("model=tiny-qwen35", f"speculative={method}"))
    for method in ("mtp", "mtp_scripted"):
        with pytest.raises(ConfigError, match="model=tiny-qwen35 .*has none.*mtp_layers=1.*speculative=ngram"):
            check_speculative(cfg_of("model=tiny-qwen35", f"speculative={method}"))
        check_speculative(cfg_of("model=tiny-qwen35", f"speculative={method}", "model.synthetic.mtp_layers=1"))
    assert cfg_of("experiment=spec_decode_27b").model.synthetic.mtp_layers == 1
    with pytest.raises(ConfigError, match="speculative.k=0"):
        check_speculative(cfg_of("model=tiny-qwen35", "speculative=mtp", "speculative.k=0"))
    assert cfg_of("speculative=mtp").speculative.k == 3


# ---------------------------------------------------------------------------------------------------
# GPU: the fused decoder on Triton kernels with CUDA graphs

@pytest.mark.gpu
@pytest.mark.parametrize("writeback", [1, 4])
def test_gpu_graphed_drafts_are_bit_exact(tmp_path, writeback):
    """Triton kernels and CUDA graphs, bf16 weights, fp32 state written every token or every 4 (the engine's fp32
    default): drafts change no token at B = 1, 8 and 32 (static, batched and token prefill; greedy and sampled) for
    scripted, prompt-lookup and MTP drafts; nor in a continuous paged queue with chunked prefill and a pinned
    prefix, with preemption."""
    path = tmp_path / "tiny-qwen35-mtp.gguf"
    write_gguf(path, CFG, random_weights(CFG, seed=23), weight_type="f32")
    cfg, w, _ = load_gguf(path, dtype=torch.bfloat16, device="cuda", progress=False)
    model = FusedQwen35Decoder(cfg, w, get_step_kernels("triton"), max_pos=CTX + 1)
    for B in (1, 8, 32):
        rng = random.Random(B)
        prompts = [motif_prompt(rng, 9) for _ in range(B)]
        for sampling, prefill in ((SamplingParams(), "batched"), (SamplingParams(temperature=0.9, seed=B), "token")):
            plain = static(model, prompts, 24, prefill=prefill, sampling=sampling, writeback=writeback, graphs=True)
            futures = dict(enumerate(plain.outputs))
            for drafts, k in ((ScriptedDrafts(futures, 0.6, cfg.vocab_size), 3), (PromptLookup(3), 4),
                              (MTPDrafts(), 3)):
                spec = static(model, prompts, 24, drafts, k, prefill, sampling, writeback, graphs=True)
                assert spec.outputs == plain.outputs, (B, sampling, prefill, type(drafts).__name__)
    rng = random.Random(7)
    shared = [rng.randrange(3, 256) for _ in range(33)]
    prompts = [shared + motif_prompt(rng, 2 + i % 5) for i in range(10)] + [motif_prompt(rng, 11) for _ in range(4)]
    max_new = [random.Random(i).randrange(2, 20) for i in range(len(prompts))]
    kw = dict(slots=4, prefill="chunked", layout="paged", pinned=shared, writeback=writeback, graphs=True, bs=16)
    for blocks in (0, 9):
        plain = serve(model, prompts, max_new, blocks=blocks, **kw)[0]
        for drafts in (ScriptedDrafts(plain, 0.6, cfg.vocab_size), PromptLookup(3), MTPDrafts()):
            spec, res, _ = serve(model, prompts, max_new, drafts, K, blocks=blocks, **kw)
            assert spec == plain, (blocks, type(drafts).__name__)


@pytest.mark.gpu
def test_gpu_graphed_mtp_head_drafts_as_eager(tmp_path):
    """The MTP head's feed and chain as CUDA graphs (rows padded to bucket pairs on the head's scratch slot) propose
    exactly the drafts of the same head run eagerly on the same kernels, request by request and step by step: static
    batches at B = 1 and 8 (token prefill), and a continuous queue with chunked prefill, whose long prompt chunks take
    the eager path inside the graphed run."""
    path = tmp_path / "tiny-qwen35-mtp.gguf"
    write_gguf(path, CFG, random_weights(CFG, seed=31), weight_type="f32")
    cfg, w, _ = load_gguf(path, dtype=torch.bfloat16, device="cuda", progress=False)
    model = FusedQwen35Decoder(cfg, w, get_step_kernels("triton"), max_pos=CTX + 1)
    for B in (1, 8):
        rng = random.Random(40 + B)
        prompts = [motif_prompt(rng, 9) for _ in range(B)]
        got = {}
        for graphs in (False, True):
            drafts = Recorded()
            got[graphs] = static(model, prompts, 20, drafts, K, "token", graphs=graphs).outputs, drafts.proposals
            assert not graphs or drafts.graphs, "the graphed run captured no head graph"
        assert got[True] == got[False] and len(got[True][1]) > 5, B
    rng = random.Random(9)
    prompts = [motif_prompt(rng, 3 + 4 * i) for i in range(8)]
    max_new = [random.Random(i).randrange(4, 20) for i in range(len(prompts))]
    got = {}
    for graphs in (False, True):
        drafts = Recorded()
        got[graphs] = serve(model, prompts, max_new, drafts, K, slots=4, prefill="chunked", layout="paged",
                            graphs=graphs, bs=16)[0], drafts.proposals
    assert got[True] == got[False] and len(got[True][1]) > 5
