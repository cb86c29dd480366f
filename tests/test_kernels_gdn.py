"""GDN decode kernels (kernels/gdn.py) against their torch references (which call Qwen35Model's own
causal_conv / delta_rule) and against the model's multi-token recurrence.

Where the kernels run (same scheme as tests/test_kernels_decode_attention.py):
* CUDA available: every test runs on the GPU.
* CPU only with TRITON_INTERPRET=1 already set: the kernel tests run in-process.
* CPU only otherwise: they are skipped in-process and `test_cpu_kernels_in_interpreter_subprocess`
  reruns this file in a child pytest with TRITON_INTERPRET=1 and fails with its output on any failure.

Inputs are fresh random each run: the seed comes from os.urandom (set GDN_SEED to replay one) and is
printed in every failure message.
"""
from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from onepass.kernels.gdn_ref import causal_conv, delta_rule, l2norm
from onepass.kernels.gdn import (UpdateLog, conv_ring_update_ref, conv_ring_update_triton, gdn_step_ref,
                                 gdn_step_triton, materialize_state)
from tests.interpreter import run_in_interpreter

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
SEED = int(os.environ.get("GDN_SEED") or int.from_bytes(os.urandom(4), "little"))

needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET),
    reason="CPU without TRITON_INTERPRET=1: run by test_cpu_kernels_in_interpreter_subprocess in a child process")

TOL = 1e-5
N_SLOTS = 5
SLOTS = [3, 0, 4]  # R = 3 rows at distinct slots of a 5-slot pool (1 and 2 must stay untouched)
CONV_K = 4


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1000 + salt)


def _msg(what: str) -> str:
    return f"{what} (seed {SEED}; rerun with GDN_SEED={SEED})"


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _close(out, ref, what, tol=TOL):
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), _msg(f"{what}: max abs err {err:.3g} > {tol}")


def _bitwise(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def _slots(ids):
    return torch.tensor(ids, dtype=torch.int32, device=DEV)


def _untouched(new, old, used, what):
    for s in range(old.shape[0]):
        if s not in used:
            assert _bitwise(new[s], old[s]), _msg(f"{what}: slot {s} (no row) was modified")


def _gdn_case(salt, R, hk, hv, dk, dv, n_slots=N_SLOTS, state_dtype=torch.float32):
    g = _gen(salt)
    return dict(
        q=_randn(g, R, hk, dk), k=_randn(g, R, hk, dk), v=_randn(g, R, hv, dv),
        a=_randn(g, R, hv), b=_randn(g, R, hv),
        A=-torch.exp(_randn(g, hv) * 0.5), dt_bias=_randn(g, hv) * 0.5,
        state=(_randn(g, n_slots, hv, dk, dv) * 0.3).to(state_dtype))


def _gdn_args(c, state):
    return (c["q"], c["k"], c["v"], c["a"], c["b"], c["A"], c["dt_bias"], state)


GDN_SHAPES = [(2, 2, 16, 16), (2, 6, 16, 16), (2, 2, 32, 32), (2, 6, 32, 16)]  # (Hk, Hv, Dk, Dv)


# ------------------------------------------------------------------------------------------------
# conv ring

@needs_kernel
@pytest.mark.parametrize("C", [160, 100])  # 2*2*16 + 6*16, and a non-power-of-two channel count
def test_conv_ring_matches_ref(C):
    g = _gen(1)
    x = _randn(g, len(SLOTS), C)
    w = _randn(g, C, CONV_K) * 0.5
    ring = _randn(g, N_SLOTS, C, CONV_K - 1)
    ring0 = ring.clone()
    slots = _slots(SLOTS)
    ring_ref = ring.clone()
    ref = conv_ring_update_ref(x, ring_ref, w, slots)
    out = conv_ring_update_triton(x, ring, w, slots, block_c=64)
    _close(out, ref, f"conv out C={C}")
    assert _bitwise(ring, ring_ref), _msg("conv ring after the step differs from the reference")
    for r, s in enumerate(SLOTS):  # the shift itself: oldest dropped, x appended
        assert torch.equal(ring[s, :, :-1], ring0[s, :, 1:]) and torch.equal(ring[s, :, -1], x[r]), _msg("ring shift")
    _untouched(ring, ring0, SLOTS, "conv ring")


# ------------------------------------------------------------------------------------------------
# one delta-rule step

@needs_kernel
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "hk%d-hv%d-dk%d-dv%d" % s)
def test_gdn_step_matches_ref(shape):
    hk, hv, dk, dv = shape
    c = _gdn_case(2, len(SLOTS), hk, hv, dk, dv)
    slots = _slots(SLOTS)
    st0 = c["state"].clone()
    st_ref = c["state"].clone()
    ref = gdn_step_ref(*_gdn_args(c, st_ref), slots)
    out = gdn_step_triton(*_gdn_args(c, c["state"]), slots, block_v=8)
    _close(out, ref, f"gdn o {shape}")
    _close(c["state"], st_ref, f"gdn state {shape}")
    _untouched(c["state"], st0, SLOTS, "gdn state")


