"""On-device argmax and temperature / top-k / top-p sampling (kernels/sampling.py) against the torch
references, plus statistical checks of the sampled distribution.

Where the kernels run: as in tests/test_kernels_elementwise.py. CUDA available: everything on the
GPU. CPU only: the kernel tests run in-process under TRITON_INTERPRET=1 when it is already set,
otherwise `test_cpu_kernels_in_interpreter_subprocess` reruns this file in a child pytest with the
variable set (Triton picks interpreter vs compiler when the kernels are decorated, i.e. at import,
which another test module may already have done in this process). The pure-torch tests (Philox
known answers, the reference's distribution, the reference vs engine/sampler.py) run everywhere.
On CPU the chunk size is lowered (MAX_CHUNK = 64) so tiny vocabularies still span several chunks.

What is compared, and how exactly:
* uniforms: kernel == torch Philox mirror, bitwise (integer arithmetic + an exact conversion);
* argmax: bitwise (ties -> lowest index);
* keep thresholds: bitwise, except a top-p boundary whose cumulative mass is within 1e-5 of top_p
  (5e-5 at full vocabularies; the kernel sums in fp32, the reference in fp64: such a row may fall
  either way; it is then checked to be such a row, and its token is not compared);
* tokens: equal, or a near tie of the race: the kernel's token survives the filter and its reference
  score is within 1e-5 (relative) of the best (the kernel's log/exp are not torch's bit for bit);
* batch invariance (a row alone == that row in a batch): tokens and thresholds bitwise;
* distribution: chi-square of the counts against softmax(logits / T) restricted to the kept set,
  failing above the Wilson-Hilferty critical value at alpha = 1e-6 (so a correct sampler fails about
  once in a million runs); tokens outside the kept set must never appear.

Inputs are fresh random every run (os.urandom; KERNEL_TEST_SEED=<n> replays) and the seed is printed
in every failure message.
"""
from __future__ import annotations

import math

import pytest
import torch

import onepass.kernels.sampling as KS
from onepass.engine.sampler import SamplingParams, filter_logits
from onepass.kernels.sampling import (argmax_ref, argmax_triton, keep_threshold_ref, make_workspace, philox4x32_ref,
                              philox_uniform_ref, sample_ref, sample_triton, uniform_triton)
from tests.interpreter import run_in_interpreter
from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, SEED, _gen, _msg, needs_kernel


@pytest.fixture
def small_chunks(monkeypatch):
    """Several chunks per row at tiny vocabularies (CPU); the real chunking on the GPU."""
    if DEV.type == "cpu":
        monkeypatch.setattr(KS, "MAX_CHUNK", 64)


def _logits(g, R, V, dtype, scale=3.0):
    """Gaussian logits with a few planted spikes; bf16 rounding makes ties common."""
    x = torch.randn(R, V, generator=g) * scale
    spikes = torch.randint(0, V, (R, 3), generator=g)
    x.scatter_(1, spikes, x.gather(1, spikes) + 4.0)
    return x.to(dtype).to(DEV)


