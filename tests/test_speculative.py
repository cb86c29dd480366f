"""Speculative decoding on tiny models (CPU, torch kernels): drafts from prompt lookup or a script of the target's
own future tokens, checked k + 1 rows a slot in one step. Whatever the drafts, greedy or sampled, every request's
output must be token for token the output without speculation."""
import random

import pytest
import torch

from onepass.engine.block_manager import BlockManager
from onepass.engine.drafts import PromptLookup, ScriptedDrafts
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.runner import Runner, run_static
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.kernels.backend import get_step_kernels
from onepass.kernels.errors import ConfigError

CTX = 96


def brute_lookup(toks, k, max_n=3, min_n=1):
    """The definition prompt lookup must meet: the latest earlier start of the last n tokens, longest n first."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if toks[s:s + n] == toks[L - n:]:
                return toks[s + n:s + n + k]
    return []


def test_prompt_lookup_matches_its_definition_as_tokens_arrive():
    rng = random.Random(3)
    for trial in range(40):
        look = PromptLookup(max_n=3)
        req = Request(trial, [rng.randrange(6) for _ in range(rng.randrange(1, 12))], 64)
        for _ in range(30):   # tokens arrive one or a few at a time, as accepted runs do
            k = rng.randrange(1, 6)
            assert look(req, k) == brute_lookup(req.prompt + req.output, k)
            req.output += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    look = PromptLookup(max_n=3)
    req = Request(0, [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2], 16)
    assert look(req, 2) == [3, 7]                       # "1 2" last followed by "3 7" (not the first "3 9")
    assert look(Request(1, [4, 5, 6], 8), 3) == []     # nothing repeats
    with pytest.raises(ConfigError, match="ngram"):
        PromptLookup(max_n=0)


def test_scripted_drafts_are_right_at_the_stated_rate():
    future = list(range(10, 2010))
    req = Request(3, [1, 2], 2000)
    assert ScriptedDrafts({3: future}, 1.0, 4096)(req, 4) == future[:4]
    assert all(a != b for a, b in zip(ScriptedDrafts({3: future}, 0.0, 4096)(req, 4), future))
    drafts = ScriptedDrafts({3: future}, 0.7, 4096, seed=5)
    right = sum(drafts(Request(3, [1], 2000, output=future[:j]), 1) == [future[j]] for j in range(1500))
    assert abs(right / 1500 - 0.7) < 0.05
    assert drafts(Request(3, [1], 2000, output=future[:7]), 3) == drafts(Request(3, [1], 2000, output=future[:7]), 3)
    with pytest.raises(ConfigError, match="acceptance"):
        ScriptedDrafts({}, 1.5, 10)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def fused(request, tiny_ggufs):
    cfg, w, _ = load_gguf(tiny_ggufs[request.param], progress=False)
    return FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=CTX + 1)


def repetitive_prompts(n, seed):
    """Prompts that repeat themselves, so prompt lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 5))]
        out.append((motif * 4)[:rng.randrange(5, 14)])
    return out


def drafts_of(kind, futures, vocab):
    return {"ngram": lambda: PromptLookup(3), "wrong": lambda: ScriptedDrafts(futures, 0.0, vocab),
            "right": lambda: ScriptedDrafts(futures, 1.0, vocab),
            "mixed": lambda: ScriptedDrafts(futures, 0.5, vocab, seed=1)}[kind]()


def serve(fused, prompts, max_new, sampling, drafts=None, k=0, slots=3, mode="continuous", prefill="token",
          layout="contiguous", blocks=80, stop_ids=()):
    cfg = fused.cfg
    bm = None
    if layout == "paged":
        bm = BlockManager(blocks, 4, prefix_caching=True)
        kv = PagedKVCache(cfg, blocks, 4, slots, CTX, torch.float32, "cpu")
    else:
        kv = ContiguousKVCache(cfg, slots + 1, CTX, torch.float32, "cpu")
    sched = Scheduler(slots, mode, prefill, 32, bm, CTX, stop_ids, drafts=drafts, spec_k=k)
    res = Runner(fused, kv, sched, sampling).run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))])
    assert not res.rejected
    return {r.rid: r.output for r in res.finished}, res