@needs_kernel
def test_gdn_padding_rows_skipped():
    hk, hv, dk, dv = 2, 6, 16, 16
    c = _gdn_case(3, 3, hk, hv, dk, dv)
    slots = _slots([2, -1, 4])
    st0 = c["state"].clone()
    st_ref = c["state"].clone()
    ref = gdn_step_ref(*_gdn_args(c, st_ref), slots)
    out = torch.full((3, hv, dv), float("nan"), device=DEV)
    gdn_step_triton(*_gdn_args(c, c["state"]), slots, out=out)
    _close(out[[0, 2]], ref[[0, 2]], "gdn o with a padding row")
    assert torch.isnan(out[1]).all(), _msg("padding row's output was written")
    _close(c["state"], st_ref, "gdn state with a padding row")
    _untouched(c["state"], st0, [2, 4], "gdn state (padding row)")
    ring = _randn(_gen(4), N_SLOTS, 40, CONV_K - 1)
    ring0 = ring.clone()
    conv_ring_update_triton(_randn(_gen(5), 3, 40), ring, _randn(_gen(6), 40, CONV_K), slots)
    _untouched(ring, ring0, [2, 4], "conv ring (padding row)")


@needs_kernel
def test_gdn_batch_invariance():
    """A row alone gives bitwise the output and state it gets inside the batch."""
    hk, hv, dk, dv = 2, 6, 32, 32
    c = _gdn_case(7, len(SLOTS), hk, hv, dk, dv)
    st_batch = c["state"].clone()
    full = gdn_step_triton(*_gdn_args(c, st_batch), _slots(SLOTS))
    for r, s in enumerate(SLOTS):
        st = c["state"].clone()
        one = {n: (t[r:r + 1].clone() if n in ("q", "k", "v", "a", "b") else t) for n, t in c.items()}
        o = gdn_step_triton(*_gdn_args(one, st), _slots([s]))
        assert _bitwise(o[0], full[r]), _msg(f"row {r} alone: output differs from the batch")
        assert _bitwise(st[s], st_batch[s]), _msg(f"row {r} alone: state differs from the batch")


# ------------------------------------------------------------------------------------------------
# several tokens: kernels step by step == the model's own multi-token recurrence

def _model_tokens(qkv, a_in, b_in, w, A, dt, ring, pool, slots, hk, hv, dk, dv):
    """Qwen35Model.gated_delta_net's recurrence part over T tokens at once (its own functions)."""
    B, T, _ = qkv.shape
    beta = torch.sigmoid(b_in.float())
    g = A.float() * F.softplus(a_in.float() + dt.float())
    c = causal_conv(qkv, w, ring, slots)
    q, k, v = c.split((hk * dk, hk * dk, hv * dv), dim=-1)
    q = l2norm(q.reshape(B, T, hk, dk)) * dk ** -0.5
    k = l2norm(k.reshape(B, T, hk, dk))
    rep = hv // hk
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return delta_rule(q, k, v.reshape(B, T, hv, dv), g, beta, pool, slots)


