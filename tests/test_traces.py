"""Request traces (harness/traces.py): one seed gives one trace on any machine and in any process, a rate sweep replays
the same requests, the distributions have the medians and means they state, and bad settings are refused by name."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from onepass.harness.schema import LengthCfg, WorkloadCfg
from onepass.harness.traces import check_trace, make_trace
from onepass.harness.workload import FIRST_ID
from onepass.kernels.errors import ConfigError

VOCAB = 1000


def workload(**kw):
    lengths = {k: kw.pop(k) for k in ("prompt_len", "output_len") if k in kw}
    w = OmegaConf.structured(WorkloadCfg(name="t", prompt="", num_requests=kw.pop("num_requests", 64), **kw))
    for k, v in lengths.items():
        w[k] = OmegaConf.structured(LengthCfg(**v))
    return w


LOGNORMAL = dict(prompt_len=dict(dist="lognormal", median=256, sigma=0.5, low=16, high=1024),
                 output_len=dict(dist="lognormal", median=128, sigma=0.5, low=8, high=512))


def test_one_seed_one_trace_whatever_the_process_or_its_hash_seed():
    """The same seed gives the same requests and hash, here and in a fresh interpreter with another hash seed; another
    seed gives other arrivals, prompts and lengths."""
    w = workload(arrival="gamma", rate=8.0, burstiness=0.5, shared_prefix=0.25, seed=7, **LOGNORMAL)
    a, b = make_trace(w, VOCAB), make_trace(w, VOCAB)
    assert a == b and len(a.requests) == 64
    code = ("import sys, json; from omegaconf import OmegaConf; from onepass.harness.schema import WorkloadCfg; "
            "from onepass.harness.traces import make_trace; "
            "w = OmegaConf.merge(OmegaConf.structured(WorkloadCfg), json.loads(sys.argv[1])); "
            f"print(make_trace(w, {VOCAB}).digest)")
    # a fresh interpreter with a hash seed of its own (this one's is random)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(OmegaConf.to_container(w))], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == a.digest
    w.seed = 8
    c = make_trace(w, VOCAB)
    assert c.digest != a.digest and c.requests_digest != a.requests_digest
    assert [r.offset_s for r in c.requests] != [r.offset_s for r in a.requests]
    assert [r.prompt for r in c.requests] != [r.prompt for r in a.requests]
    assert [r.output_len for r in c.requests] != [r.output_len for r in a.requests]


def test_a_rate_sweep_replays_the_same_requests_faster():
    """At twice the rate every arrival comes at half the time, with the same prompts and lengths (one stream per
    kind of draw); the trace's hash tells the rates apart, its requests' hash does not; rate inf sends all at 0."""
    slow, fast, burst = (make_trace(workload(rate=r, seed=3, **LOGNORMAL), VOCAB) for r in (4.0, 8.0, math.inf))
    assert np.allclose([r.offset_s / 2 for r in slow.requests], [r.offset_s for r in fast.requests], rtol=1e-12)
    assert [r.prompt for r in slow.requests] == [r.prompt for r in fast.requests] == [r.prompt for r in burst.requests]
    assert slow.digest != fast.digest and slow.requests_digest == fast.requests_digest == burst.requests_digest
    assert {r.offset_s for r in burst.requests} == {0.0} and burst.span_s == 0.0
    assert slow.requests[0].offset_s == 0.0 and all(np.diff([r.offset_s for r in slow.requests]) >= 0)


def test_distributions_have_their_stated_medians_and_means():
    """Over 20,000 draws: log-normal lengths have their median within 2% (the median of its log is known to about
    0.4% at this count) and stay in their bounds; uniform lengths cover [low, high] with the middle as median;
    Poisson gaps have mean 1/rate and a coefficient of variation of 1; gamma gaps mean 1/rate and CV 1/sqrt(shape),
    both within 4%."""
    n = 20_000
    w = workload(num_requests=n, arrival="poisson", rate=50.0, seed=1,
                 prompt_len=dict(dist="uniform", low=10, high=30),
                 output_len=dict(dist="lognormal", median=256, sigma=0.5, low=16, high=1024))
    t = make_trace(w, VOCAB)
    prompts = np.array([len(r.prompt) for r in t.requests])
    outputs = np.array([r.output_len for r in t.requests])
    assert abs(np.median(outputs) / 256 - 1) < 0.02 and outputs.min() >= 16 and outputs.max() <= 1024
    assert prompts.min() == 10 and prompts.max() == 30 and np.median(prompts) == 20
    gaps = np.diff([r.offset_s for r in t.requests])
    assert abs(gaps.mean() * 50 - 1) < 0.04 and abs(gaps.std() / gaps.mean() - 1) < 0.04
    g = make_trace(workload(num_requests=n, arrival="gamma", rate=50.0, burstiness=0.25, seed=1), VOCAB)
    gaps = np.diff([r.offset_s for r in g.requests])
    assert abs(gaps.mean() * 50 - 1) < 0.04 and abs(gaps.std() / gaps.mean() / 2 - 1) < 0.04
    fixed = make_trace(workload(num_requests=50, prompt_len=dict(dist="fixed", median=7),
                                output_len=dict(dist="fixed", median=3)), VOCAB)
    assert {len(r.prompt) for r in fixed.requests} == {7} and {r.output_len for r in fixed.requests} == {3}
    assert all(FIRST_ID <= tok < VOCAB for r in t.requests for tok in r.prompt)


def test_shared_prefix_is_that_part_of_every_prompt():
    """shared_prefix=0.25: each prompt's first quarter (rounded down) is the start of one shared prefix; after it the
    prompts are their own."""
    t = make_trace(workload(shared_prefix=0.25, seed=5, **LOGNORMAL), VOCAB)
    longest = max(t.requests, key=lambda r: len(r.prompt))
    shared = longest.prompt[:int(0.25 * len(longest.prompt))]
    for r in t.requests:
        k = int(0.25 * len(r.prompt))
        assert r.prompt[:k] == shared[:k]
    a, b = t.requests[:2]
    ka, kb = int(0.25 * len(a.prompt)), int(0.25 * len(b.prompt))
    assert a.prompt[ka:ka + 8] != b.prompt[kb:kb + 8]
    none = make_trace(workload(seed=5, **LOGNORMAL), VOCAB)
    assert len({tuple(r.prompt[:4]) for r in none.requests}) == len(none.requests)


def test_requests_from_a_file(tmp_path):
    """A JSON-lines file gives arrival times (arrival=file), prompt ids or lengths and output lengths; what a line
    leaves out comes from the distributions. Text prompts need a tokenizer; an unknown key is refused by line."""
    path = tmp_path / "trace.jsonl"
    lines = [{"t": 0.5, "prompt_ids": [5, 6, 7], "output_len": 4}, {"t": 0.0, "prompt_len": 9},
             {"t": 2.0, "prompt_ids": [9] * 5, "output_len": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = workload(num_requests=0, arrival="file", trace_file=str(path), output_len=dict(dist="fixed", median=6))
    t = make_trace(w, VOCAB)
    assert [r.offset_s for r in t.requests] == [0.5, 0.0, 2.0]
    assert t.requests[0].prompt == [5, 6, 7] and len(t.requests[1].prompt) == 9
    assert [r.output_len for r in t.requests] == [4, 6, 2]
    w.num_requests = 4
    with pytest.raises(ConfigError, match="holds 3 requests"):
        make_trace(w, VOCAB)
    (tmp_path / "bad.jsonl").write_text('{"t": 0, "promt_len": 4}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl line 1 has the keys \['promt_len'\]"):
        make_trace(workload(num_requests=0, arrival="file", trace_file=str(tmp_path / "bad.jsonl")), VOCAB)
    (tmp_path / "p.txt").write_text("Tell me a story.\nAnd another.\n")
    with pytest.raises(ConfigError, match="no tokenizer"):
        make_trace(workload(num_requests=0, trace_file=str(tmp_path / "p.txt")), VOCAB)


@pytest.mark.parametrize("kw, msg", [
    (dict(prompt_len=dict(dist="zipf", median=4)), r"prompt_len.dist='zipf'; choose one of fixed, uniform, lognormal"),
    (dict(rate=-2.0), r"workload.rate=-2.0: requests a second, above 0"),
    (dict(rate=0.0), r"workload.rate=0.0"),
    (dict(arrival="all", rate=4.0), r"arrival=all sends every request at once.*arrival=poisson"),
    (dict(arrival="weibull"), r"workload.arrival='weibull'"),
    (dict(arrival="gamma", rate=2.0, burstiness=0.0), r"workload.burstiness=0.0"),
    (dict(shared_prefix=1.0), r"workload.shared_prefix=1.0"),
    (dict(output_len=dict(dist="lognormal", median=500, sigma=0.5, low=8, high=100)), r"low <= median <= high"),
    (dict(output_len=dict(dist="uniform", low=4, high=0)), r"1 <= low <= high"),
    (dict(prompt_len=dict(dist="fixed", median=60), output_len=dict(dist="fixed", median=10)),
     r"69 KV positions, beyond kv_cache.ctx=64: raise kv_cache.ctx to 69"),
    (dict(num_requests=0), r"num_requests=0: a trace needs at least one request"),
    (dict(arrival="file"), r"arrival=file takes each request's time from workload.trace_file"),
    (dict(trace_file="/nonexistent/trace.jsonl"), r"trace_file=/nonexistent/trace.jsonl does not exist")])
def test_bad_trace_settings_are_refused_by_name(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        check_trace(workload(**kw), 64)
