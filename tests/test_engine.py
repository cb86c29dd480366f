"""Tiny models: the reference model's per-slot KV and prefill modes; the engine's static batching (the fused step over
the torch kernels, through the runner) against the reference; sampling."""
import pytest
import torch

from onepass.kernels.errors import ConfigError
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams, filter_logits
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.models.generate import reference_generate
from onepass.engine.runner import run_static
from onepass.kernels.backend import get_step_kernels
from onepass.engine.verify import verify_greedy, verify_sampled

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_ggufs):
    cfg, weights, _ = load_gguf(tiny_ggufs[request.param], progress=False)
    return build_model(cfg, weights)


@pytest.fixture(scope="module")
def fused(model):
    return FusedDecoder(model.cfg, model.w, get_step_kernels("torch"), max_pos=128)


def static(fused, prompts, n, sampling=GREEDY, **kw):
    """The engine's static batch: len(prompts) slots + the scratch slot."""
    return run_static(fused, kv_for(fused, len(prompts) + 1, kw.pop("ctx", 64)), prompts, n, sampling, **kw)


def kv_for(model, slots, ctx=64):
    return ContiguousKVCache(model.cfg, slots, ctx, torch.float32, "cpu")


def prompt(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_slots_are_independent(model):
    """Slot 1's logits do not change when other slots hold different sequences."""
    a, b = prompt(7, 1), prompt(7, 2)
    kv = kv_for(model, 3)
    pos = torch.arange(7).expand(3, 7)
    together = model.forward(torch.tensor([a, b, a]), pos, torch.arange(3), kv)
    alone = model.forward(torch.tensor([b]), pos[:1], torch.tensor([0]), kv_for(model, 1))
    torch.testing.assert_close(together[1], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[0], together[2], rtol=0, atol=0)
    # writing slot 2 again must leave slots 0 and 1 untouched
    before = [t.clone() for t in kv.k]
    model.forward(torch.tensor([b]), pos[:1], torch.tensor([2]), kv)
    for layer, k in enumerate(kv.k):
        assert torch.equal(k[:2], before[layer][:2])
        assert not torch.equal(k[2], before[layer][2])


def test_slots_at_different_positions(model):
    """One step with each slot at its own position equals each slot decoded alone."""
    a, b = prompt(5, 3), prompt(9, 4)
    kv = kv_for(model, 2)
    model.forward(torch.tensor([a]), torch.arange(5).view(1, 5), torch.tensor([0]), kv)
    model.forward(torch.tensor([b]), torch.arange(9).view(1, 9), torch.tensor([1]), kv)
    step = model.forward(torch.tensor([[7], [8]]), torch.tensor([[5], [9]]), torch.tensor([0, 1]), kv)
    for s, (p, t) in enumerate([(a, 7), (b, 8)]):
        solo = kv_for(model, 1)
        ref = model.forward(torch.tensor([p + [t]]), torch.arange(len(p) + 1).view(1, -1), torch.tensor([0]), solo)
        torch.testing.assert_close(step[s], ref[0], rtol=1e-5, atol=1e-5)


def test_token_prefill_equals_batched_prefill(model):
    """The seed's token-by-token prefill and one batched forward leave the same KV and the same output.
    fp32 GEMMs over 1 row vs 7 rows may round differently, so KV is compared to 1e-5."""
    p = [prompt(7, 5)] * 2
    runs = {}
    for mode in ("token", "batched"):
        kv = kv_for(model, 2)
        runs[mode] = (reference_generate(model, kv, p, 12, GREEDY, prefill=mode), kv)
    (rt, kt), (rb, kb) = runs["token"], runs["batched"]
    assert rt.outputs == rb.outputs
    for a, b in zip(kt.k + kt.v, kb.k + kb.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", range(1, 9))
def test_static_greedy_verifies(model, fused, B):
    p = prompt(6, 6)
    ref = reference_generate(model, kv_for(model, 1), [p], 16, GREEDY)
    res = static(fused, [p] * B, 16)
    v = verify_greedy(res.outputs, ref.outputs[0])
    assert v.ok, v.line
    assert res.decode_tokens == B * 15 and len(res.step_s) == 15


def test_verify_greedy_detects_a_wrong_stream():
    v = verify_greedy([[1, 2, 3], [1, 2, 4]], [1, 2, 3])
    assert not v.ok and "first divergence at token 2" in v.line
    assert "degenerate" not in v.line and v.detail["reference_distinct_tokens"] == 3
    assert v.reason == "1 streams differ from the reference; first divergence at token 2"


def test_a_degenerate_reference_fails_the_verdict():
    # one token repeated agrees with any stream that repeats it, so agreeing with it proves nothing
    v = verify_greedy([[7, 7, 7], [7, 7, 7]], [7, 7, 7])
    assert not v.ok and v.line.endswith("false (degenerate reference: the reference is token 7 repeated, so "
                                        "agreement with it proves nothing)")
    assert "token 7 repeated" in v.reason and v.detail["reference_distinct_tokens"] == 1
    # streams that agree with a varied reference computed from non-finite logits prove nothing either
    v = verify_greedy([[1, 2, 3]], [1, 2, 3], logits_finite=False)
    assert not v.ok and v.reason == "the reference run produced non-finite logits"
    assert verify_greedy([[1, 2, 3]], [1, 2, 3]).ok and verify_greedy([[5]], [5]).ok


@pytest.mark.parametrize("run", ["reference", "engine"])
def test_temperature_streams_distinct_and_reproducible(model, fused, run):
    p = prompt(6, 7)
    s = SamplingParams(temperature=0.9, seed=3)
    go = (lambda s: reference_generate(model, kv_for(model, 8), [p] * 8, 16, s)) if run == "reference" else (
        lambda s: static(fused, [p] * 8, 16, s))
    r1, r2 = go(s), go(s)
    assert r1.outputs == r2.outputs
    assert verify_sampled(r1.outputs, 0.9).ok
    r3 = go(SamplingParams(temperature=0.9, seed=4))
    assert r3.outputs != r1.outputs


@pytest.mark.parametrize("prefill", ["token", "batched"])
def test_stop_token_ends_a_stream(model, fused, prefill):
    """Both slots stop at the stop token, which lands inside a lockstep run of steps; nothing after it is kept."""
    p = prompt(6, 8)
    free = reference_generate(model, kv_for(model, 2), [p] * 2, 10, GREEDY).outputs[0]
    stop = free[3]
    out = reference_generate(model, kv_for(model, 2), [p] * 2, 10, GREEDY, stop_ids=(stop,)).outputs
    cut = free.index(stop) + 1
    assert out == [free[:cut]] * 2
    assert static(fused, [p] * 2, 10, stop_ids=(stop,), prefill=prefill).outputs == [free[:cut]] * 2


def test_top_k_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    k2 = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]]
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    probs = logits.softmax(-1)[0]
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    assert torch.isfinite(p).tolist() == [[True, True, False, False, False]]


def test_prompt_longer_than_ctx_is_rejected(fused):
    with pytest.raises(ConfigError, match=r"kv_cache.ctx=16"):
        static(fused, [prompt(12, 9)], 8, ctx=16)


def test_zero_new_tokens_is_rejected(fused):
    with pytest.raises(ConfigError, match=r"max_new_tokens=0.*workload.max_new_tokens >= 1"):
        static(fused, [prompt(4, 9)], 0, ctx=16)


def test_ragged_prompts_rejected_in_static_mode(fused):
    with pytest.raises(ConfigError, match="equal length"):
        static(fused, [prompt(4, 1), prompt(5, 1)], 4)