@needs_kernel
@pytest.mark.parametrize("hv", [2, 6])
def test_steps_match_model_recurrence(hv):
    hk, dk, dv, T = 2, 16, 16, 4
    R = len(SLOTS)
    C = 2 * hk * dk + hv * dv
    g = _gen(8 + hv)
    qkv = _randn(g, R, T, C)
    a_in, b_in = _randn(g, R, T, hv), _randn(g, R, T, hv)
    w = _randn(g, C, CONV_K) * 0.5
    A, dt = -torch.exp(_randn(g, hv) * 0.5), _randn(g, hv) * 0.5
    ring0 = _randn(g, N_SLOTS, C, CONV_K - 1)
    pool0 = _randn(g, N_SLOTS, hv, dk, dv) * 0.3
    slots = _slots(SLOTS)

    ring_m, pool_m = ring0.clone(), pool0.clone()
    o_model = _model_tokens(qkv, a_in, b_in, w, A, dt, ring_m, pool_m, slots.long(), hk, hv, dk, dv)

    ring, pool = ring0.clone(), pool0.clone()
    for t in range(T):
        x = conv_ring_update_triton(qkv[:, t], ring, w, slots)
        q, k, v = x.split((hk * dk, hk * dk, hv * dv), dim=-1)  # strided views, not copied
        o = gdn_step_triton(q.view(R, hk, dk), k.view(R, hk, dk), v.view(R, hv, dv),
                            a_in[:, t], b_in[:, t], A, dt, pool, slots)
        _close(o, o_model[:, t], f"token {t} output vs model recurrence (hv={hv})", tol=2e-5)
    _close(ring, ring_m, "conv ring after T tokens vs model")
    _close(pool, pool_m, "state after T tokens vs model", tol=2e-5)
    _untouched(pool, pool0, SLOTS, "state after T tokens")
    _untouched(ring, ring0, SLOTS, "conv ring after T tokens")


# ------------------------------------------------------------------------------------------------
# sequence starts (position 0) and runs of several tokens per slot

@needs_kernel
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_position_zero_starts_from_zero_state(state_dtype):
    """Rows at position 0 ignore whatever their slot holds (even NaN) and start from zero conv history and
    zero state; rows at other positions continue. Kernel == reference with positions; a fresh row equals
    the same row run on a zeroed pool."""
    hk, hv, dk, dv = 2, 6, 16, 16
    C = 2 * hk * dk + hv * dv
    c = _gdn_case(50, len(SLOTS), hk, hv, dk, dv, state_dtype=state_dtype)
    slots, pos = _slots(SLOTS), torch.tensor([0, 7, 0], dtype=torch.long, device=DEV)
    fresh = [SLOTS[0], SLOTS[2]]
    c["state"][fresh] = float("nan")  # a previous sequence's leftovers may be anything
    st_ref = c["state"].clone()
    ref = gdn_step_ref(*_gdn_args(c, st_ref), slots, pos)
    out = gdn_step_triton(*_gdn_args(c, c["state"]), slots, pos, block_v=8)
    tol = 1e-2 if state_dtype == torch.bfloat16 else TOL  # bf16: an fp32 ulp apart may round to 1 bf16 ulp apart
    _close(out, ref, "gdn o with position-0 rows", tol=tol)
    _close(c["state"], st_ref, "gdn state with position-0 rows", tol=tol)
    zeroed = c["state"].clone()
    zeroed[fresh] = 0
    z_ref = gdn_step_ref(*_gdn_args(c, zeroed.clone()), slots)  # continue from an explicit zero state
    _close(out[[0, 2]], z_ref[[0, 2]], "fresh rows vs an explicitly zeroed pool", tol=tol)

    g = _gen(51)
    x, w = _randn(g, len(SLOTS), C), _randn(g, C, CONV_K) * 0.5
    ring = _randn(g, N_SLOTS, C, CONV_K - 1)
    ring[fresh] = float("nan")
    ring_ref = ring.clone()
    ref = conv_ring_update_ref(x, ring_ref, w, slots, pos)
    out = conv_ring_update_triton(x, ring, w, slots, pos, block_c=64)
    _close(out, ref, "conv out with position-0 rows")
    assert _bitwise(ring, ring_ref), _msg("conv ring with position-0 rows")
    for s in fresh:
        assert not ring[s, :, :-1].any(), _msg("a fresh ring keeps only the new input")


