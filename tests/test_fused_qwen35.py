"""The fused hybrid decode step (engine/fused_qwen35.py, driven by engine/runner.py) against the
qwen35 reference model (engine/models/qwen35.py, itself checked against HF transformers in test_qwen35.py).

Models: two tiny synthetic qwen35 GGUFs, one with value heads = key heads (2 GDN + 2 attention layers, tied
head), one with 3x value heads (3 GDN + 1 attention layer, untied, an MTP block) -- test_qwen35's shapes.

CPU (torch reference kernels, fp32): logits agree with the reference model within LOGIT_ATOL = 1e-4 (the
same op-order tolerance test_qwen35 allows against HF; measured ~1e-6 here) and greedy tokens exactly, for
batched and token prefill, static refill, a slot restarting while others continue, and paged KV.
bf16 (Triton under the interpreter on the CPU; on the GPU): these random tiny models amplify any bf16
rounding (swapping any one bf16 kernel, existing ones included, moves logits by ~3% of their scale), so
the Triton decoder's logits must be no further from the fp32 torch result than bf16 torch logits are
(x BF16_SLACK = 2), measured in the same test; B streams equal the single stream.
GPU (`gpu`): the Triton decoder vs the reference model (that criterion), CUDA-graph replay == eager, B
streams == the single stream, token prefill == runs, refill inside graphs, paged == contiguous, bf16 state.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from functools import partial

import pytest
import torch

from onepass.engine.config import ModelConfig
from onepass.kernels.errors import ConfigError
from onepass.engine.fused_qwen35 import FusedQwen35Decoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.state_pool import HybridCache, StatePool, check_hybrid_serving, drop_recurrent_kv, snapshot_slots
from onepass.engine.models.generate import reference_generate
from onepass.engine.runner import run_static
from onepass.engine.verify import verify_greedy
from onepass.kernels.backend import get_step_kernels
from tests.interpreter import run_in_interpreter

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOGIT_ATOL = 1e-4
BF16_SLACK = 2.0  # bf16 Triton logits may be at most this many times as far from fp32 as bf16 torch logits

_BASE = dict(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=256,
             norm_eps=1e-6, rope_theta=1e7, context_length=256, qk_norm=True, rotary_dim=8, rope_sections=(2, 1, 1, 0),
             attn_output_gate=True, gdn_conv_kernel=4, bos_id=1, eos_ids=(2,))
CONFIGS = {
    "equal-heads": ModelConfig(**_BASE, name="tiny-qwen35-eq", full_attention_interval=2, gdn_k_heads=2,
                               gdn_v_heads=2, gdn_k_dim=16, gdn_v_dim=16, tie_embeddings=True),
    "3x-value-heads": ModelConfig(**_BASE, name="tiny-qwen35-gva", full_attention_interval=4, gdn_k_heads=2,
                                  gdn_v_heads=6, gdn_k_dim=8, gdn_v_dim=16, tie_embeddings=False, mtp_layers=1),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused_qwen35")
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        path = d / f"{cfg.name}.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=21 + i), weight_type="f32")
        out[name] = path
    return out


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(path, dtype=torch.float32, device="cpu"):
    return load_gguf(path, dtype=dtype, device=device, progress=False)


def fused(cfg, w, backend="torch", max_pos=128):
    return FusedQwen35Decoder(cfg, w, get_step_kernels(backend), max_pos=max_pos)


def hybrid(cfg, slots, ctx=64, dtype=torch.float32, device="cpu", state_dtype=torch.float32, writeback=1):
    return HybridCache.create(cfg, slots, ctx, dtype, device, state_dtype, writeback=writeback)


def stepper(model, batch, ctx=64, graphs=False, **kw):
    kv = hybrid(model.cfg, batch + 1, ctx, model.dtype, model.device, **kw)
    return partial(run_static, model, kv, sampling=SamplingParams(), use_graphs=graphs), kv


def rows_logits(model, kv, tokens, positions, slots, seq_len=1, block_table=None):
    t = lambda x: torch.as_tensor(x, device=model.device)  # noqa: E731
    hidden = model.hidden(t(tokens), t(positions), t(slots), kv, model.buffers(len(tokens)),
                          block_table=block_table, seq_len=seq_len)
    return model.logits(hidden).float()


# ---------------------------------------------------------------------------------------------------
# CPU, torch kernels


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_reference_model(ggufs, name):
    """Two slots prefilled as slot-major runs (seq_len = P), then 6 decode steps one row per slot: logits of
    every prompt position and every step match the reference model's."""
    cfg, w, _ = load(ggufs[name])
    ref, model = build_model(cfg, w), fused(cfg, w)
    P = 7
    prompts = [prompt(1, P), prompt(2, P)]
    rkv, kv = hybrid(cfg, 2), hybrid(cfg, 3)
    want = ref.forward(torch.tensor(prompts), torch.arange(P).expand(2, P), torch.tensor([0, 1]), rkv, last_only=False)
    got = rows_logits(model, kv, sum(prompts, []), list(range(P)) * 2, [0] * P + [1] * P, seq_len=P)
    assert (got.view(2, P, -1) - want).abs().max().item() <= LOGIT_ATOL
    nxt = want[:, -1].argmax(-1)
    for step in range(6):
        pos = P + step
        want = ref.forward(nxt.view(2, 1), torch.full((2, 1), pos), torch.tensor([0, 1]), rkv)
        got = rows_logits(model, kv, nxt.tolist(), [pos, pos], [0, 1])
        assert (got - want).abs().max().item() <= LOGIT_ATOL, step
        nxt = want.argmax(-1)
    for j in range(len(cfg.gdn_layers)):  # the pools hold the same state
        assert (kv.state.ssm[j][:2] - rkv.state.ssm[j]).abs().max().item() <= 1e-5
        assert (kv.state.conv[j][:2] - rkv.state.conv[j]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill", ["batched", "token"])
def test_greedy_matches_reference_model(ggufs, name, prefill):
    cfg, w, _ = load(ggufs[name])
    p = prompt(7, 9)   # on the tied equal-heads model, prompt(5, 9)'s greedy stream is one token repeated
    want = reference_generate(build_model(cfg, w), hybrid(cfg, 1), [p], 12, SamplingParams()).outputs[0]
    st, _ = stepper(fused(cfg, w), 3)  # 3 slots in the 4-row bucket: one padded row on the scratch slot
    got = st([p] * 3, 12, prefill=prefill)
    assert verify_greedy(got.outputs, want).ok


@pytest.mark.parametrize("writeback", [2, 3])
def test_state_written_back_every_few_tokens(ggufs, writeback):
    """The fused decoder (torch kernels) with its pools written back every few tokens: the reference model's greedy
    tokens from batched and token prefill, and a refilled stepper restarts from zero; the reference model itself
    refuses such a pool."""
    cfg, w, _ = load(ggufs["3x-value-heads"])
    p = prompt(5, 9)
    ref = build_model(cfg, w)
    want = reference_generate(ref, hybrid(cfg, 1), [p], 12, SamplingParams()).outputs[0]
    st, kv = stepper(fused(cfg, w), 3, writeback=writeback)
    assert kv.state.writeback == writeback and kv.state.log[0] is not None
    for prefill in ("batched", "token", "batched"):     # the last a refill over the earlier sequences
        assert verify_greedy(st([p] * 3, 12, prefill=prefill).outputs, want).ok, prefill
    with pytest.raises(ConfigError, match="written back every"):
        ref.forward(torch.tensor([p]), torch.arange(9)[None], torch.tensor([0]), hybrid(cfg, 1, writeback=writeback))


def test_write_back_traffic_and_size(ggufs):
    """What a pool written back every M tokens holds and moves per token, against the one written every token: the
    state read once and written 1/M of the time, a log entry written on the other tokens and (M - 1) / 2 replayed."""
    cfg, _, _ = load(ggufs["3x-value-heads"])
    every, lazy = StatePool(cfg, 3), StatePool(cfg, 3, writeback=4)
    state = sum(t[0].numel() * 4 for t in every.ssm)
    conv = sum(t[0].numel() * 4 for t in every.conv)
    assert every.step_bytes_per_slot() == 2 * state + 2 * conv
    entry = sum(lg.nbytes for lg in lazy.log) / 3 / 3      # one token's log entry of one slot, all layers
    assert entry == len(cfg.gdn_layers) * 4 * cfg.gdn_v_heads * (cfg.gdn_k_dim + cfg.gdn_v_dim + 1)
    assert lazy.step_bytes_per_slot() == pytest.approx(1.25 * state + 2 * conv + entry * (0.75 + 1.5))
    assert lazy.nbytes == every.nbytes + 3 * 3 * entry
    with pytest.raises(ConfigError, match="write-back period 0"):
        StatePool(cfg, 3, writeback=0)


def test_static_refill_restarts_slots(ggufs):
    """A stepper whose slots held other sequences (and longer ones) refilled at position 0 gives exactly
    what a fresh stepper gives: the kernels restart the recurrence, no reset call."""
    cfg, w, _ = load(ggufs["3x-value-heads"])
    model = fused(cfg, w)
    a, b = [prompt(6, 10), prompt(7, 10)], [prompt(8, 5), prompt(9, 5)]
    fresh = stepper(model, 2)[0](b, 8).outputs
    for prefill in ("batched", "token"):
        st, kv = stepper(model, 2)
        st(a, 20, prefill=prefill)  # slots now hold 29 tokens of other sequences
        assert kv.state.ssm[0][:2].abs().max() > 0
        assert st(b, 8, prefill=prefill).outputs == fresh, prefill


def test_slot_restarts_while_others_continue(ggufs):
    """Continuous-batching shape: slot 1 restarts with a new sequence (token by token from position 0) while
    slot 0 continues in the same steps; each matches the same sequence run alone in a fresh cache."""
    cfg, w, _ = load(ggufs["3x-value-heads"])
    model = fused(cfg, w)
    s0, s1_old, s1 = prompt(10, 12), prompt(11, 9), prompt(12, 6)

    def alone(seq):
        kv = hybrid(cfg, 1)
        return torch.stack([rows_logits(model, kv, [t], [p], [0])[0] for p, t in enumerate(seq)])

    kv = hybrid(cfg, 2)
    for p in range(len(s1_old)):  # both slots busy: slot 1 with a sequence that then ends
        rows_logits(model, kv, [s0[p], s1_old[p]], [p, p], [0, 1])
    out0, out1 = [], []
    for p in range(len(s1_old), len(s0)):
        q = p - len(s1_old)  # slot 1 restarts at position 0
        got = rows_logits(model, kv, [s0[p], s1[q]], [p, q], [0, 1])
        out0.append(got[0])
        out1.append(got[1])
    assert (torch.stack(out0) - alone(s0)[len(s1_old):]).abs().max().item() <= LOGIT_ATOL
    assert (torch.stack(out1) - alone(s1)[: len(out1)]).abs().max().item() <= LOGIT_ATOL


def paged_hybrid(cfg, slots, ctx, dtype=torch.float32, device="cpu", seed=0):
    """A paged KV pool for the attention layers with scrambled block tables (block 0 = scratch), + a StatePool."""
    bs = 16
    per = -(-ctx // bs)
    paged = drop_recurrent_kv(PagedKVCache(cfg, slots * per + 1, bs, slots, ctx, dtype, device), cfg)
    blocks = (torch.randperm(slots * per, generator=torch.Generator().manual_seed(seed)) + 1).view(slots, per)
    paged.set_tables({s: blocks[s].tolist() for s in range(slots)})
    return HybridCache(paged, StatePool(cfg, paged.num_slots, device))


def test_paged_kv_matches_contiguous(ggufs):
    cfg, w, _ = load(ggufs["equal-heads"])
    model = fused(cfg, w)
    seqs = [prompt(13, 20), prompt(14, 20)]
    cont, paged = hybrid(cfg, 2, ctx=32), paged_hybrid(cfg, 2, 32)
    assert paged.kv.k[0].numel() == 0 and paged.kv.k[1].shape[1] == 16  # GDN layer 0 keeps no KV
    for p in range(20):  # crosses a block boundary at 16
        toks = [seqs[0][p], seqs[1][p]]
        a = rows_logits(model, cont, toks, [p, p], [0, 1])
        b = rows_logits(model, paged, toks, [p, p], [0, 1], block_table=paged.kv.block_table)
        assert (a - b).abs().max().item() <= LOGIT_ATOL, p  # the two references gather keys differently


def _serve(model, kv, prompts, max_new, prefill, budget, graphs=False):
    from onepass.engine.scheduler import Request, Scheduler
    from onepass.engine.runner import Runner

    sched = Scheduler(kv.num_slots - 1, "continuous", prefill, budget, None, kv.kv.ctx)
    eng = Runner(model, kv, sched, SamplingParams(), True, use_graphs=graphs)
    return eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))])


