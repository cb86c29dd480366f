"""Open-loop serving (engine/arrivals.py): requests that enter the running loop at their own times, from a trace or
from other threads, get exactly the single-stream greedy output of their prompts; a client that goes away gives its
slot and blocks back; every output token is time-stamped after its request arrived."""
import random
import threading
import time

import pytest
import torch

from onepass.engine.arrivals import QueueArrivals, TraceArrivals
from onepass.engine.block_manager import BlockManager
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import PagedKVCache
from onepass.engine.models import build_model
from onepass.engine.models.generate import reference_generate
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.runner import Runner
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.kernels.backend import get_step_kernels

CTX, BS, SLOTS, BLOCKS = 64, 4, 3, 40


@pytest.fixture(scope="module")
def tiny(tiny_ggufs):
    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    fused = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1)
    ref_model = build_model(cfg, w)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 12))] for _ in range(8)]
    max_new = [rng.randrange(3, 10) for _ in prompts]
    refs = []
    for p, n in zip(prompts, max_new):
        kv = ContiguousKVCache(cfg, 1, CTX, torch.float32, "cpu")
        refs.append(reference_generate(ref_model, kv, [p], n, SamplingParams()).outputs[0])
    return cfg, fused, prompts, max_new, refs


def runner(tiny):
    cfg, fused = tiny[:2]
    bm = BlockManager(BLOCKS, BS, prefix_caching=True)
    kv = PagedKVCache(cfg, BLOCKS, BS, SLOTS, CTX, torch.float32, "cpu")
    return Runner(fused, kv, Scheduler(SLOTS, "continuous", "token", 16, bm, CTX), SamplingParams()), bm


def test_trace_arrivals_get_the_greedy_outputs_and_stamped_tokens(tiny):
    _, _, prompts, max_new, refs = tiny
    eng, bm = runner(tiny)
    # the first three at once, the rest spread out: some arrive while others decode, one after the loop went idle
    offsets = [0.0, 0.0, 0.0, 0.01, 0.02, 0.05, 0.3, 0.31]
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    res = eng.run([], arrivals=TraceArrivals(list(zip(offsets, reqs))))
    assert sorted(r.rid for r in res.finished) == list(range(len(reqs)))
    t0 = reqs[0].arrival_s
    for r, off, ref in zip(reqs, offsets, refs):
        assert r.output == ref
        assert r.arrival_s == pytest.approx(t0 + off)
        assert len(r.token_s) == len(r.output)
        assert r.arrival_s < r.token_s[0] and r.token_s == sorted(r.token_s)
    # the last two arrived after the loop had nothing to do: it slept until they were due, not past them by much
    assert reqs[6].token_s[0] - reqs[6].arrival_s < 2.0   # generous: a loaded 2-core CI machine
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free == BLOCKS - 1


def test_a_request_too_long_is_rejected_and_handed_back(tiny):
    eng, _ = runner(tiny)
    seen = []

    class Source(TraceArrivals):
        def emit(self, grown, finished):
            seen.extend(finished)

    long = Request(0, list(range(3, 3 + CTX)), 4)
    ok = Request(1, [5, 6, 7], 3)
    res = eng.run([], arrivals=Source([(0.0, long), (0.0, ok)]))
    assert long.rejection.startswith("request 0 rejected: needs") and long in seen and ok in seen
    assert [r.rid for r in res.finished] == [1]


def test_queue_arrivals_from_another_thread_and_a_client_that_goes_away(tiny):
    _, _, prompts, max_new, refs = tiny
    eng, bm = runner(tiny)
    finished = threading.Event()
    got: dict[int, list[int]] = {}

    class Source(QueueArrivals):
        def emit(self, grown, done):
            for r in grown:
                got.setdefault(r.rid, [])
                got[r.rid] = list(r.output)
            if any(r.rid == 7 for r in done):
                finished.set()

    src = Source()
    long_one = Request(99, prompts[0], 40)   # cancelled after its first tokens
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]

    def client():
        src.submit(long_one)
        for r in reqs:
            src.submit(r)
            time.sleep(0.005)
        while len(got.get(99, [])) < 3:
            time.sleep(0.001)
        src.cancel(long_one)
        finished.wait(30)
        src.close()

    th = threading.Thread(target=client)
    th.start()
    res = eng.run([], arrivals=src)
    th.join()
    assert long_one.cancelled and 3 <= len(long_one.output) < 40
    assert long_one.output == refs[0][:len(long_one.output)] or long_one.output[:len(refs[0])] == refs[0]
    for r, ref in zip(reqs, refs):
        assert r.output == ref and got[r.rid] == ref
    assert {r.rid for r in res.finished} == {99, *range(len(reqs))}
    # the cancelled request holds no slot and no block
    assert not eng.sched.running and len(eng.sched.free_slots) == SLOTS
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free == BLOCKS - 1


def test_cancel_of_a_waiting_request_finishes_it_without_a_slot(tiny):
    sched = Scheduler(1, "continuous", "token", 16, None, CTX)
    a, b = Request(0, [4, 5], 3), Request(1, [6, 7], 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.cancel(b)     # still waiting: never admitted
    assert b.cancelled and b in sched.finished and not b.output and b not in sched.waiting
    sched.finish_step(plan, [9])
    assert a.slot == 0 and not a.retired