@needs_kernel
@pytest.mark.parametrize("T", [2, 5])
def test_runs_match_token_by_token(T):
    """seq_len = T runs (slot-major, one program walks a run in order) == T single-token calls, both for a
    run continuing its slot and for one starting at position 0; the reference agrees."""
    hk, hv, dk, dv = 2, 6, 16, 16
    C = 2 * hk * dk + hv * dv
    n = len(SLOTS)
    g = _gen(60 + T)
    qkv = _randn(g, n, T, C)
    a_in, b_in = _randn(g, n, T, hv), _randn(g, n, T, hv)
    w = _randn(g, C, CONV_K) * 0.5
    A, dt = -torch.exp(_randn(g, hv) * 0.5), _randn(g, hv) * 0.5
    ring0, pool0 = _randn(g, N_SLOTS, C, CONV_K - 1), _randn(g, N_SLOTS, hv, dk, dv) * 0.3
    start = torch.tensor([0, 3, 0], device=DEV)  # runs 0 and 2 start sequences
    pos = (start[:, None] + torch.arange(T, device=DEV)).reshape(-1)
    slots_rows = _slots(SLOTS).repeat_interleave(T)

    def split(x):
        q, k, v = x.split((hk * dk, hk * dk, hv * dv), dim=-1)
        R = x.shape[0]
        return q.view(R, hk, dk), k.view(R, hk, dk), v.view(R, hv, dv)

    ring, pool = ring0.clone(), pool0.clone()  # one call over the runs
    x = conv_ring_update_triton(qkv.reshape(n * T, C), ring, w, slots_rows, pos, seq_len=T)
    o = gdn_step_triton(*split(x), a_in.reshape(n * T, hv), b_in.reshape(n * T, hv), A, dt, pool, slots_rows, pos,
                        seq_len=T)
    ring1, pool1 = ring0.clone(), pool0.clone()  # token by token
    for t in range(T):
        x1 = conv_ring_update_triton(qkv[:, t], ring1, w, _slots(SLOTS), start + t)
        o1 = gdn_step_triton(*split(x1), a_in[:, t], b_in[:, t], A, dt, pool1, _slots(SLOTS), start + t)
        _close(x.view(n, T, C)[:, t], x1, f"conv of token {t} in runs vs alone")
        _close(o.view(n, T, hv, dv)[:, t], o1, f"gdn o of token {t} in runs vs alone", tol=2e-5)
    assert _bitwise(ring, ring1), _msg("conv ring after runs vs token by token")
    _close(pool, pool1, "state after runs vs token by token", tol=2e-5)
    ring2, pool2 = ring0.clone(), pool0.clone()  # the references over runs
    x2 = conv_ring_update_ref(qkv.reshape(n * T, C), ring2, w, slots_rows, pos, seq_len=T)
    o2 = gdn_step_ref(*split(x2), a_in.reshape(n * T, hv), b_in.reshape(n * T, hv), A, dt, pool2, slots_rows, pos,
                      seq_len=T)
    _close(x, x2, "conv runs vs reference")
    _close(o, o2, "gdn runs vs reference", tol=2e-5)
    _close(pool, pool2, "state runs vs reference", tol=2e-5)
    _untouched(pool, pool0, SLOTS, "state after runs")


@needs_kernel
def test_ragged_runs_match_token_by_token():
    """Ragged runs (a serving step: one slot's decode row, another's prompt chunk from position 0, a third's chunk
    continuing it; empty runs after them, as a graph bucket's spare programs) == the tokens one call each; the
    references over the same runs agree, and bad offsets are refused there."""
    hk, hv, dk, dv = 2, 6, 16, 16
    C = 2 * hk * dk + hv * dv
    g = _gen(77)
    lens, starts = [1, 4, 2], [5, 0, 2]              # slots SLOTS = [3, 0, 4]
    R = sum(lens)
    qkv, a_in, b_in = _randn(g, R, C), _randn(g, R, hv), _randn(g, R, hv)
    w = _randn(g, C, CONV_K) * 0.5
    A, dt = -torch.exp(_randn(g, hv) * 0.5), _randn(g, hv) * 0.5
    ring0, pool0 = _randn(g, N_SLOTS, C, CONV_K - 1), _randn(g, N_SLOTS, hv, dk, dv) * 0.3
    slots_rows = torch.cat([_slots([s] * n) for s, n in zip(SLOTS, lens)])
    pos = torch.cat([torch.arange(p, p + n, device=DEV) for p, n in zip(starts, lens)])
    offs = [0, 1, 5, R, R, R]
    runs = torch.tensor(offs, dtype=torch.int32, device=DEV)

    def split(x):
        q, k, v = x.split((hk * dk, hk * dk, hv * dv), dim=-1)
        return q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, hv, dv)

    ring, pool = ring0.clone(), pool0.clone()
    x = conv_ring_update_triton(qkv, ring, w, slots_rows, pos, runs=runs)
    o = gdn_step_triton(*split(x), a_in, b_in, A, dt, pool, slots_rows, pos, runs=runs)
    ring1, pool1 = ring0.clone(), pool0.clone()
    for r in range(R):                                 # each token alone, in row order (a run's rows in order)
        x1 = conv_ring_update_triton(qkv[r:r + 1], ring1, w, slots_rows[r:r + 1], pos[r:r + 1])
        o1 = gdn_step_triton(*split(x1), a_in[r:r + 1], b_in[r:r + 1], A, dt, pool1, slots_rows[r:r + 1], pos[r:r + 1])
        _close(x[r:r + 1], x1, f"conv of row {r} in ragged runs vs alone")
        _close(o[r:r + 1], o1, f"gdn o of row {r} in ragged runs vs alone", tol=2e-5)
    assert _bitwise(ring, ring1), _msg("conv ring after ragged runs vs token by token")
    _close(pool, pool1, "state after ragged runs vs token by token", tol=2e-5)
    ring2, pool2 = ring0.clone(), pool0.clone()
    x2 = conv_ring_update_ref(qkv, ring2, w, slots_rows, pos, runs=runs)
    o2 = gdn_step_ref(*split(x2), a_in, b_in, A, dt, pool2, slots_rows, pos, runs=runs)
    _close(x, x2, "conv ragged runs vs reference")
    _close(o, o2, "gdn ragged runs vs reference", tol=2e-5)
    _close(pool, pool2, "state ragged runs vs reference", tol=2e-5)
    _untouched(pool, pool0, SLOTS, "state after ragged runs")
    for bad in ([0, 2, R], [0, 1, 5]):                 # a run across two slots; offsets that stop short of R
        with pytest.raises(ValueError):
            conv_ring_update_ref(qkv, ring2.clone(), w, slots_rows, pos,
                                 runs=torch.tensor(bad, dtype=torch.int32, device=DEV))