SERVE_PROMPTS = [(41, 5, 6), (42, 13, 3), (43, 2, 8), (44, 9, 5), (45, 17, 4)]   # (seed, prompt length, max new)


@pytest.mark.parametrize("name", CONFIGS)
def test_serving_chunked_prefill_matches_single_stream(ggufs, name):
    """Continuous serving with chunked prefill under a budget of 8 rows a step: prompt chunks of unequal lengths,
    some continuing a prompt from an earlier step, beside other slots' decode rows (ragged runs through the GDN
    layers) give every request its single-stream greedy output, as token prefill does, in fewer steps."""
    cfg, w, _ = load(ggufs[name])
    model, ref = fused(cfg, w), build_model(cfg, w)
    prompts = [prompt(sd, n) for sd, n, _ in SERVE_PROMPTS]
    max_new = [m for _, _, m in SERVE_PROMPTS]
    want = {i: reference_generate(ref, hybrid(cfg, 1), [p], m, SamplingParams()).outputs[0]
            for i, (p, m) in enumerate(zip(prompts, max_new))}
    res = {pf: _serve(model, hybrid(cfg, 4), prompts, max_new, pf, 8) for pf in ("token", "chunked")}
    for pf, r in res.items():
        assert {q.rid: q.output for q in r.finished} == want, pf
    assert res["chunked"].steps < res["token"].steps
    assert res["chunked"].prefill_rows == res["token"].prefill_rows