@pytest.mark.parametrize("kind", ["ngram", "wrong", "right", "mixed"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_batch_with_drafts_equals_without(fused, kind, temperature):
    prompts = repetitive_prompts(1, 7) * 4            # static batching: one prompt length
    sampling = SamplingParams(temperature=temperature, seed=11)
    plain = run_static(fused, ContiguousKVCache(fused.cfg, 5, CTX, torch.float32, "cpu"), prompts, 20, sampling)
    futures = dict(enumerate(plain.outputs))
    for k in (1, 3):
        spec = run_static(fused, ContiguousKVCache(fused.cfg, 5, CTX, torch.float32, "cpu"), prompts, 20, sampling,
                          drafts=drafts_of(kind, futures, fused.cfg.vocab_size), spec_k=k)
        assert spec.outputs == plain.outputs, (kind, k)
        assert spec.decode_tokens == plain.decode_tokens and len(spec.step_s) <= len(plain.step_s)
        if kind == "right":       # every draft kept: k + 1 tokens a step
            assert len(spec.step_s) <= -(-19 // (k + 1)) + 1


@pytest.mark.parametrize("kind", ["ngram", "wrong", "right", "mixed"])
@pytest.mark.parametrize("layout,prefill", [("contiguous", "token"), ("paged", "token"), ("paged", "chunked")])
def test_served_queue_with_drafts_equals_without(fused, kind, layout, prefill):
    prompts = repetitive_prompts(7, 2)
    max_new = [random.Random(i).randrange(2, 16) for i in range(len(prompts))]
    plain, _ = serve(fused, prompts, max_new, SamplingParams(), layout=layout, prefill=prefill)
    drafts = drafts_of(kind, plain, fused.cfg.vocab_size)
    spec, res = serve(fused, prompts, max_new, SamplingParams(), drafts, 3, layout=layout, prefill=prefill)
    assert spec == plain
    assert res.drafted > 0 and 0 <= res.accepted <= res.drafted
    if kind == "wrong":
        assert res.accepted == 0
    if kind == "right":
        assert res.accepted == res.drafted


def test_stop_token_inside_an_accepted_run(fused):
    """A stop token among the kept drafts ends the request there, as without speculation."""
    prompts = repetitive_prompts(3, 4)
    plain, _ = serve(fused, prompts, [14] * 3, SamplingParams())
    stop = plain[1][5]
    want, _ = serve(fused, prompts, [14] * 3, SamplingParams(), stop_ids=(stop,))
    got, res = serve(fused, prompts, [14] * 3, SamplingParams(), ScriptedDrafts(plain, 1.0, 256), 4,
                     stop_ids=(stop,))
    assert got == want and got[1][-1] == stop and len(got[1]) <= 6


def test_preemption_with_drafts(fused):
    """A pool too small for every slot at once: requests are preempted and recomputed; drafts change nothing."""
    prompts = repetitive_prompts(6, 9)
    max_new = [18] * 6
    plain, _ = serve(fused, prompts, max_new, SamplingParams(), layout="paged", blocks=14)
    spec, res = serve(fused, prompts, max_new, SamplingParams(), PromptLookup(3), 3, layout="paged", blocks=14)
    assert spec == plain


def test_sampled_tokens_have_the_target_distribution(fused):
    """Chi-square over 300 requests (each its own seed): the second token, the first one a draft can decide, with
    drafts against without. They must agree token for token (the same numbers are drawn for the same token); the
    test also states the distributional claim the acceptance rule is for: p < 0.001 fails."""
    from scipy.stats import chi2_contingency

    n = 300
    p = repetitive_prompts(1, 5)[0]
    sampling = SamplingParams(temperature=1.0, seed=3)
    plain, _ = serve(fused, [p] * n, [3] * n, sampling, slots=8)
    spec, res = serve(fused, [p] * n, [3] * n, sampling, ScriptedDrafts(plain, 0.5, fused.cfg.vocab_size), 2,
                      slots=8)
    assert spec == plain and res.accepted > 0
    second = {label: [out[i][1] for i in range(n)] for label, out in (("plain", plain), ("spec", spec))}
    values = sorted(set(second["plain"]) | set(second["spec"]))
    assert len(values) > 3       # the test has something to compare
    table = [[second[label].count(v) for v in values] for label in ("plain", "spec")]
    assert chi2_contingency(table).pvalue > 1e-3


def test_bad_speculation_settings_are_refused(fused, tiny_ggufs):
    with pytest.raises(ConfigError, match="spec_k"):
        Scheduler(2, drafts=PromptLookup(), spec_k=0)
    with pytest.raises(ConfigError, match="draft source"):
        Scheduler(2, spec_k=2)
    with pytest.raises(ConfigError, match="spec_k=600"):
        Scheduler(2, drafts=PromptLookup(), spec_k=600, ctx=512)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_graphed_drafts_are_bit_exact(tiny_ggufs, arch):
    """Triton kernels with CUDA graphs: a slot's k + 1 rows in one step give exactly the tokens of the run without
    drafts at B = 1, 8 and 32 (static), and in a continuous paged queue with chunked prefill; sampled too."""
    cfg, w, _ = load_gguf(tiny_ggufs[arch], dtype=torch.bfloat16, device="cuda", progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels("triton"), max_pos=CTX + 1)
    for B in (1, 8, 32):
        prompts = repetitive_prompts(1, B) * B
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=B)):
            kv = lambda: ContiguousKVCache(cfg, B + 1, CTX, torch.bfloat16, "cuda")   # noqa: E731
            plain = run_static(model, kv(), prompts, 24, sampling)
            for drafts, k in ((ScriptedDrafts(dict(enumerate(plain.outputs)), 0.6, cfg.vocab_size), 3),
                              (PromptLookup(3), 4)):
                spec = run_static(model, kv(), prompts, 24, sampling, drafts=drafts, spec_k=k)
                assert spec.outputs == plain.outputs, (B, sampling, k)
    prompts = repetitive_prompts(12, 1)
    max_new = [random.Random(i).randrange(2, 20) for i in range(12)]
    got = {}
    for k in (0, 3):
        bm = BlockManager(64, 16, prefix_caching=True)
        kv = PagedKVCache(cfg, 64, 16, 4, CTX, torch.bfloat16, "cuda")
        sched = Scheduler(4, "continuous", "chunked", 32, bm, CTX, drafts=PromptLookup(3) if k else None, spec_k=k)
        res = Runner(model, kv, sched, SamplingParams()).run([Request(i, p, n) for i, (p, n) in
                                                              enumerate(zip(prompts, max_new))])
        got[k] = {r.rid: r.output for r in res.finished}
    assert got[3] == got[0]