# ------------------------------------------------------------------------------------------------
# the state written back every M tokens (an UpdateLog beside the pool)

def _write_back_steps(M, state_dtype, lens_per_step, salt, hk=2, hv=6, dk=16, dv=16, block_v=8, ragged=False):
    """Steps of runs over SLOTS through four pools: the Triton kernel and the reference, each writing the state every
    token and every M tokens. lens_per_step: per step, each slot's run length (0: no row this step; ragged steps only)
    or a negative length: the slot restarts a sequence at position 0 with that many tokens. Checks per step: the two
    Triton forms give the same bits, the references agree with them, and the rebuilt states equal the state written
    every token."""
    g = _gen(salt)
    _A, _dt = -torch.exp(_randn(g, hv) * 0.5), _randn(g, hv) * 0.5
    init = (_randn(g, N_SLOTS, hv, dk, dv) * 0.3).to(state_dtype)
    pools = {f: init.clone() for f in ("te", "tl", "re", "rl")}
    logs = {f: UpdateLog.empty(N_SLOTS, hv, dk, dv, M, DEV, block_v=block_v) for f in ("tl", "rl")}
    for f in logs:                                   # stale entries from earlier sequences must never be read
        for t in logs[f]:
            t.copy_(_randn(g, *t.shape))
    tol = TOL * 2 if state_dtype == torch.float32 else 3e-2
    pos = {s: 0 for s in SLOTS}
    for step, lens in enumerate(lens_per_step):
        rows = []
        for s, n in zip(SLOTS, lens):
            if n < 0:
                pos[s], n = 0, -n
            rows += [(s, pos[s] + t) for t in range(n)]
            pos[s] += n
        R = len(rows)
        slots = _slots([s for s, _ in rows])
        positions = torch.tensor([p for _, p in rows], device=DEV)
        kw = {"runs": torch.tensor([0, *itertools.accumulate(abs(n) for n in lens)], dtype=torch.int32, device=DEV)} \
            if ragged else {"seq_len": abs(lens[0])}
        c = _gdn_case(salt * 100 + step, R, hk, hv, dk, dv)
        args = lambda f: _gdn_args(c, pools[f])  # noqa: E731
        o = {"te": gdn_step_triton(*args("te"), slots, positions, block_v=block_v, **kw),
             "tl": gdn_step_triton(*args("tl"), slots, positions, block_v=block_v, log=logs["tl"], **kw),
             "re": gdn_step_ref(*args("re"), slots, positions, **kw),
             "rl": gdn_step_ref(*args("rl"), slots, positions, log=logs["rl"], **kw)}
        what = f"M={M} {state_dtype} step {step}"
        assert _bitwise(o["tl"], o["te"]), _msg(f"{what}: written back every M tokens, the outputs changed bits")
        _close(o["rl"], o["re"], f"{what}: reference every M tokens vs every token", tol)
        _close(o["tl"], o["rl"], f"{what}: kernel vs reference, every M tokens", tol)
        for s in SLOTS:
            _close(materialize_state(pools["tl"], logs["tl"], s, pos[s]), pools["te"][s].float(),
                   f"{what}: slot {s} rebuilt from its base and log", tol)


