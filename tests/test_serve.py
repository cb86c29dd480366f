"""The serving loop on tiny models (CPU, torch kernels): every scheduling, KV layout and prefix mode
must produce, for every request, exactly the single-stream greedy output of its prompt."""
import random

import pytest
import torch

from onepass.engine.block_manager import BlockManager
from onepass.kernels.errors import ConfigError
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.engine.runner import Runner
from onepass.engine.models.generate import reference_generate
from onepass.kernels.backend import get_step_kernels

CTX, BS = 64, 4
# a 13-token shared prefix: three full blocks of 4 (12 rows pad to a 16-row bucket when pinned) + one token
SHARED = list(range(7, 20))


@pytest.fixture(scope="module")
def setup(tiny_ggufs):
    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    fused = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1)
    ref_model = build_model(cfg, w)
    rng = random.Random(0)
    prompts = [SHARED + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 8))] for _ in range(6)]
    prompts += [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    max_new = [rng.randrange(2, 12) for _ in prompts]
    refs = {}
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        kv = ContiguousKVCache(cfg, 1, CTX, torch.float32, "cpu")
        refs[i] = reference_generate(ref_model, kv, [p], n, SamplingParams()).outputs[0]
    return cfg, fused, prompts, max_new, refs


def serve(setup, slots=4, mode="continuous", prefill="token", layout="contiguous", blocks=64, prefix="off",
          budget=16, on_device=True, burst=0):
    cfg, fused, prompts, max_new, _ = setup
    bm = None
    if layout == "paged":
        bm = BlockManager(blocks, BS, prefix_caching=prefix == "auto")
        kv = PagedKVCache(cfg, blocks, BS, slots, CTX, torch.float32, "cpu")
    else:
        kv = ContiguousKVCache(cfg, slots + 1, CTX, torch.float32, "cpu")
    sched = Scheduler(slots, mode, prefill, budget, bm, CTX, prefix_burst=burst)
    eng = Runner(fused, kv, sched, SamplingParams(), on_device)
    if prefix == "pinned":
        eng.pin_prefix(SHARED + [0])
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    return eng.run(reqs), bm


def outputs(res):
    return {r.rid: r.output for r in res.finished}


@pytest.mark.parametrize("mode", ["static", "continuous"])
@pytest.mark.parametrize("prefill", ["token", "chunked"])
def test_every_schedule_reproduces_single_stream(setup, mode, prefill):
    res, _ = serve(setup, mode=mode, prefill=prefill)
    assert outputs(res) == setup[4]
    assert not res.rejected


def test_continuous_takes_fewer_steps_than_static_waves(setup):
    static, _ = serve(setup, mode="static")
    cont, _ = serve(setup, mode="continuous")
    assert cont.steps < static.steps
    assert cont.active_slot_steps / cont.steps > static.active_slot_steps / static.steps


@pytest.mark.parametrize("prefix", ["off", "auto", "pinned"])
def test_paged_matches_contiguous_and_prefix_saves_prefill(setup, prefix):
    base, _ = serve(setup, mode="continuous")
    res, bm = serve(setup, layout="paged", prefix=prefix)
    assert outputs(res) == setup[4]
    bm.check_invariants()
    assert bm.num_used == (len(SHARED) // BS if prefix == "pinned" else 0)  # every request's blocks came back
    if prefix == "off":
        assert res.prefill_rows == base.prefill_rows
    else:
        assert res.prefill_rows < base.prefill_rows


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_shared_prefix_burst_feeds_a_queued_prefix_once(setup, mode):
    """Token prefill + automatic prefix caching: the shared prompt prefix of queued requests is fed once as
    one chunk, the others find it cached; same outputs, fewer prompt rows and steps than without."""
    plain, _ = serve(setup, mode=mode, layout="paged", prefix="auto")
    res, bm = serve(setup, mode=mode, layout="paged", prefix="auto", burst=12)
    assert outputs(res) == setup[4]
    assert res.prefill_rows < plain.prefill_rows and res.steps < plain.steps
    assert bm.num_used == 0
    bm.check_invariants()


def test_prefix_burst_is_only_for_token_prefill_with_automatic_caching():
    bm = BlockManager(16, BS, prefix_caching=True)
    assert Scheduler(2, prefill="token", block_manager=bm, ctx=CTX, prefix_burst=10).max_burst == 8  # whole blocks
    assert Scheduler(2, prefill="chunked", token_budget=16, block_manager=bm, ctx=CTX, prefix_burst=10).max_burst == 0
    assert Scheduler(2, prefill="token", block_manager=BlockManager(16, BS), ctx=CTX, prefix_burst=10).max_burst == 0


def test_pinned_prefix_is_not_touched_by_rows_that_pad_a_step(setup):
    """10 slots: steps pad to 16 rows, so the 12 pinned prefix positions are filled in one padded step;
    the pad rows must write the scratch block, not the first pinned one."""
    res, bm = serve(setup, slots=10, layout="paged", prefix="pinned")
    assert outputs(res) == setup[4]


def test_small_pool_waits_preempts_and_stays_correct(setup):
    res, bm = serve(setup, layout="paged", blocks=9)  # 8 usable blocks of 4 positions for 4 slots
    assert outputs(res) == setup[4]
    assert bm.peak_used <= 8
    assert sum(r.preemptions for r in res.finished) > 0  # growth found the pool empty: recomputed, same output
    bm.check_invariants()


def test_request_that_can_never_fit_is_rejected_with_block_count(setup):
    cfg, fused, *_ = setup
    bm = BlockManager(4, BS)
    kv = PagedKVCache(cfg, 4, BS, 2, CTX, torch.float32, "cpu")
    eng = Runner(fused, kv, Scheduler(2, block_manager=bm, ctx=CTX), SamplingParams())
    res = eng.run([Request(0, list(range(3, 20)), 4), Request(1, [5, 6], 3)])
    assert [r.rid for r in res.finished] == [1]
    (req, why), = res.rejected
    assert req.rid == 0 and "needs 5 KV blocks" in why and "pool has 3" in why


def test_host_sampling_matches_device_sampling_and_moves_more_bytes(setup):
    dev, _ = serve(setup)
    host, _ = serve(setup, on_device=False)
    assert outputs(dev) == outputs(host)
    assert host.d2h_bytes > 100 * dev.d2h_bytes


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("prefill", ["token", "chunked"])
def test_stop_token_ends_a_request_even_one_step_ahead(setup, on_device, prefill):
    """A stop token is seen a step late when the loop runs ahead: the extra row is dropped, the output
    ends at the stop token, and the freed slot and blocks serve the next requests correctly."""
    cfg, fused, prompts, max_new, refs = setup
    stop = refs[0][1]  # the second token of request 0: it must stop there
    bm = BlockManager(64, BS, prefix_caching=True)
    kv = PagedKVCache(cfg, 64, BS, 3, CTX, torch.float32, "cpu")
    eng = Runner(fused, kv, Scheduler(3, "continuous", prefill, 16, bm, CTX, stop_ids=(stop,)),
                        SamplingParams(), on_device)
    res = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))])
    for r in res.finished:
        ref = refs[r.rid]
        want = ref[:ref.index(stop) + 1] if stop in ref else ref
        assert r.output == want, r.rid
    assert len(res.finished) == len(prompts)
    bm.check_invariants()
    assert bm.num_used == 0