def _pinned_engine(model, batch, prefill, budget, ctx=64, bs=4, graphs=False, writeback=1, blocks=0):
    """A serving engine over paged KV whose requests may share a pinned prefix (state snapshot in a spare slot);
    blocks: the pool (0: every slot can reach ctx)."""
    from onepass.engine.block_manager import BlockManager
    from onepass.engine.scheduler import Scheduler
    from onepass.engine.runner import Runner

    cfg, dev, dt = model.cfg, model.device, model.dtype
    blocks = blocks or batch * ctx // bs + 1
    # + scratch + a snapshot slot for each write-back phase class
    slots = max(snapshot_slots(batch + 1, writeback, batch)) + 1
    kv = HybridCache(drop_recurrent_kv(PagedKVCache(cfg, blocks, bs, batch, ctx, dt, dev), cfg),
                     StatePool(cfg, slots, dev, conv_dtype=dt, writeback=writeback))
    sched = Scheduler(batch, "continuous", prefill, budget, BlockManager(blocks, bs, whole_pinned=True), ctx)
    return Runner(model, kv, sched, SamplingParams(), True, use_graphs=graphs)


def _pinned_workload():
    """Prompts that start with the 16-position pinned prefix, one that shares only its first 5 tokens (so it must
    share none of it), one unrelated, and the prefix itself."""
    from onepass.engine.scheduler import Request

    shared = prompt(7, 17)
    prompts = [shared + prompt(50 + i, 2 + i) for i in range(4)] + [shared[:5] + prompt(60, 6), prompt(61, 9), shared]
    max_new = [5, 3, 6, 4, 5, 4, 6]
    return shared, prompts, max_new, [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill", ["token", "chunked"])
@pytest.mark.parametrize("writeback", [1, 2, 4])
def test_serving_pinned_prefix_matches_single_stream(ggufs, name, prefill, writeback):
    """A hybrid model serves a pinned prefix: its KV blocks are shared and its recurrent state, snapshotted once per
    write-back phase class, is copied into each slot whose request starts with it; those requests prefill only the
    rest, and every request (also one sharing part of the prefix, and one refilling a slot another used) gives its
    single-stream output. Three slots: with a write-back every 2 tokens two of them share a class, every 4 none."""
    cfg, w, _ = load(ggufs[name])
    model, ref = fused(cfg, w), build_model(cfg, w)
    shared, prompts, max_new, requests = _pinned_workload()
    want = {i: reference_generate(ref, hybrid(cfg, 1), [p], m, SamplingParams()).outputs[0]
            for i, (p, m) in enumerate(zip(prompts, max_new))}
    eng = _pinned_engine(model, 3, prefill, 8, writeback=writeback)
    assert eng.pin_prefix(shared) == 16
    res = eng.run(requests)
    assert {r.rid: r.output for r in res.finished} == want
    assert res.prefill_rows == sum(map(len, prompts)) - 5 * 16   # five requests start with the whole prefix
    # a pool too small for three at once: requests are preempted and readmitted, each time from the snapshot
    eng = _pinned_engine(model, 3, prefill, 8, writeback=writeback, blocks=10)
    eng.pin_prefix(shared)
    res = eng.run(_pinned_workload()[3])
    assert {r.rid: r.output for r in res.finished} == want
    assert sum(r.preemptions for r in res.finished) > 0


def test_refusals(ggufs):
    cfg, w, _ = load(ggufs["equal-heads"])
    model = fused(cfg, w)
    with pytest.raises(ConfigError, match="automatic prefix caching is not supported for the hybrid.*pinned or off"):
        check_hybrid_serving(cfg, prefix="auto")
    check_hybrid_serving(cfg, prefix="pinned")
    check_hybrid_serving(cfg, prefix="off")
    # the serving engine refuses them too, for a caller that builds it without the harness's checks
    from onepass.engine.block_manager import BlockManager
    from onepass.engine.scheduler import Scheduler
    from onepass.engine.runner import Runner

    def engine(bm, state_slots):
        kv = HybridCache(drop_recurrent_kv(PagedKVCache(cfg, 9, 16, 2, 64, torch.float32, "cpu"), cfg),
                         StatePool(cfg, state_slots, "cpu"))
        return Runner(model, kv, Scheduler(2, "continuous", "token", 512, bm, 64), SamplingParams(),
                             use_graphs=False)

    with pytest.raises(ConfigError, match="prefix=auto: automatic prefix caching is not supported"):
        engine(BlockManager(9, 16, prefix_caching=True), 3)
    with pytest.raises(ConfigError, match=r"needs BlockManager\(whole_pinned=True\)"):
        engine(BlockManager(9, 16), 4).pin_prefix(list(range(3, 40)))
    with pytest.raises(ConfigError, match="a state pool of 4 slots .*KV cache's 3 .* this one has 3"):
        engine(BlockManager(9, 16, whole_pinned=True), 3).pin_prefix(list(range(3, 40)))
    eng = engine(BlockManager(9, 16, whole_pinned=True), 4)
    assert eng.pin_prefix(list(range(3, 40))) == 32
    with pytest.raises(ConfigError, match="one pinned prefix"):
        eng.pin_prefix(list(range(3, 40)))
    with pytest.raises(ConfigError, match="HybridCache"):
        rows_logits(model, ContiguousKVCache(cfg, 2, 8, torch.float32, "cpu"), [5], [0], [0])
    with pytest.raises(ConfigError, match="runs of seq_len=2"):
        rows_logits(model, hybrid(cfg, 2), [5, 6, 7], [0, 1, 2], [0, 0, 0], seq_len=2)


def test_weight_bytes_and_fusion(ggufs):
    cfg, w, _ = load(ggufs["3x-value-heads"])
    model = fused(cfg, w)
    trunk = {n: t for n, t in w.items() if not n.startswith("blk.4.") and n != "token_embd.weight"}
    assert model.weight_bytes() == sum(t.numel() * t.element_size() for t in trunk.values())
    gdn = model.layers[0]["in_proj"]
    assert len(gdn.weights) == 1 and gdn.width == cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.gdn_v_heads


def test_bf16_state_close_to_fp32(ggufs):
    """The bf16 state option: the same greedy tokens as fp32 state on the tiny model over 16 tokens, and
    logits within 0.1 (the reference model's bf16 bound in test_qwen35)."""
    cfg, w, _ = load(ggufs["3x-value-heads"])
    model = fused(cfg, w)
    p = [prompt(15, 8)]
    hi = stepper(model, 1)[0](p, 16).outputs
    lo = stepper(model, 1, state_dtype=torch.bfloat16)[0](p, 16).outputs
    assert hi == lo
    a = rows_logits(model, hybrid(cfg, 1), p[0], list(range(8)), [0] * 8, seq_len=8)
    b = rows_logits(model, hybrid(cfg, 1, state_dtype=torch.bfloat16), p[0], list(range(8)), [0] * 8, seq_len=8)
    assert (a - b).abs().max().item() < 0.1


# ---------------------------------------------------------------------------------------------------
# CPU, Triton kernels under the interpreter (bf16)

needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET),
    reason="CPU without TRITON_INTERPRET=1: run by test_cpu_kernels_in_interpreter_subprocess in a child process")