@needs_kernel
@pytest.mark.parametrize("M", [3] if INTERPRET else [2, 3, 5])   # the interpreter: one period (14 s each)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16] if INTERPRET else [torch.float32, torch.bfloat16])
def test_write_back_every_m_tokens_keeps_the_bits(M, state_dtype):
    """Runs of every length against the period (prefill runs across aligned tokens and short of them, decode steps,
    a slot restarting at position 0 mid-way) over slots with different phases, every column block its own program."""
    steps = [[5] * 3, [1] * 3, [1] * 3, [2] * 3, [1] * 3, [7] * 3, [1] * 3, [1] * 3, [1] * 3, [3] * 3]
    _write_back_steps(M, state_dtype, steps, salt=90 + M)


@needs_kernel
@pytest.mark.parametrize("M", [2, 4])
def test_write_back_with_ragged_runs(M):
    """A serving step's ragged runs: decode rows beside prompt chunks, a restart at position 0 and an idle slot."""
    steps = [[3, 6, 1], [1, 2, 1], [1, 0, 5], [-4, 1, 1], [1, 1, 0], [2, 3, 1], [1, 1, 1]]
    _write_back_steps(M, torch.float32, steps, salt=95 + M, ragged=True)


@needs_kernel
def test_write_back_refusals():
    """A log without positions (no phases), or one laid out for other column blocks, is refused by name."""
    c = _gdn_case(99, len(SLOTS), 2, 6, 16, 16)
    slots, pos = _slots(SLOTS), torch.tensor([4, 4, 4], device=DEV)
    log = UpdateLog.empty(N_SLOTS, 6, 16, 16, 4, DEV, block_v=8)
    for fn in (gdn_step_triton, gdn_step_ref):
        with pytest.raises(ValueError, match="needs positions"):
            fn(*_gdn_args(c, c["state"].clone()), slots, log=log)
    with pytest.raises(ValueError, match="column blocks"):
        gdn_step_triton(*_gdn_args(c, c["state"].clone()), slots, pos, block_v=16, log=log)
    with pytest.raises(ValueError, match="period >= 2"):
        UpdateLog.empty(N_SLOTS, 6, 16, 16, 1, DEV)


@needs_kernel
def test_state_read_before_the_wait_keeps_the_bits():
    """The graphed form reads each run's state before its PDL wait (kernels/gdn.py, STATE_BEFORE_WAIT_MAX_RUNS):
    with ragged runs, a run at position 0 over a NaN-filled slot, an empty run and a padding row, it writes the same
    output and state bits as the eager order, and both agree with the reference."""
    hk, hv, dk, dv = 2, 6, 16, 16
    c = _gdn_case(90, 5, hk, hv, dk, dv)
    slots = _slots([3, 3, 0, 0, -1])                   # runs: slot 3 at 4..5, slot 0 from position 0, a padding row
    pos = torch.tensor([4, 5, 0, 1, 0], dtype=torch.long, device=DEV)
    runs = torch.tensor([0, 2, 4, 5, 5], dtype=torch.int32, device=DEV)
    c["state"][0] = float("nan")                       # a fresh run must not read its slot's leftovers
    outs, states = [], []
    for early in (False, True):
        st = c["state"].clone()
        o = torch.full((5, hv, dv), float("nan"), device=DEV)
        gdn_step_triton(*_gdn_args(c, st), slots, pos, out=o, runs=runs, state_early=early)
        outs.append(o)
        states.append(st)
    assert _bitwise(outs[0], outs[1]), _msg("output: state read before / after the wait differ")
    assert _bitwise(states[0], states[1]), _msg("state: read before / after the wait differ")
    st_ref = c["state"].clone()
    live = {n: (t[:4] if n in ("q", "k", "v", "a", "b") else t) for n, t in c.items()}
    ref = gdn_step_ref(*_gdn_args(live, st_ref), slots[:4], pos[:4], runs=runs[:3])
    _close(outs[1][:4], ref, "gdn o, state read before the wait")
    assert torch.isnan(outs[1][4]).all(), _msg("the padding row's output was written")
    _close(states[1][[0, 3]], st_ref[[0, 3]], "gdn state, state read before the wait")
    _untouched(states[1], c["state"], [0, 3], "gdn state (state read before the wait)")