def test_host_sampling_with_temperature_is_refused(setup):
    cfg, fused, *_ = setup
    kv = ContiguousKVCache(cfg, 3, CTX, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="on_device"):
        Runner(fused, kv, Scheduler(2, ctx=CTX), SamplingParams(temperature=0.7), sample_on_device=False)


def test_bad_scheduler_config_is_named():
    with pytest.raises(ConfigError, match="scheduler.mode"):
        Scheduler(4, mode="fifo")
    with pytest.raises(ConfigError, match="token_budget"):
        Scheduler(8, prefill="chunked", token_budget=4)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,prefill", [("contiguous", "token"), ("paged", "token"), ("paged", "chunked")])
def test_gpu_row_graphs_reproduce_single_stream(tiny_ggufs, layout, prefill):
    """Triton kernels + CUDA graphs per row bucket, one step ahead of the host: same tokens as the
    single-stream Triton run."""
    from onepass.engine.runner import run_static

    cfg, w, _ = load_gguf(tiny_ggufs["qwen3"], dtype=torch.bfloat16, device="cuda", progress=False)
    fused = FusedDecoder(cfg, w, get_step_kernels("triton"), max_pos=CTX + 1)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 14))] for _ in range(10)]
    max_new = [rng.randrange(2, 12) for _ in prompts]
    refs = {}
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        kv = ContiguousKVCache(cfg, 2, CTX, torch.bfloat16, "cuda")
        refs[i] = run_static(fused, kv, [p], n, prefill="token").outputs[0]
    bm = BlockManager(20, 16, prefix_caching=True) if layout == "paged" else None  # the Triton kernels page by >= 16
    kv = (PagedKVCache(cfg, 20, 16, 4, CTX, torch.bfloat16, "cuda") if bm
          else ContiguousKVCache(cfg, 5, CTX, torch.bfloat16, "cuda"))
    eng = Runner(fused, kv, Scheduler(4, "continuous", prefill, 16, bm, CTX), SamplingParams())
    assert eng.step.layer_graphs and eng.step.head_graphs
    res = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))])
    assert outputs(res) == refs
    assert len(res.gpu_ms) == res.steps and min(res.gpu_ms) > 0