@needs_kernel
@pytest.mark.parametrize("name", CONFIGS)
def test_triton_kernels_match_torch_kernels(ggufs, name):
    """bf16 logits of the Triton decoder are no further from the fp32 torch decoder than the bf16 torch
    decoder is (x BF16_SLACK): these random tiny models amplify any bf16 rounding difference (swapping
    any single bf16 kernel, existing ones included, moves logits by ~3% of their scale), so the bar is
    bf16's own error, measured in the same test."""
    dev = "cuda" if HAS_CUDA else "cpu"
    P = 6
    p = [prompt(16, P), prompt(17, P)]
    logits = {}
    for backend, dtype in (("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)):
        if backend == "triton" and dtype == torch.float32:
            continue
        cfg, w, _ = load(ggufs[name], dtype, dev)
        model = fused(cfg, w, backend)
        kv = hybrid(cfg, 3, dtype=dtype, device=dev)
        first = rows_logits(model, kv, sum(p, []), list(range(P)) * 2, [0] * P + [1] * P, seq_len=P)
        nxt = logits[("torch", torch.float32)][:2 * P].view(2, P, -1)[:, -1].argmax(-1) if logits else \
            first.view(2, P, -1)[:, -1].argmax(-1)
        step = rows_logits(model, kv, nxt.tolist(), [P, P], [0, 1])
        logits[(backend, dtype)] = torch.cat([first, step]).float()
    truth = logits[("torch", torch.float32)]
    bf16_err = (logits[("torch", torch.bfloat16)] - truth).abs().max().item()
    triton_err = (logits[("triton", torch.bfloat16)] - truth).abs().max().item()
    assert triton_err <= BF16_SLACK * bf16_err + 1e-3 * truth.abs().max().item(), (triton_err, bf16_err)


@needs_kernel
def test_triton_batch_streams_equal_single_stream(ggufs):
    dev = "cuda" if HAS_CUDA else "cpu"
    cfg, w, _ = load(ggufs["3x-value-heads"], torch.bfloat16, dev)
    model = fused(cfg, w, "triton")
    p = prompt(18, 5)
    runs = {B: stepper(model, B)[0]([p] * B, 4 if INTERPRET else 6).outputs for B in (1, 3)}
    assert verify_greedy(runs[3], runs[1][0]).ok


@needs_kernel
@pytest.mark.parametrize("writeback", [3] if INTERPRET else [1, 3])   # the interpreter: the harder one only
def test_triton_serving_chunked_prefill_matches_token_prefill(ggufs, writeback):
    """The Triton step (no graphs): chunked prefill's ragged runs and token prefill serve the same greedy outputs,
    the single-stream outputs of the same engine (static, batched prefill), with the serving pool's state written
    every token or every 3 (slots refilled mid-way at other phases)."""
    dev = "cuda" if HAS_CUDA else "cpu"
    cfg, w, _ = load(ggufs["3x-value-heads"], torch.bfloat16, dev)
    model = fused(cfg, w, "triton")
    # under the interpreter, shorter: still a prompt longer than the budget (continued in a later step's chunk) and a
    # third request refilling a slot mid-way
    served = [(41, 5, 3), (42, 10, 2), (43, 2, 3)] if INTERPRET else SERVE_PROMPTS[:3]
    prompts = [prompt(sd, n) for sd, n, _ in served]
    max_new = [m for _, _, m in served]
    want = {}
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        st, _ = stepper(model, 1)
        want[i] = st([p], m, prefill="batched").outputs[0]
    for pf in ("token", "chunked"):
        r = _serve(model, hybrid(cfg, 3, dtype=torch.bfloat16, device=dev, writeback=writeback), prompts, max_new, pf,
                   8)
        assert {q.rid: q.output for q in r.finished} == want, pf


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, "(fused qwen35 under the Triton interpreter)", only_skipped=True)


# ---------------------------------------------------------------------------------------------------
# GPU: Triton kernels, CUDA graphs


def gpu_run(path, B, p, new, graphs=True, prefill="batched", state_dtype=torch.float32, writeback=1):
    cfg, w, _ = load(path, torch.bfloat16, "cuda")
    st, _ = stepper(fused(cfg, w, "triton"), B, graphs=graphs, state_dtype=state_dtype, writeback=writeback)
    return st([p] * B, new, prefill=prefill).outputs


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_triton_matches_reference_model(ggufs, name):
    """Batched prefill + 8 decode steps (tokens from the fp32 reference): the bf16 Triton decoder's logits
    are no further from the fp32 reference model than the bf16 reference model's are (x BF16_SLACK)."""
    P, steps = 9, 8
    prompts = [prompt(19, P), prompt(20, P)]
    slots = torch.tensor([0, 1], device="cuda")
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg, w, _ = load(ggufs[name], dtype, "cuda")
        ref, rkv = build_model(cfg, w), hybrid(cfg, 2, dtype=dtype, device="cuda")
        out = [ref.forward(torch.tensor(prompts, device="cuda"), torch.arange(P, device="cuda").expand(2, P), slots,
                           rkv).float()]
        for s in range(steps):
            nxt = (refs[torch.float32][s] if refs else out[-1]).argmax(-1)
            out.append(ref.forward(nxt.view(2, 1), torch.full((2, 1), P + s, device="cuda"), slots, rkv).float())
        refs[dtype] = out
    cfg, w, _ = load(ggufs[name], torch.bfloat16, "cuda")
    model, kv = fused(cfg, w, "triton"), hybrid(cfg, 3, dtype=torch.bfloat16, device="cuda")
    got = [rows_logits(model, kv, sum(prompts, []), list(range(P)) * 2, [0] * P + [1] * P,
                       seq_len=P).view(2, P, -1)[:, -1]]
    for s in range(steps):
        got.append(rows_logits(model, kv, refs[torch.float32][s].argmax(-1).tolist(), [P + s] * 2, [0, 1]))
    truth = torch.stack(refs[torch.float32])
    bf16_err = (torch.stack(refs[torch.bfloat16]) - truth).abs().max().item()
    triton_err = (torch.stack(got) - truth).abs().max().item()
    assert triton_err <= BF16_SLACK * bf16_err + 1e-3 * truth.abs().max().item(), (triton_err, bf16_err)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_graphs_bit_exact_across_batch(ggufs, name):
    p = prompt(21, 11)
    runs = {B: gpu_run(ggufs[name], B, p, 24) for B in (1, 3, 8, 64)}
    for B, out in runs.items():
        assert verify_greedy(out, runs[1][0]).ok, B
    assert gpu_run(ggufs[name], 8, p, 24, graphs=False) == runs[8]  # graph replay == eager
    assert gpu_run(ggufs[name], 8, p, 24, prefill="token") == runs[8]  # token prefill == slot-major runs


@pytest.mark.gpu
def test_gpu_side_stream_gives_the_sequential_tokens(monkeypatch):
    """Packed q|k|v|z with the dense beta|alpha rows on the side stream (Projection.concurrent): the same greedy
    tokens as the two GEMMs in one stream, replayed in CUDA graphs and eagerly."""
    from onepass.engine.fused_qwen35 import Projection
    from onepass.harness.synth import LazyWeights

    cfg = ModelConfig(**{**_BASE, "dim": 256, "ffn_dim": 256, "name": "pk"}, full_attention_interval=4, gdn_k_heads=2,
                      gdn_v_heads=6, gdn_k_dim=16, gdn_v_dim=16)
    w = dict(LazyWeights(cfg, torch.bfloat16, "cuda", seed=4, packed_fmt="q4_0").items())
    p = [prompt(40 + i, 12) for i in range(4)]
    outs = {}
    for concurrent, graphs in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(Projection, "concurrent", concurrent)
        model = fused(cfg, w, "triton")
        assert model.layers[0]["in_proj"].side == [1]
        st, _ = stepper(model, 4, graphs=graphs)
        outs[concurrent, graphs] = st(p, 20).outputs
    assert outs[True, True] == outs[False, True] == outs[True, False]


@pytest.mark.gpu
def test_gpu_refill_inside_graphs(ggufs):
    cfg, w, _ = load(ggufs["3x-value-heads"], torch.bfloat16, "cuda")
    model = fused(cfg, w, "triton")
    a, b = [prompt(22, 10)] * 4, [prompt(23, 7)] * 4
    fresh = stepper(model, 4, graphs=True)[0](b, 12).outputs
    st, _ = stepper(model, 4, graphs=True)
    st(a, 30)
    assert st(b, 12).outputs == fresh
    assert st(b, 12, prefill="token").outputs == fresh


@pytest.mark.gpu
def test_gpu_paged_equals_contiguous(ggufs):
    cfg, w, _ = load(ggufs["equal-heads"], torch.bfloat16, "cuda")
    model = fused(cfg, w, "triton")
    seqs = [prompt(24, 40), prompt(25, 40)]
    cont, paged = hybrid(cfg, 2, ctx=48, dtype=torch.bfloat16, device="cuda"), \
        paged_hybrid(cfg, 2, 48, torch.bfloat16, "cuda")
    for p in range(40):
        toks = [seqs[0][p], seqs[1][p]]
        a = rows_logits(model, cont, toks, [p, p], [0, 1])
        b = rows_logits(model, paged, toks, [p, p], [0, 1], block_table=paged.kv.block_table)
        assert torch.equal(a, b), p


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_serving_chunked_prefill(ggufs, name):
    """The Triton step with CUDA graphs: chunked prefill (ragged runs) and token prefill serve every request the
    greedy output of a single stream of the same engine (static, batched prefill)."""
    cfg, w, _ = load(ggufs[name], torch.bfloat16, "cuda")
    model = fused(cfg, w, "triton")
    prompts = [prompt(sd, n) for sd, n, _ in SERVE_PROMPTS]
    max_new = [m for _, _, m in SERVE_PROMPTS]
    want = {}
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        st, _ = stepper(model, 1, graphs=True)
        want[i] = st([p], m, prefill="batched").outputs[0]
    for pf in ("token", "chunked"):
        kv = hybrid(cfg, 4, dtype=torch.bfloat16, device="cuda")
        r = _serve(model, kv, prompts, max_new, pf, 8, graphs=True)
        assert {q.rid: q.output for q in r.finished} == want, pf


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_write_back_gives_the_same_tokens(ggufs, name):
    """CUDA graphs, every B: the state written back every 4 tokens gives the greedy tokens of writing it every token,
    with batched and token prefill, fp32 and bf16 state, and after a refill of the same stepper."""
    p = prompt(27, 11)
    for state_dtype in (torch.float32, torch.bfloat16):
        every = {B: gpu_run(ggufs[name], B, p, 24, state_dtype=state_dtype) for B in (1, 8)}
        for B in (1, 8):
            assert gpu_run(ggufs[name], B, p, 24, state_dtype=state_dtype, writeback=4) == every[B], (state_dtype, B)
        assert gpu_run(ggufs[name], 8, p, 24, prefill="token", state_dtype=state_dtype, writeback=4) == every[8]
    cfg, w, _ = load(ggufs[name], torch.bfloat16, "cuda")
    st, _ = stepper(fused(cfg, w, "triton"), 4, graphs=True, writeback=3)
    first = st([prompt(28, 7)] * 4, 30).outputs
    again = st([p] * 4, 24).outputs
    assert again == gpu_run(ggufs[name], 4, p, 24), "a refilled stepper written back every 3 tokens"
    assert verify_greedy(first, first[0]).ok


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_serving_pinned_prefix(ggufs, name):
    """The Triton step with CUDA graphs serving a pinned prefix (its state snapshot copied into each slot between
    graph replays): every request the single stream's greedy output, token and chunked prefill, the state written
    back every token and every 4 (the snapshot then carries the update log too)."""
    cfg, w, _ = load(ggufs[name], torch.bfloat16, "cuda")
    model = fused(cfg, w, "triton")
    shared, prompts, max_new, _ = _pinned_workload()
    want = {i: stepper(model, 1, graphs=True)[0]([p], m, prefill="batched").outputs[0]
            for i, (p, m) in enumerate(zip(prompts, max_new))}
    for writeback in (1, 4):
        for pf in ("token", "chunked"):
            eng = _pinned_engine(model, 3, pf, 8, bs=16, graphs=True, writeback=writeback)
            assert eng.pin_prefix(shared) == 16
            res = eng.run(_pinned_workload()[3])
            assert {r.rid: r.output for r in res.finished} == want, (writeback, pf)


def test_copy_slot_copies_the_whole_recurrent_state(ggufs):
    """StatePool.copy_slot: state, conv ring, every update-log tensor and the token count of one slot, no other."""
    cfg, _, _ = load(ggufs["3x-value-heads"])
    pool = StatePool(cfg, 3, writeback=2)
    tensors = pool.ssm + pool.conv + [t for g in pool.log for t in g]
    for i, t in enumerate(tensors):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    pool.seen = [5, 9, 2]
    before = [t.clone() for t in tensors]
    pool.copy_slot(0, 2)
    for t, b in zip(tensors, before):
        assert torch.equal(t[2], b[0]) and torch.equal(t[:2], b[:2])
    assert pool.seen == [5, 9, 5]
    with pytest.raises(ConfigError, match="outside the state pool"):
        pool.copy_slot(1, 3)
    # a state written back every 4 tokens is laid out for its slot's phase: copies between classes are refused
    pool = StatePool(cfg, 6, writeback=4)
    pool.copy_slot(1, 5)
    with pytest.raises(ConfigError, match="differ modulo the write-back period 4"):
        pool.copy_slot(1, 2)
    assert snapshot_slots(5, 4, 4) == [8, 5, 6, 7] and snapshot_slots(4, 1, 3) == [4]
    assert snapshot_slots(3, 4, 2) == [4, 5]   # two scheduler slots: classes 0 and 1 only


@pytest.mark.gpu
def test_gpu_bf16_state_runs(ggufs):
    p = prompt(26, 9)
    out = gpu_run(ggufs["3x-value-heads"], 4, p, 16, state_dtype=torch.bfloat16)
    assert verify_greedy(out, out[0]).ok


# ---------------------------------------------------------------------------------------------------
# the harness: hybrid static job (torch backend on the CPU), in-memory synthetic weights, refusals, tables


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from onepass.harness.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _job(tmp_path, *extra):
    return _compose("model=tiny-qwen35", "engine=cpu", "batch.size=2", "workload.max_new_tokens=20", "progress=false",
                    f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.spool_dir={tmp_path}/spool",
                    "table=hybrid_27b", *extra)


@pytest.mark.parametrize("materialize", ["file", "memory"])
def test_harness_hybrid_job_with_bf16_state(tmp_path, monkeypatch, materialize):
    import json

    from onepass.harness import report
    from onepass.harness.job import run_job

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    cfg = _job(tmp_path, "kv_cache.state_dtype=bfloat16", f"model.synthetic.materialize={materialize}")
    assert run_job(cfg, tmp_path / "out") > 0
    m = json.loads((tmp_path / "out" / "run_record.json").read_text())["metrics"]
    assert m["verify_ok"] == 1
    state = 3 * (6 * 16 * 16 * 2 + (2 * 2 * 16 + 6 * 16) * 3 * 4)  # conf/model/tiny-qwen35: bf16 state + fp32 rings
    assert m["state_mb_per_slot"] == pytest.approx(state / 2**20)
    assert 0 <= m["bf16_state_greedy_agree"] <= 1 and m["bf16_state_logit_err"] < 0.1
    assert m["bf16_state_top1_agree"] >= 0.9
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    assert report.main(["hybrid_27b", "--uri", f"sqlite:///{tmp_path}/mlflow.db", "--out", str(tmp_path / "r")]) == 0
    table = (tmp_path / "r" / "hybrid_27b.md").read_text()
    assert "bfloat16" in table and "✓" in table


def test_harness_refuses_prefix_caching(tmp_path):
    from onepass.harness.build import build

    with pytest.raises(ConfigError, match="automatic prefix caching is not supported"):
        build(_job(tmp_path, "kv_cache.layout=paged", "kv_cache.prefix=auto", "scheduler=continuous"))
    build(_job(tmp_path, "kv_cache.layout=paged", "kv_cache.prefix=pinned", "scheduler=continuous"))   # a snapshot
    build(_job(tmp_path, "kv_cache.layout=paged", "scheduler=continuous_chunked"))   # chunked prefill: ragged runs


def test_harness_state_writeback_refusals(tmp_path):
    """A negative write-back period, or one > 1 asked of the torch reference (it writes the state every token), is
    refused before anything runs; the default (0) leaves the reference at 1."""
    from onepass.harness.build import build

    with pytest.raises(ConfigError, match="state_writeback=-1"):
        build(_job(tmp_path, "kv_cache.state_writeback=-1"))
    with pytest.raises(ConfigError, match="state_writeback=2 runs in the fused decoder"):
        build(_job(tmp_path, "kv_cache.state_writeback=2"))
    b = build(_job(tmp_path))
    assert b.writeback() == 1 and b.cache(2, 32).state.writeback == 1


def test_in_memory_weights_follow_the_loader_contract(ggufs):
    """LazyWeights: every name and shape of tensor_shapes(), the loader's value conventions, deterministic;
    with a packed format, the projections are PackedWeights that unpack to values of the intended spread."""
    from onepass.harness.synth import LazyWeights

    cfg = CONFIGS["3x-value-heads"]
    w = LazyWeights(cfg, torch.float32, "cpu", seed=3)
    assert set(w) == set(cfg.tensor_shapes()) and all(tuple(w[n].shape) == s for n, s in cfg.tensor_shapes().items())
    assert torch.equal(w["blk.0.attn_qkv.weight"], w["blk.0.attn_qkv.weight"])
    assert (w["blk.0.ssm_a"] < 0).all() and (w["blk.0.attn_norm.weight"] - 1).abs().max() < 1
    big = ModelConfig(**{**_BASE, "dim": 256, "ffn_dim": 256, "name": "pk"}, full_attention_interval=4, gdn_k_heads=2,
                      gdn_v_heads=6, gdn_k_dim=16, gdn_v_dim=16)
    from onepass.kernels.quant_pack import PackedWeight, unpack_int, unpack_ref

    for fmt in ("q4_0", "q4_1", "q4_k", "q8_0"):
        pw = LazyWeights(big, torch.bfloat16, "cpu", packed_fmt=fmt)["blk.0.ffn_up.weight"]
        assert isinstance(pw, PackedWeight) and pw.shape == (256, 256)
        vals = unpack_ref(pw)
        # std about fan_in ** -0.5, and centred: 65,536 values put the mean within 0.004 std of zero (1 sigma);
        # the uncentred Q4_0 codes (mean -0.5 d, 0.11 std) made every 27B prompt give one token
        assert 0.9 < vals.std().item() * 256 ** 0.5 < 1.1 and abs(vals.mean().item()) < 0.02 * vals.std().item(), fmt
        if fmt in ("q4_0", "q8_0"):   # every code but the unmirrored one (0 / -128) occurs, that one never
            q = unpack_int(pw)
            assert set(q.unique().tolist()) == (set(range(1, 16)) if fmt == "q4_0" else set(range(-127, 128))), fmt
    assert not isinstance(LazyWeights(big, torch.bfloat16, "cpu", packed_fmt="q4_0")["blk.0.ssm_beta.weight"],
                          PackedWeight)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_deep_synthetic_packed_model_answers_each_prompt_its_own_way(fmt):
    """The in-memory packed weights make a model whose greedy output depends on its prompt, so a run's verify over
    those outputs can fail. With Q4_0 codes 0..15 (mean -0.5 d) this 32-layer stack answered every prompt with one
    token repeated (as the 27B's 64 layers did on the H200): distinct prompts, then, gave identical outputs."""
    from onepass.harness.synth import LazyWeights

    cfg = ModelConfig(**{**_BASE, "dim": 256, "ffn_dim": 512, "n_layers": 32, "vocab_size": 2048, "name": "deep"},
                      full_attention_interval=4, gdn_k_heads=2, gdn_v_heads=6, gdn_k_dim=32, gdn_v_dim=32)
    model = fused(cfg, dict(LazyWeights(cfg, torch.float32, "cpu", seed=0, packed_fmt=fmt).items()))
    outs = [stepper(model, 1)[0]([prompt(100 + s, 8)], 8, prefill="batched").outputs[0]
            for s in range(4)]
    assert len({tuple(o) for o in outs}) == 4 and all(len(set(o)) > 2 for o in outs), outs


def test_report_tables_build_from_runs():
    import pandas as pd

    from onepass.harness.report import TABLES

    df = pd.DataFrame({"params.batch.size": ["1", "128"], "metrics.our_us": ["8.0", "230"],
                       "metrics.floor_us": ["1.5", "193"],
                       "metrics.floor_frac": ["0.19", "0.84"], "metrics.max_err": ["1e-6", "2e-6"],
                       "metrics.verify_ok": ["1", "1"]})
    md, _ = TABLES["gdn_step"](df)
    assert "| B |" in md.replace("|   B |", "| B |") and "—" in md  # no FLA column values: a dash


def test_packed_projections_match_their_dense_values():
    """Weights kept packed (engine.weights=packed: PackedWeights from the in-memory generator) through the
    torch backend give the logits of the same values dequantized: packed q|k|v|z fused by cat_rows, the
    dense beta|alpha rows beside them in the same output buffer."""
    from onepass.kernels.quant_pack import PackedWeight, unpack_ref
    from onepass.harness.synth import LazyWeights

    cfg = ModelConfig(**{**_BASE, "dim": 256, "ffn_dim": 256, "name": "pk"}, full_attention_interval=4, gdn_k_heads=2,
                      gdn_v_heads=6, gdn_k_dim=16, gdn_v_dim=16)
    lazy = LazyWeights(cfg, torch.float32, "cpu", seed=4, packed_fmt="q4_0")
    packed = dict(lazy.items())
    dense = {n: unpack_ref(w).float() if isinstance(w, PackedWeight) else w for n, w in packed.items()}
    a, b = fused(cfg, packed), fused(cfg, dense)
    proj = a.layers[0]["in_proj"]
    assert [type(w).__name__ for w in proj.weights] == ["PackedWeight", "Tensor"]  # [qkv|z] packed, [beta|alpha] dense
    assert (proj.main, proj.side) == (0, [1])       # on a GPU the dense rows run on the side stream
    assert b.layers[0]["in_proj"].side == []        # all dense: one fused GEMM, nothing beside it
    toks, pos = prompt(30, 6), list(range(6))
    la = rows_logits(a, hybrid(cfg, 1), toks, pos, [0] * 6, seq_len=6)
    lb = rows_logits(b, hybrid(cfg, 1), toks, pos, [0] * 6, seq_len=6)
    assert (la - lb).abs().max().item() <= LOGIT_ATOL * max(1.0, lb.abs().max().item())
    assert a.weight_bytes() < b.weight_bytes()


def test_ragged_runs_staged_per_step():
    """Step's runs for a step: one per slot's consecutive rows, one per padding row, empty runs to the bucket;
    a slot whose rows are split in two is refused (its two runs would race on its state)."""
    import numpy as np

    from onepass.engine.step import Step

    ro = np.zeros(9, dtype=np.int64)
    Step._stage_runs(np.array([3, 0, 0, 0, 4, 4]), 6, 8, ro)
    assert ro.tolist() == [0, 1, 4, 6, 7, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="consecutive"):
        Step._stage_runs(np.array([3, 0, 3]), 3, 4, np.zeros(5, dtype=np.int64))