# ------------------------------------------------------------------------------------------------
# CPU-only: the kernel tests above, in a child process under the Triton interpreter

@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), GDN_SEED=str(SEED))


# ------------------------------------------------------------------------------------------------
# GPU: Qwen3.5/3.6-27B GDN shapes (16 key heads, 48 value heads, 128 x 128, conv 4)

HK27, HV27, D27 = 16, 48, 128
C27 = 2 * HK27 * D27 + HV27 * D27  # 10240


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 32, 128])
def test_gpu_27b_shapes(B):
    n_slots = B + 3
    slots = torch.randperm(n_slots, generator=_gen(20 + B))[:B].to(torch.int32).to(DEV)
    used = slots.tolist()
    c = _gdn_case(21 + B, B, HK27, HV27, D27, D27, n_slots=n_slots)
    st0, st_ref = c["state"].clone(), c["state"].clone()
    ref = gdn_step_ref(*_gdn_args(c, st_ref), slots)
    out = gdn_step_triton(*_gdn_args(c, c["state"]), slots)
    torch.cuda.synchronize()
    _close(out, ref, f"27B gdn o B={B}", tol=1e-4)
    _close(c["state"], st_ref, f"27B gdn state B={B}", tol=1e-4)
    _untouched(c["state"], st0, used, "27B gdn state")

    g = _gen(22 + B)
    x, w = _randn(g, B, C27, dtype=torch.bfloat16), (_randn(g, C27, CONV_K) * 0.5).to(torch.bfloat16)
    ring = _randn(g, n_slots, C27, CONV_K - 1, dtype=torch.bfloat16)
    ring0, ring_ref = ring.clone(), ring.clone()
    ref = conv_ring_update_ref(x, ring_ref, w, slots)
    out = conv_ring_update_triton(x, ring, w, slots)
    torch.cuda.synchronize()
    _close(out, ref, f"27B conv out B={B}", tol=1e-4)
    assert _bitwise(ring, ring_ref), _msg("27B conv ring differs from the reference")
    _untouched(ring, ring0, used, "27B conv ring")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 4, 8])
def test_gpu_27b_write_back_keeps_the_bits(M):
    """27B shapes, the default column blocks, 32 slots: a 22-token prefill run then 12 decode steps, writing the state
    every M tokens gives the bits of writing it every token, and the rebuilt states equal it."""
    B, P = 32, 22
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    pools = {f: torch.zeros(B, HV27, D27, D27, device=DEV) for f in ("every", "lazy")}
    log = UpdateLog.empty(B, HV27, D27, D27, M, DEV)
    for step in range(13):
        T = P if step == 0 else 1
        p0 = 0 if step == 0 else P + step - 1
        c = _gdn_case(40 + step, B * T, HK27, HV27, D27, D27, n_slots=1)
        rows, pos = slots.repeat_interleave(T), (p0 + torch.arange(T, device=DEV)).repeat(B)
        a = gdn_step_triton(*_gdn_args(c, pools["every"]), rows, pos, seq_len=T)
        b = gdn_step_triton(*_gdn_args(c, pools["lazy"]), rows, pos, seq_len=T, log=log)
        assert _bitwise(a, b), _msg(f"27B M={M} step {step}: outputs changed bits")
    end = P + 12
    for s in range(0, B, 5):
        _close(materialize_state(pools["lazy"], log, s, end), pools["every"][s], f"27B M={M} slot {s} rebuilt", 1e-5)