def _params(g, R, V, greedy_rows=1):
    """A mix per row: greedy, temperature only, top-k only, top-p only, both, and edge values."""
    T = (torch.rand(R, generator=g) * 1.5 + 0.3)
    k = torch.randint(1, max(2, V // 4), (R,), generator=g)
    p = torch.rand(R, generator=g) * 0.9 + 0.05
    kinds = torch.arange(R) % 5
    k = torch.where((kinds == 1) | (kinds == 3), torch.zeros_like(k), k)      # 1: T only, 3: top-p only
    p = torch.where((kinds == 1) | (kinds == 2), torch.ones_like(p), p)      # 2: top-k only, 4: both
    edge = [(1, 1, 0.5), (2, 0, 1.0), (3, V, 1.0), (4, V - 1, 0.999), (5, 0, 0.0), (6, 3, 1.0)]  # (row, k, p)
    for i, kk, pp in edge:
        if i < R:
            k[i], p[i] = kk, pp
    T[:greedy_rows] = 0.0
    seeds = torch.randint(-2 ** 62, 2 ** 62, (R,), generator=g)
    return T.to(DEV), k.to(DEV), p.to(DEV), seeds.to(DEV)


def _mass_at(s_row: torch.Tensor, k: int, t: float) -> float:
    """Reference kept mass fraction of {s >= t} within the top-k set (fp64)."""
    V = s_row.numel()
    s64 = s_row.double()
    t_k = s_row.topk(k).values[-1].item() if 0 < k < V else float("-inf")
    e = torch.exp(s64 - s64.max()) * (s_row >= t_k)
    return (e * (s_row >= t)).sum().item() / e.sum().item()


def _check_against_reference(logits, T, k, p, seeds, step, tokens, thresh, what):
    """Thresholds bitwise (or a genuinely ambiguous top-p boundary); tokens equal or a near tie."""
    ref_tok, ref_thr = sample_ref(logits, T, k, p, seeds, step, return_threshold=True)
    x = logits.float()
    R, V = x.shape
    greedy = T <= 0
    s = x / torch.where(greedy, torch.ones_like(T), T).view(R, 1)
    score = s + -torch.log(-torch.log(philox_uniform_ref(seeds, step, V).to(x.device)))
    thr_k, thr_r, ambiguous = thresh.cpu(), ref_thr.cpu(), []
    for r in range(R):
        a, b = thr_k[r].item(), thr_r[r].item()
        if a == b:
            continue
        pr, kr = p[r].item(), int(k[r])
        assert pr < 1 and not greedy[r], _msg(f"{what}: row {r} threshold {a!r} != reference {b!r} (k={kr}, no top-p)")
        frac = _mass_at(s[r].cpu(), kr, max(a, b))
        tol = 1e-5 if V <= 4096 else 5e-5
        assert abs(frac - pr) < tol, _msg(f"{what}: row {r} threshold {a!r} != reference {b!r} "
                                          f"(mass there {frac:.9f} vs top_p {pr:.9f})")
        ambiguous.append(r)
    for r in range(R):
        if r in ambiguous:
            continue
        tk, tr = int(tokens[r]), int(ref_tok[r])
        if tk == tr:
            continue
        assert not greedy[r], _msg(f"{what}: greedy row {r}: token {tk} != {tr}")
        kept = bool(s[r, tk] >= ref_thr[r])
        gap = (score[r, tr] - score[r, tk]).item()
        assert kept and gap <= 1e-5 * max(1.0, abs(score[r, tr].item())), _msg(
            f"{what}: row {r} token {tk} != reference {tr} (kept {kept}, score gap {gap:.3g})")
    return ambiguous


def _chi2_critical(df: int, z: float = 4.753) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.753 is the normal quantile of 1 - 1e-6."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _check_distribution(tokens: torch.Tensor, logits_row: torch.Tensor, T: float, k: int, p: float, what: str):
    V = logits_row.numel()
    s = logits_row.float().cpu() / T
    thr = keep_threshold_ref(s.view(1, V), torch.tensor([k]), torch.tensor([p]))[0]
    keep = s >= thr
    probs = torch.softmax(s.double().masked_fill(~keep, float("-inf")), dim=0)
    counts = torch.bincount(tokens.cpu(), minlength=V).double()
    n = counts.sum().item()
    assert counts[~keep].sum() == 0, _msg(f"{what}: sampled tokens outside the kept set: "
                                          f"{(~keep & (counts > 0)).nonzero().flatten().tolist()}")
    exp = probs * n
    big = keep & (exp >= 5)  # merge the small bins (chi-square needs expected counts >= 5)
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    small = keep & ~big
    if small.any():
        obs_b.append(counts[small].sum().item())
        exp_b.append(exp[small].sum().item())
    if len(exp_b) < 2:
        return
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    crit = _chi2_critical(len(exp_b) - 1)
    assert chi2 < crit, _msg(f"{what}: chi-square {chi2:.1f} >= critical {crit:.1f} (df {len(exp_b) - 1}, n {int(n)})")


# ------------------------------------------------------------------------------------------------
# pure torch (everywhere)

def test_philox_known_answers():
    """The torch mirror is Philox4x32-10: Random123's known-answer vectors (key = seed lo, hi words)."""
    t = lambda v: torch.tensor([v])  # noqa: E731
    cases = [
        ((0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((-1, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x299F31D0A4093822, 0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for (seed, c0, c1, c2, c3), want in cases:
        got = tuple(int(w) for w in philox4x32_ref(t(seed), t(c0), t(c1), t(c2), t(c3)))
        assert got == want, f"{[hex(v) for v in got]} != {[hex(v) for v in want]}"


def test_reference_threshold_matches_engine_sampler():
    """Without ties, the kept set is exactly engine/sampler.py's filter_logits (the CPU sampler's spec)."""
    g = _gen(1)
    V = 200
    for trial in range(20):
        x = torch.randn(1, V, generator=g, dtype=torch.float64).float() * 2  # continuous: no ties
        T = float(torch.rand(1, generator=g)) + 0.2
        k = int(torch.randint(0, V + 3, (1,), generator=g)) if trial % 3 else 0
        p = float(torch.rand(1, generator=g)) if trial % 2 else 1.0
        want = filter_logits(x, SamplingParams(temperature=T, top_k=k, top_p=p)) > float("-inf")
        s = x / torch.tensor([T])
        thr = keep_threshold_ref(s, torch.tensor([k]), torch.tensor([p]))
        got = s >= thr.view(1, 1)
        if not torch.equal(got, want):  # only a top-p boundary within fp32 rounding of p may differ
            a = max(float(thr), float(x[want].min() / T)) if want.any() else float(thr)
            assert abs(_mass_at(s[0], k, a) - p) < 1e-5, _msg(f"trial {trial}: kept sets differ (T={T}, k={k}, p={p})")


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.6), (2.0, 3, 0.99)])
def test_reference_distribution(T, k, p):
    """The race with these uniforms samples softmax(logits / T) restricted to the kept set (200k draws:
    one seed, step = 0..N-1 per row)."""
    g = _gen(2)
    V, N = 12, 200_000
    row = torch.randn(V, generator=g) * 1.5
    logits = row.view(1, V).expand(N, V)
    tok = sample_ref(logits, torch.full((N,), T), torch.full((N,), k), torch.full((N,), p),
                     torch.full((N,), int(torch.randint(0, 2 ** 62, (1,), generator=g))), torch.arange(N))
    _check_distribution(tok, row, T, k, p, f"reference T={T} k={k} p={p}")


# ------------------------------------------------------------------------------------------------
# kernels, tiny shapes (GPU, or the CPU interpreter)

@needs_kernel
def test_uniforms_match_torch_mirror():
    g = _gen(10)
    V = 37
    seeds = torch.tensor([0, -1, 2 ** 40 + 3, -(2 ** 62), int(torch.randint(0, 2 ** 62, (1,), generator=g))]).to(DEV)
    for step in (torch.tensor(7), torch.tensor([2 ** 33 + 5]), torch.tensor([0, 1, -1, 2 ** 32, 123456789])):
        step = step.to(DEV)
        u = uniform_triton(seeds, step, V)
        want = philox_uniform_ref(seeds, step, V)
        assert torch.equal(u, want), _msg(f"uniforms differ at step {step.tolist()}")
        assert bool((u > 0).all() and (u < 1).all())
    u0 = uniform_triton(seeds, torch.tensor(7, device=DEV), V)
    u1 = uniform_triton(seeds, torch.tensor(8, device=DEV), V)
    assert not bool((u0 == u1).any()), "consecutive steps must draw fresh numbers"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax(dtype, small_chunks):
    g = _gen(20)
    R, V = 8, 700
    x = _logits(g, R, V, dtype)
    # ties: row 1's max copied to a later chunk and an earlier one; row 2 all equal; row 3 -inf except one
    m = x[1].max()
    x[1, 650] = m
    x[1, 70] = m
    x[2] = 1.5
    x[3] = float("-inf")
    x[3, 333] = 0.0
    x[4, :] = float("-inf")
    # NaN ranks as -inf: a row of NaN gives id 0, a NaN beside finite values is passed over (never an id past V)
    x[6] = float("nan")
    x[7, ::3] = float("nan")
    want = argmax_ref(x)
    assert torch.equal(want[:6], x[:6].float().argmax(dim=-1)), "reference vs torch.argmax"
    assert want[6] == 0 and want[7] == x[7].float().nan_to_num(nan=float("-inf")).argmax()
    out = torch.empty(R, dtype=torch.int64, device=DEV)
    assert argmax_triton(x, out=out) is out
    assert torch.equal(out, want), _msg(f"argmax {out.tolist()} != {want.tolist()}")
    for r in range(R):
        assert torch.equal(argmax_triton(x[r: r + 1]), want[r: r + 1]), _msg(f"row {r} alone")
    wide = _logits(g, R, V + 9, dtype)[:, :V]  # row stride != V
    assert torch.equal(argmax_triton(wide), argmax_ref(wide)), _msg("strided rows")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_reference(dtype, small_chunks):
    g = _gen(30)
    R, V = 10, 400
    logits = _logits(g, R, V, dtype)
    T, k, p, seeds = _params(g, R, V)
    step = torch.tensor(int(torch.randint(0, 2 ** 31, (1,), generator=g)), device=DEV)
    ws = make_workspace(R, V, DEV)
    out = torch.empty(R, dtype=torch.int64, device=DEV)
    assert sample_triton(logits, T, k, p, seeds, step, out=out, workspace=ws) is out
    amb = _check_against_reference(logits, T, k, p, seeds, step, out, ws.thresh[:R], f"{dtype}")
    assert len(amb) <= 2, _msg(f"too many ambiguous top-p boundaries: {amb}")
    assert torch.equal(out[:1], argmax_ref(logits[:1])), _msg("greedy row")


@needs_kernel
def test_sample_batch_invariance(small_chunks):
    """Each row alone (R = 1) and in a reordered batch: same tokens and thresholds, bitwise."""
    g = _gen(40)
    R, V = 5, 300
    logits = _logits(g, R, V, torch.bfloat16)
    T, k, p, seeds = _params(g, R, V, greedy_rows=0)
    step = torch.tensor(3, device=DEV)
    ws = make_workspace(R, V, DEV)
    tok = sample_triton(logits, T, k, p, seeds, step, workspace=ws).clone()
    thr = ws.thresh.clone()
    ws1 = make_workspace(1, V, DEV)
    for r in range(R):
        sl = slice(r, r + 1)
        t1 = sample_triton(logits[sl], T[sl], k[sl], p[sl], seeds[sl], step, workspace=ws1)
        assert torch.equal(t1, tok[sl]) and torch.equal(ws1.thresh, thr[sl]), _msg(f"row {r} alone")
    perm = torch.randperm(R, generator=g).to(DEV)
    tp = sample_triton(logits[perm], T[perm], k[perm], p[perm], seeds[perm], step)
    assert torch.equal(tp, tok[perm]), _msg("permuted batch")


@needs_kernel
def test_step_and_seed_semantics(small_chunks):
    """(seed, step) fixes the draw: a scalar step == the same value per row; another step or seed draws
    anew; rows with the same seed and step but different logits use the same uniforms."""
    g = _gen(50)
    R, V = 4, 200
    logits = _logits(g, R, V, torch.float32, scale=0.5)   # flat: the draw is mostly noise
    T = torch.full((R,), 1.0, device=DEV)
    k = torch.zeros(R, dtype=torch.int64, device=DEV)
    p = torch.ones(R, device=DEV)
    seeds = torch.full((R,), 1234, dtype=torch.int64, device=DEV)
    a = sample_triton(logits, T, k, p, seeds, torch.tensor(9, device=DEV)).clone()
    b = sample_triton(logits, T, k, p, seeds, torch.full((R,), 9, device=DEV)).clone()
    assert torch.equal(a, b), _msg("scalar step vs per-row step")
    same = logits[:1].expand(R, V).contiguous()
    draws = torch.stack([sample_triton(same, T, k, p, seeds, torch.tensor(s, device=DEV)).clone() for s in range(6)])
    assert bool((draws == draws[:, :1]).all()), _msg("same logits, seed and step must give the same token")
    assert len(set(draws[:, 0].tolist())) > 1, _msg("six steps all drew the same token from a flat distribution")
    _check_against_reference(logits, T, k, p, seeds, torch.tensor(9, device=DEV), a, torch.full((R,), float("-inf")),
                             "temperature only")


@needs_kernel
@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_kernel_distribution(T, k, p, small_chunks):
    """The kernel's draws (N rows of one logit row, step = 0..N-1) follow the restricted softmax."""
    g = _gen(60)
    V = 8
    N = 3000 if DEV.type == "cuda" else (600 if k == 0 else 100)   # the interpreter is slow
    row = torch.randn(V, generator=g) * 1.2
    logits = row.view(1, V).expand(N, V).contiguous().to(DEV)
    seeds = torch.full((N,), int(torch.randint(0, 2 ** 62, (1,), generator=g)), device=DEV)
    tok = sample_triton(logits, torch.full((N,), T, device=DEV), torch.full((N,), k, device=DEV),
                        torch.full((N,), p, device=DEV), seeds, torch.arange(N, device=DEV))
    assert torch.equal(tok.cpu(), sample_ref(logits.cpu(), torch.full((N,), T), torch.full((N,), k),
                                             torch.full((N,), p), seeds.cpu(), torch.arange(N))), \
        _msg("kernel draws != reference draws")
    _check_distribution(tok, row, T, k, p, f"kernel T={T} k={k} p={p}")


@needs_kernel
def test_argument_checks():
    x = torch.zeros(3, 10, device=DEV)
    v = torch.zeros(3, device=DEV)
    with pytest.raises(ValueError):
        sample_triton(x, v, v.long(), v, v.long(), torch.zeros(2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError):
        sample_triton(x, v[:2], v.long(), v, v.long(), torch.tensor(0, device=DEV))
    with pytest.raises(ValueError):
        argmax_triton(x, out=torch.empty(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError):
        argmax_triton(x, workspace=make_workspace(2, 10, DEV))


# ------------------------------------------------------------------------------------------------
# CPU: run the kernel tests above in the Triton interpreter, in a child process

@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in this process")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), KERNEL_TEST_SEED=str(SEED))


# ------------------------------------------------------------------------------------------------
# GPU: full vocabularies, R in {1, 128, 512}, CUDA graphs

GPU_VOCABS = [128256, 151936]
GPU_ROWS = [1, 128, 512]


@pytest.mark.gpu
@pytest.mark.parametrize("V", GPU_VOCABS)
@pytest.mark.parametrize("R", GPU_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_argmax(V, R, dtype):
    g = _gen(100 + R)
    x = _logits(g, R, V, dtype)
    x[0, V - 1] = x[0].max()  # a tie across the first and last chunk
    x[0, 5] = x[0].max()
    want = argmax_ref(x)
    assert torch.equal(argmax_triton(x), want), _msg("argmax")
    assert torch.equal(want, x.float().argmax(-1)), "reference vs torch.argmax"
    assert torch.equal(argmax_triton(x[-1:]), want[-1:]), _msg("last row alone")


@pytest.mark.gpu
@pytest.mark.parametrize("V", GPU_VOCABS)
@pytest.mark.parametrize("R", GPU_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sample_matches_reference(V, R, dtype):
    g = _gen(200 + R)
    logits = _logits(g, R, V, dtype, scale=2.5)
    T, k, p, seeds = _params(g, R, V, greedy_rows=min(R - 1, 2) if R > 1 else 0)
    if R == 1:  # the hardest single row: top-k and top-p both on
        T[0], k[0], p[0] = 0.8, 50, 0.9
    step = torch.tensor(int(torch.randint(0, 2 ** 31, (1,), generator=g)), device=DEV)
    ws = make_workspace(R, V, DEV)
    tok = sample_triton(logits, T, k, p, seeds, step, workspace=ws)
    # every ambiguous row was checked to sit within 5e-5 of its top_p boundary; at full vocabularies the
    # steps of the cumulative mass are small, so such rows are not rare and their number is not bounded
    _check_against_reference(logits, T, k, p, seeds, step, tok, ws.thresh[:R], f"V={V} R={R} {dtype}")
    ws1 = make_workspace(1, V, DEV)
    t1 = sample_triton(logits[-1:], T[-1:], k[-1:], p[-1:], seeds[-1:], step, workspace=ws1)
    assert torch.equal(t1, tok[-1:]) and torch.equal(ws1.thresh, ws.thresh[R - 1: R]), _msg("last row alone")


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.8), (0.6, 20, 0.95)])
def test_gpu_kernel_distribution(T, k, p):
    g = _gen(300)
    V, N = 64, 200_000
    row = torch.randn(V, generator=g) * 1.5
    logits = row.view(1, V).expand(N, V).contiguous().to(DEV)
    seeds = torch.full((N,), int(torch.randint(0, 2 ** 62, (1,), generator=g)), device=DEV)
    tok = sample_triton(logits, torch.full((N,), T, device=DEV), torch.full((N,), k, device=DEV),
                        torch.full((N,), p, device=DEV), seeds, torch.arange(N, device=DEV))
    _check_distribution(tok, row, T, k, p, f"gpu kernel T={T} k={k} p={p}")


@pytest.mark.gpu
@pytest.mark.parametrize("V", GPU_VOCABS)
def test_gpu_cuda_graph_replay(V):
    """sample_triton + argmax_triton captured once; the graph also increments `step` on device. Each
    replay equals eager calls at that step, and in-place parameter changes take effect."""
    R = 128
    g = _gen(400)
    logits = _logits(g, R, V, torch.bfloat16)
    T, k, p, seeds = _params(g, R, V)
    step = torch.zeros((), dtype=torch.int64, device=DEV)
    ws = make_workspace(R, V, DEV)
    ws_eager = make_workspace(R, V, DEV)
    tok = torch.empty(R, dtype=torch.int64, device=DEV)
    greedy = torch.empty(R, dtype=torch.int64, device=DEV)

    def body():
        sample_triton(logits, T, k, p, seeds, step, out=tok, workspace=ws)
        argmax_triton(logits, out=greedy, workspace=ws)
        step.add_(1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up (compiles)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    step.zero_()
    seen = set()
    for it in range(4):
        if it == 2:  # new logits and settings, in place
            logits.copy_(_logits(g, R, V, torch.bfloat16))
            T.mul_(0.5)
            k.copy_(torch.randint(0, 40, (R,), generator=g).to(DEV))
        want_step = step.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert int(step) == int(want_step) + 1
        want = sample_triton(logits, T, k, p, seeds, want_step, workspace=ws_eager)
        assert torch.equal(tok, want), _msg(f"replay {it}: sampled tokens differ from the eager call")
        assert torch.equal(greedy, argmax_ref(logits)), _msg(f"replay {it}: argmax")
        seen.add(tuple(tok.tolist()))
    assert len(seen) == 4, _msg("replays at different steps drew identical batches")