@pytest.mark.gpu
def test_gpu_27b_batch_invariance():
    B = 128
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    c = _gdn_case(30, B, HK27, HV27, D27, D27, n_slots=B)
    st_batch = c["state"].clone()
    full = gdn_step_triton(*_gdn_args(c, st_batch), slots)
    for r in range(0, B, 17):
        st = c["state"].clone()
        one = {n: (t[r:r + 1].clone() if n in ("q", "k", "v", "a", "b") else t) for n, t in c.items()}
        o = gdn_step_triton(*_gdn_args(one, st), slots[r:r + 1].clone())
        assert _bitwise(o[0], full[r]) and _bitwise(st[r], st_batch[r]), _msg(f"row {r} alone differs")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Capture conv + GDN step once; replay with new inputs and slots (incl. a padding row) written in place."""
    B, n_slots = 32, 40
    g = _gen(40)
    x = _randn(g, B, C27, dtype=torch.bfloat16)
    w = (_randn(g, C27, CONV_K) * 0.5).to(torch.bfloat16)
    ring = _randn(g, n_slots, C27, CONV_K - 1, dtype=torch.bfloat16)
    a, b = _randn(g, B, HV27), _randn(g, B, HV27)
    A, dt = -torch.exp(_randn(g, HV27) * 0.5), _randn(g, HV27) * 0.5
    pool = _randn(g, n_slots, HV27, D27, D27) * 0.3
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    conv_out = torch.empty(B, C27, device=DEV)
    o = torch.empty(B, HV27, D27, device=DEV)
    kd = HK27 * D27

    def step():
        conv_ring_update_triton(x, ring, w, slots, out=conv_out)
        q, k, v = conv_out[:, :kd], conv_out[:, kd:2 * kd], conv_out[:, 2 * kd:]
        gdn_step_triton(q.view(B, HK27, D27), k.view(B, HK27, D27), v.view(B, HV27, D27), a, b, A, dt, pool, slots,
                        out=o)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for it in range(3):
        g = _gen(41 + it)
        new_slots = torch.randperm(n_slots, generator=g)[:B].to(torch.int32)
        new_slots[5] = -1
        slots.copy_(new_slots.to(DEV))
        x.copy_(_randn(g, B, C27, dtype=torch.bfloat16))
        a.copy_(_randn(g, B, HV27))
        b.copy_(_randn(g, B, HV27))
        ring_ref, pool_ref, pool0, ring0 = ring.clone(), pool.clone(), pool.clone(), ring.clone()
        c_ref = conv_ring_update_ref(x, ring_ref, w, slots)
        q, k, v = c_ref[:, :kd], c_ref[:, kd:2 * kd], c_ref[:, 2 * kd:]
        o_ref = gdn_step_ref(q.reshape(B, HK27, D27), k.reshape(B, HK27, D27), v.reshape(B, HV27, D27),
                             a, b, A, dt, pool_ref, slots)
        graph.replay()
        torch.cuda.synchronize()
        live = slots >= 0
        _close(conv_out[live], c_ref[live], f"graph replay {it}: conv", tol=1e-4)
        _close(o[live], o_ref[live], f"graph replay {it}: gdn o", tol=1e-4)
        _close(pool, pool_ref, f"graph replay {it}: state", tol=1e-4)
        assert _bitwise(ring, ring_ref), _msg(f"graph replay {it}: conv ring")
        used = [s_ for s_ in slots.tolist() if s_ >= 0]
        _untouched(pool, pool0, used, f"graph replay {it}: state")
        _untouched(ring, ring0, used, f"graph replay {it}: ring")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gdn_step_rows_do_not_depend_on_the_batch_at_27b_shapes():
    """Each slot's output and new state are bitwise the same whether the step holds 1 row or 128
    (27B's 16 key / 48 value heads of 128): the tile shape must not follow the row count."""
    hk, hv, dk, dv, R = 16, 48, 128, 128, 128
    c = _gdn_case(7, R, hk, hv, dk, dv, n_slots=R)
    slots = torch.arange(R, dtype=torch.int32, device=DEV)
    one = {k: (v[:1].clone() if k in ("q", "k", "v", "a", "b") else v.clone()) for k, v in c.items()}
    out_all = gdn_step_triton(*_gdn_args(c, c["state"]), slots)
    out_one = gdn_step_triton(*_gdn_args(one, one["state"]), slots[:1])
    assert _bitwise(out_all[:1], out_one), _msg("slot 0's output changed with the batch size")
    assert _bitwise(c["state"][0], one["state"][0]), _msg("slot 0's new state changed with the batch size")


def test_register_cap_only_for_the_written_back_form(monkeypatch):
    """GDN_MAXNREG caps the written-back launch on CUDA; the form written every token and the interpreter run
    uncapped."""
    from onepass.kernels import gdn

    monkeypatch.setattr(gdn, "GDN_MAXNREG", 128)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gdn._reg_cap(cuda, 4) == {"maxnreg": 128} and gdn._reg_cap(cuda, 2) == {"maxnreg": 128}
    assert gdn._reg_cap(cuda, 1) == {} and gdn._reg_cap(cpu, 4) == {}
    monkeypatch.setattr(gdn, "GDN_MAXNREG", None)
    assert gdn._reg_cap(cuda, 4) == {}
