"""Gated DeltaNet (GDN) decode kernels: one token per row, slot-indexed state pools updated in place.

A *row* r is one decode token of slot ``slots[r]``; ``slots[r] < 0`` marks a padding row (CUDA-graph
batches): its pools are not touched and its output rows are left as they are. The rows of one call must
name distinct slots (a decode step does): two rows of one slot would race on the slot's state.

Runs (``seq_len`` = T >= 1): rows are grouped slot-major into R / T runs of T consecutive tokens of one
slot (rows n*T .. n*T + T-1; a static batch's prefill). Run n uses ``slots[n*T]`` and
``positions[n*T]``; one program walks its run's tokens in order, so a slot's state is read once and
written once per call whatever T is. T = 1 is the decode step.

Ragged runs (``runs`` given instead of seq_len): runs[n] .. runs[n + 1] - 1 are the rows of run n, one slot's
consecutive tokens (a serving step's decode rows and prompt chunks, each slot's rows together); runs is int32 [n + 1]
with runs[0] = 0 and runs[-1] = R, and entries may repeat (empty runs: a graph bucket's spare programs). One program
per run again, so each slot's state is still read and written once per call.

Sequence start (``positions`` given): a run whose first position is 0 starts a new sequence in its
slot: the kernel ignores what the pools hold and starts from a zero conv history and a zero state
(both are overwritten by the call). So a refilled slot needs no separate reset, on the device and
inside a CUDA graph alike (nothing is read on the host). Without ``positions`` the pools are always
continued (the kernels' original contract).

conv_ring_update_{ref,triton}(x, conv_state, conv_weight, slots, positions=None, seq_len=1) -> [R, conv_dim] fp32
    x [R, C] pre-conv qkv of the token, conv_state [slots, C, K-1] (oldest first), conv_weight [C, K].
    out[r, c] = silu(sum_j w[c, j] * win[c, j]),  win = ring[slot] ++ x[r]  (tap K-1 = the new input);
    the ring is shifted in place to the newest K-1 inputs. Same math as Qwen35Model.causal_conv (T = 1).
    Kernel grid (R / T, cdiv(C, BLOCK_C)), one channel per lane; tap j of token t is loaded from
    x[run, t - (K-1) + j] when that index is >= 0 and from the old ring otherwise (nothing is shifted in
    registers), the taps summed in order; the ring is rewritten after a barrier.

gdn_step_{ref,triton}(q, k, v, a, b, A, dt_bias, state, slots, positions=None, seq_len=1) -> o [R, Hv, Dv] fp32
    q, k [R, Hk, Dk] post-conv (not yet normalised), v [R, Hv, Dv], a (ssm_alpha(x)) and b (ssm_beta(x))
    [R, Hv], A = ssm_a = -exp(A_log) [Hv], dt_bias = ssm_dt [Hv], state pool [slots, Hv, Dk, Dv] (fp32, or
    bf16 rounded after every token). Exactly Qwen35Model.gated_delta_net's recurrence, fp32:
        q = l2norm(q) * Dk**-0.5, k = l2norm(k)        (value head h reads key head h // (Hv / Hk))
        g = A * softplus(a + dt_bias), beta = sigmoid(b)
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q     (o read after the update)
    Kernel grid R / T x Hv x cdiv(Dv, BV), flat, column block fastest, then head, then run: each program holds one
    [Dk, BV] fp32 tile of S, reads it once, applies its run's T tokens in order and writes it once; q/k
    normalisation and the gates are recomputed per program (a few hundred FLOPs). So the programs running together
    read a slot's state as one contiguous stretch; the state is read once and written once per call, so its loads
    are evict-first and its stores streaming (.cs) (why this grid and these hints: kernels/PROBES.md, kernels/gdn.py).
    Every program depends only on its own row, so results are batch invariant (bitwise).

State write-back every M tokens (``log``: an UpdateLog of period M > 1; positions required). A step's new state is
S_t = e_t S_{t-1} + k_t delta_t^T: the decayed old state plus one outer product. So the pool need not hold S after every
token: it holds the base state S_b after the slot's last "aligned" token, and a log of the (e, k, delta) of each token
since: at the 27B's heads (Dk = Dv = 128, two column blocks a head) 1.5 KB a value head and token against its 64 KB
state. A program rebuilds S_{t-1} from the base and the log in registers (r rank-1 updates, the same fp32 operations
the step made, bf16 pools rounded after each as before), makes its token's step, and then writes either its part of the
log entry (its columns of delta, its own copy of k and e) or, on an aligned token, its tile of the whole state. A
decode step then reads the state once and writes it on one step in M, 1 + 1/M states of traffic instead of 2, with the
same bits as writing it every step (tests/test_kernels_gdn.py checks both). Token p of slot s has phase (p + s) % M and
is aligned at phase M - 1: the slot's own offset spreads the full writes evenly over the steps of a static batch, so
every step moves the same bytes. A run of T tokens writes the state at its last aligned token and log entries for the
tokens after it. A sequence's first M tokens need no old base: before its first aligned token the base is zero.
Positions fix the phases, so a slot restarting at position 0 needs no reset, as before; without positions (the pools
always continued) only M = 1 is defined.
What it buys is less than the bytes: without the writes the kernel is bound by what its programs keep in flight (one
32 KB tile each in registers), not by HBM, and every logged token replayed is a dependent round trip before the step,
so long periods lose. With the written-back form's registers capped (GDN_MAXNREG) M = 4 pays, and fp32 pools default
to it (engine/state_pool.py WRITEBACK; the measurements: kernels/PROBES.md, kernels/gdn.py).

Speculative verify (``spec``: SpecRows, ``draft``: the layer's DraftLog; positions required). A verify run feeds a
slot its newest token and k draft tokens; how many of them the target keeps is known only after the step. So a verify
run computes its rows' outputs as any run does but leaves the slot's state, conv ring and UpdateLog as they were: each
row's update (e, k, delta) and its pre-conv input go to the slot's DraftLog instead. The slot's next run, whatever it
is, first folds in the `kept` leading entries (spec.kept at its first row: the newest token and the accepted drafts)
as the tokens at positions p0 - kept .. p0 - 1, with the same fma and rounding the rows made (so the bits are those of
feeding only the kept rows), writing state and UpdateLog by the usual schedule over them, then runs its own rows. Rows
the target rejected are never read again: acceptance moves a cursor (kept), nothing is copied back. Bytes a verify
step adds per slot and GDN layer: T = k + 1 entries written (the 27B, two column blocks a head: Hv (2 Dk + Dv + 2) 4
= 74 KB each, plus the row's conv input, conv_dim x 2 bytes = 20 KB) and the kept ones read back by the next run,
against the 3 MiB state read and written either way; keeping one state per row instead would write T x 3 MiB.
The kept count is read at a run's first row (0 for a run at position 0, which starts afresh).

Built, measured and not kept (kernels/PROBES.md, kernels/gdn.py): the conv and the step in one launch, and the step's
two reductions over the state in one pass.

Both Triton entry points take an optional ``out`` and allocate nothing else, read nothing on the host,
and accept non-contiguous row/head views (unit stride in the last dim): they can be captured in a CUDA
graph and replayed with new inputs/slots written in place.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from onepass.kernels.gdn_ref import L2NORM_EPS, causal_conv, delta_rule, l2norm
from onepass.kernels import pdl
from onepass.kernels.splitk import SplitSums, split_args, split_sum
from onepass.kernels.triton_compat import tl, triton
from onepass.kernels.x_image import XImage, check_image, image_args, image_offsets

# channels per conv-ring program, one per lane; the conv in two passes, one run a program (why: kernels/PROBES.md,
# kernels/gdn.py: CONV_BLOCK_C)
CONV_BLOCK_C = 128

# Captured in a CUDA graph, the GDN step reads its slot's state before its PDL wait (kernels/pdl.py), so an
# early-launched kernel's first wave streams state while the conv ring before it still runs; q, k, v and the gates,
# which the kernels before write, are read after the wait as always. The exception to PDL's contract is safe there: a
# graph is one step, in which each layer's GDN step runs once; the state it reads was written by the same layer's
# step in an earlier graph launch or by the pool's reset (torch, outside the graph), both complete before the graph
# starts; runs, slots and positions are step inputs, written before the graph's first kernel too. Eager calls (one
# forward after another, nothing but PDL's chain between them) read the state after the wait. It pays at one run
# only: with many, the early kernel's blocks, resident and waiting, slow the conv ring under them (why:
# kernels/PROBES.md, kernels/gdn.py: STATE_BEFORE_WAIT_MAX_RUNS).
STATE_BEFORE_WAIT_MAX_RUNS = 1
# the GDN step's launch: BLOCK_V state columns a program (default_block_v says why 64), GDN_WARPS warps, one
# (run, head, column block) item a program (why: kernels/PROBES.md, kernels/gdn.py)
BLOCK_V = 64
GDN_WARPS = 4
# Registers a thread of the written-back form (WB > 1) may use. Uncapped it takes ~160 (the tile, its replay and the
# log's stores): three programs an SM, whose loads leave too few tiles in flight; capped at 128 four fit, spilling a
# few bytes. The form written every token is bound by its bytes and is left uncapped. (why 128, and the other launches
# tried: kernels/PROBES.md, kernels/gdn.py: GDN_MAXNREG)
GDN_MAXNREG = 128
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus default (beta=1): x above it passes through


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class UpdateLog(NamedTuple):
    """The per-token updates a state pool written back every `period` tokens holds since each slot's base state
    (module doc): entry j of a slot is the token of phase j. fp32 whatever the pool's dtype. k and e are kept once per
    column block of the kernel (`copies`), so that each program reads and writes only its own entries: a run that
    wraps past an aligned token rewrites entries another program of its head may not have replayed yet."""
    k: torch.Tensor       # [slots, Hv, copies, period - 1, Dk]  the token's l2-normalised k (its value head's key head)
    delta: torch.Tensor   # [slots, Hv, period - 1, Dv]          beta (v - (e S)^T k)
    decay: torch.Tensor   # [slots, Hv, copies, period - 1]      e = exp(g)

    @property
    def period(self) -> int:
        return self.k.shape[3] + 1

    @property
    def copies(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    @classmethod
    def empty(cls, slots: int, hv: int, dk: int, dv: int, period: int, device, block_v: int | None = None) -> UpdateLog:
        """A zeroed log for the kernel's column blocks (block_v state columns a program; its default when None)."""
        if period < 2:
            raise ValueError(f"an update log needs a write-back period >= 2 (got {period}); period 1 keeps no log")
        c = column_blocks(hv, dv, block_v)[1]
        f = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(slots, hv, c, period - 1, dk, **f), torch.zeros(slots, hv, period - 1, dv, **f),
                   torch.zeros(slots, hv, c, period - 1, **f))


class DraftLog(NamedTuple):
    """One GDN layer's verify rows, per slot, until the slot's next run folds in those the target kept (module doc:
    speculative verify). Entry t is the run's row t. k and e are kept once per column block, as in UpdateLog, so each
    program reads and writes only its own; x, the rows' pre-conv inputs, in the conv ring's dtype."""
    k: torch.Tensor       # [slots, Hv, copies, rows, Dk]  the row's l2-normalised k (its value head's key head)
    delta: torch.Tensor   # [slots, Hv, rows, Dv]          beta (v - (e S)^T k)
    decay: torch.Tensor   # [slots, Hv, copies, rows]      e = exp(g)
    x: torch.Tensor       # [slots, rows, conv_dim]        the conv's input

    @property
    def rows(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def row_bytes(self) -> int:
        """Bytes one verify row of one slot writes (and a kept one is read back): its update and its conv input."""
        return sum(t[0].numel() * t.element_size() for t in self) // self.rows

    @classmethod
    def empty(cls, slots: int, hv: int, dk: int, dv: int, conv_dim: int, rows: int, device,
              conv_dtype: torch.dtype = torch.float32, block_v: int | None = None) -> DraftLog:
        """A zeroed draft log of `rows` rows a slot (k + 1 for k drafts) for the kernel's column blocks."""
        if rows < 1:
            raise ValueError(f"a draft log keeps at least one row a slot (got {rows})")
        c = column_blocks(hv, dv, block_v)[1]
        f = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(slots, hv, c, rows, dk, **f), torch.zeros(slots, hv, rows, dv, **f),
                   torch.zeros(slots, hv, c, rows, **f), torch.zeros(slots, rows, conv_dim, dtype=conv_dtype,
                                                                     device=device))


class SpecRows(NamedTuple):
    """A step's speculation inputs, per row and read at a run's first row: `kept`, the rows of the slot's last verify
    run the target kept (folded in before the run's own rows), and `verify`, nonzero when the run's rows are drafts
    to verify (kept in the DraftLog, not in the state)."""
    kept: torch.Tensor    # [R] int
    verify: torch.Tensor  # [R] int


def _check_spec(spec: SpecRows, R: int, positions) -> None:
    if positions is None:
        raise ValueError("speculative verify (a DraftLog) needs positions: a kept row is folded in at its position")
    if spec.kept.shape != (R,) or spec.verify.shape != (R,):
        raise ValueError(f"spec rows kept {tuple(spec.kept.shape)}, verify {tuple(spec.verify.shape)}: want ({R},)")


def _check_draft(draft: DraftLog, state: torch.Tensor, copies: int | None = None) -> None:
    """The draft log's updates against the state pool (copies: the kernel's column blocks a head)."""
    n, hv, dk, dv = state.shape
    d, c = draft.rows, draft.k.shape[2] if copies is None else copies
    want = ((n, hv, c, d, dk), (n, hv, d, dv), (n, hv, c, d))
    got = tuple(tuple(t.shape) for t in draft[:3])
    if got != want or any(t.dtype != torch.float32 or not t.is_contiguous() for t in draft[:3]):
        raise ValueError(f"draft log shapes {got} (fp32, contiguous) do not fit the state pool {tuple(state.shape)} "
                         f"with {c} column blocks a head: want {want} (DraftLog.empty with the kernel's block_v)")


def _check_draft_inputs(draft: DraftLog, ring: torch.Tensor) -> None:
    """The draft log's conv inputs against the conv ring [slots, C, K-1]."""
    want = (ring.shape[0], draft.rows, ring.shape[1])
    if tuple(draft.x.shape) != want or draft.x.dtype != ring.dtype or not draft.x.is_contiguous():
        raise ValueError(f"draft log conv inputs {tuple(draft.x.shape)} {draft.x.dtype}: want {want} {ring.dtype}, "
                         "contiguous")


def _check_log(log: UpdateLog, state: torch.Tensor, positions, copies: int | None = None) -> None:
    if positions is None:
        raise ValueError("a state written back every few tokens (an UpdateLog) needs positions: they set each token's "
                         "phase; without positions only write-back period 1 is defined")
    n, hv, dk, dv = state.shape
    m, c = log.period - 1, log.copies if copies is None else copies
    want = ((n, hv, c, m, dk), (n, hv, m, dv), (n, hv, c, m))
    got = tuple(tuple(t.shape) for t in log)
    if got != want or any(t.dtype != torch.float32 or not t.is_contiguous() for t in log):
        raise ValueError(f"update log shapes {got} (fp32, contiguous) do not fit the state pool {tuple(state.shape)} "
                         f"with {c} column blocks a head: want {want} (UpdateLog.empty with the kernel's block_v)")


# --------------------------------------------------------------------------------------------------
# torch references (the model's own functions; host reads allowed, as in every reference)

def _runs(R: int, seq_len: int, slots: torch.Tensor, positions: torch.Tensor | None):
    """(slot of each run [n], live-run mask [n], starts-a-sequence mask [n]) for R rows in runs of seq_len."""
    if seq_len < 1 or R % seq_len:
        raise ValueError(f"{R} rows do not split into runs of seq_len={seq_len}")
    run_slots = slots.reshape(-1)[::seq_len].to(torch.long)
    live = run_slots >= 0
    if positions is None:
        fresh = torch.zeros_like(live)
    else:
        fresh = positions.reshape(-1)[::seq_len] == 0
    return run_slots, live, fresh


def _run_bounds(runs: torch.Tensor, R: int, slots: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of every non-empty ragged run, checked: offsets from 0 to R, non-decreasing, one slot each."""
    b = [int(v) for v in runs.reshape(-1).tolist()]
    if len(b) < 2 or b[0] != 0 or b[-1] != R or any(e < s for s, e in zip(b, b[1:])):
        raise ValueError(f"runs {b} are not row offsets from 0 to {R}")
    sl = slots.reshape(-1).tolist()
    out = [(s, e) for s, e in zip(b, b[1:]) if e > s]
    if any(len(set(sl[s:e])) != 1 for s, e in out):
        raise ValueError("a ragged run must hold the rows of one slot")
    return out


def _zero_fresh(pool: torch.Tensor, run_slots: torch.Tensor, live: torch.Tensor, fresh: torch.Tensor) -> None:
    ids = run_slots[live & fresh]
    if ids.numel():
        pool[ids] = 0


def _bounds(R: int, seq_len: int, slots: torch.Tensor, positions, runs) -> list[tuple[int, int]]:
    """(start, end) of every run: the ragged runs, or runs of seq_len rows (checked)."""
    if runs is not None:
        return _run_bounds(runs, R, slots)
    _runs(R, seq_len, slots, positions)
    return [(s, s + seq_len) for s in range(0, R, seq_len)]


def conv_ring_update_ref(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                         slots: torch.Tensor, positions: torch.Tensor | None = None, seq_len: int = 1,
                         runs: torch.Tensor | None = None, spec: SpecRows | None = None,
                         draft: DraftLog | None = None) -> torch.Tensor:
    """Qwen35Model.causal_conv over runs of seq_len rows (or the ragged runs); rows of runs with slot < 0 are skipped
    (output 0). Runs starting at position 0 start from a zero ring. spec, draft: speculative verify (module doc)."""
    R, C = x.shape
    if spec is not None:
        _check_spec(spec, R, positions)
        _check_draft_inputs(draft, conv_state)
        return _conv_speculative_ref(x, conv_state, conv_weight, slots, positions,
                                     _bounds(R, seq_len, slots, positions, runs), spec, draft)
    if runs is not None:
        out = torch.zeros(R, C, dtype=torch.float32, device=x.device)
        for s, e in _run_bounds(runs, R, slots):
            out[s:e] = conv_ring_update_ref(x[s:e], conv_state, conv_weight, slots[s:e],
                                            None if positions is None else positions[s:e], seq_len=e - s)
        return out
    run_slots, live, fresh = _runs(R, seq_len, slots, positions)
    _zero_fresh(conv_state, run_slots, live, fresh)
    out = torch.zeros(R // seq_len, seq_len, C, dtype=torch.float32, device=x.device)
    if bool(live.any()):
        xs = x.reshape(R // seq_len, seq_len, C)
        out[live] = causal_conv(xs[live], conv_weight, conv_state, run_slots[live])
    return out.reshape(R, C)


def gdn_step_ref(q, k, v, a, b, A, dt_bias, state: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor | None = None, seq_len: int = 1,
                 runs: torch.Tensor | None = None, log: UpdateLog | None = None, spec: SpecRows | None = None,
                 draft: DraftLog | None = None) -> torch.Tensor:
    """Qwen35Model.gated_delta_net's recurrence over runs of seq_len rows, or the ragged runs (see module doc); rows
    of runs with slot < 0 are skipped (output 0); runs starting at position 0 start from a zero state.
    Returns o [R, Hv, Dv] fp32; `state` is updated in place (with `log`: written back every log.period tokens).
    spec, draft: speculative verify (module doc)."""
    R, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    written_back = log is not None and log.period > 1
    if spec is not None:
        _check_spec(spec, R, positions)
        _check_draft(draft, state)
        if written_back:
            _check_log(log, state, positions)
        return _speculative_ref(q, k, v, a, b, A, dt_bias, state, log if written_back else None, slots, positions,
                                _bounds(R, seq_len, slots, positions, runs), spec, draft)
    if written_back:
        _check_log(log, state, positions)
        if runs is not None:
            bounds = _run_bounds(runs, R, slots)
        else:
            _runs(R, seq_len, slots, positions)      # checks that the rows split into runs of seq_len
            bounds = [(s, s + seq_len) for s in range(0, R, seq_len)]
        return _written_back_ref(q, k, v, a, b, A, dt_bias, state, log, slots, positions, bounds)
    if runs is not None:
        out = torch.zeros(R, hv, dv, dtype=torch.float32, device=v.device)
        for s, e in _run_bounds(runs, R, slots):
            out[s:e] = gdn_step_ref(q[s:e], k[s:e], v[s:e], a[s:e], b[s:e], A, dt_bias, state, slots[s:e],
                                    None if positions is None else positions[s:e], seq_len=e - s)
        return out
    run_slots, live, fresh = _runs(R, seq_len, slots, positions)
    _zero_fresh(state, run_slots, live, fresh)
    n, T = R // seq_len, seq_len
    qn = l2norm(q.float()) * dk ** -0.5
    kn = l2norm(k.float())
    r = hv // hk
    qn, kn = qn.repeat_interleave(r, dim=1), kn.repeat_interleave(r, dim=1)
    beta = torch.sigmoid(b.float())
    g = A.float() * F.softplus(a.float() + dt_bias.float())
    out = torch.zeros(n, T, hv, dv, dtype=torch.float32, device=v.device)
    if bool(live.any()):
        rs = lambda t: t.reshape(n, T, *t.shape[1:])[live]  # noqa: E731
        out[live] = delta_rule(rs(qn), rs(kn), rs(v.float()), rs(g), rs(beta), state, run_slots[live])
    return out.reshape(R, hv, dv)


def _written_back_ref(q, k, v, a, b, A, dt_bias, state, log: UpdateLog, slots, positions, bounds) -> torch.Tensor:
    """The recurrence with the state written back every log.period tokens (module doc), one run at a time: the
    definition of what the base state and the log hold."""
    R, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    M = log.period
    qn = (l2norm(q.float()) * dk ** -0.5).repeat_interleave(hv // hk, dim=1)
    kv_ = l2norm(k.float()).repeat_interleave(hv // hk, dim=1)   # [R, Hv, Dk]
    beta = torch.sigmoid(b.float())
    e_all = (A.float() * F.softplus(a.float() + dt_bias.float())).exp()
    rnd = (lambda t: t.to(state.dtype).float()) if state.dtype != torch.float32 else (lambda t: t)  # noqa: E731
    out = torch.zeros(R, hv, dv, dtype=torch.float32, device=v.device)
    for s0, s1 in bounds:
        slot = int(slots[s0])
        if slot < 0:
            continue
        p0, p_last = int(positions[s0]), int(positions[s0]) + (s1 - s0) - 1
        S = materialize_state(state, log, slot, p0)
        last_aligned = p_last - (p_last + slot + 1) % M
        for row in range(s0, s1):
            p = p0 + row - s0
            S = S * e_all[row, :, None, None]
            recall = (S * kv_[row, :, :, None]).sum(-2)          # S^T k  [Hv, Dv]
            delta = beta[row, :, None] * (v[row].float() - recall)
            S = rnd(S + kv_[row, :, :, None] * delta[:, None, :])
            out[row] = (S * qn[row, :, :, None]).sum(-2)
            ph = (p + slot) % M
            if ph == M - 1:
                if p == last_aligned:
                    state[slot] = S.to(state.dtype)
            elif p > last_aligned:                          # every column block's copy of k and e alike
                log.k[slot, :, :, ph] = kv_[row, :, None]
                log.decay[slot, :, :, ph] = e_all[row, :, None]
                log.delta[slot, :, ph] = delta
    return out


def _conv_speculative_ref(x, ring, w, slots, positions, bounds, spec: SpecRows, draft: DraftLog) -> torch.Tensor:
    """conv_ring_update_ref with speculative verify (module doc), one run at a time: the definition. The ring a run
    starts from is the last K-1 inputs of (the ring ++ the kept rows of the slot's last verify run); a verify run
    leaves the ring there and keeps its rows' inputs in the draft log."""
    R, C = x.shape
    K = w.shape[1]
    out = torch.zeros(R, C, dtype=torch.float32, device=x.device)
    for s0, s1 in bounds:
        slot = int(slots[s0])
        if slot < 0:
            continue
        p0 = int(positions[s0])
        kept = int(spec.kept[s0]) if p0 > 0 else 0
        old = ring[slot] if p0 > 0 else torch.zeros_like(ring[slot])       # position 0: a new sequence
        history = torch.cat((old, draft.x[slot, :kept].t().to(ring.dtype)), dim=1)   # [C, K-1 + kept], oldest first
        committed = history[:, history.shape[1] - (K - 1):].clone()
        ring[slot] = committed
        out[s0:s1] = causal_conv(x[None, s0:s1], w, ring, torch.tensor([slot], device=ring.device))[0]
        if int(spec.verify[s0]):
            ring[slot] = committed          # the rows are drafts: the ring stays at the kept tokens
            draft.x[slot, :s1 - s0] = x[s0:s1].to(draft.x.dtype)
    return out


def _speculative_ref(q, k, v, a, b, A, dt_bias, state, log: UpdateLog | None, slots, positions, bounds,
                     spec: SpecRows, draft: DraftLog) -> torch.Tensor:
    """The recurrence with speculative verify (module doc), one run at a time: the definition of what a verify run
    leaves in the draft log and of how a slot's next run folds in the kept rows, the state written back every token
    (no log) or every log.period tokens as _written_back_ref does."""
    R, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    M = 1 if log is None else log.period
    rnd = (lambda t: t.to(state.dtype).float()) if state.dtype != torch.float32 else (lambda t: t)  # noqa: E731

    def inputs(row):
        """Row's q, k (normalised, per value head), e = exp(g) and beta: computed per row, so its bits do not depend
        on the other rows of the call (a verify run's rows and the kept rows fed alone meet the same numbers)."""
        qn = (l2norm(q[row].float()) * dk ** -0.5).repeat_interleave(hv // hk, dim=0)
        kn = l2norm(k[row].float()).repeat_interleave(hv // hk, dim=0)          # [Hv, Dk]
        e = (A.float() * F.softplus(a[row].float() + dt_bias.float())).exp()
        return qn, kn, e, torch.sigmoid(b[row].float())

    out = torch.zeros(R, hv, dv, dtype=torch.float32, device=v.device)
    for s0, s1 in bounds:
        slot = int(slots[s0])
        if slot < 0:
            continue
        p0 = int(positions[s0])
        kept = int(spec.kept[s0]) if p0 > 0 else 0
        verify = bool(int(spec.verify[s0]))
        start = p0 - kept                                   # the first token the state does not hold yet
        S = materialize_state(state, log, slot, start)
        last = p0 - 1 if verify else p0 + (s1 - s0) - 1     # the last token the state holds after this call
        last_aligned = last - (last + slot + 1) % M

        def commit(p, S, kk, e, delta):
            """Token p is in the state: with a log, its base or its log entry by the write-back schedule."""
            ph = (p + slot) % M
            if M == 1:
                return
            if ph == M - 1:
                if p == last_aligned:
                    state[slot] = S.to(state.dtype)
            elif p > last_aligned:
                log.k[slot, :, :, ph] = kk[:, None]
                log.decay[slot, :, :, ph] = e[:, None]
                log.delta[slot, :, ph] = delta

        for i in range(kept):       # the kept verify rows, as the tokens start .. p0 - 1: the bits they had then
            e, kk, delta = draft.decay[slot, :, 0, i], draft.k[slot, :, 0, i], draft.delta[slot, :, i]
            S = rnd(S * e[:, None, None] + kk[:, :, None] * delta[:, None, :])
            commit(start + i, S, kk, e, delta)
        if verify and M == 1 and kept:
            state[slot] = S.to(state.dtype)
        for row in range(s0, s1):
            t = row - s0
            qn, kn, e, beta = inputs(row)
            S = S * e[:, None, None]
            recall = (S * kn[:, :, None]).sum(-2)                # S^T k  [Hv, Dv]
            delta = beta[:, None] * (v[row].float() - recall)
            S = rnd(S + kn[:, :, None] * delta[:, None, :])
            out[row] = (S * qn[:, :, None]).sum(-2)
            if verify:                                           # every column block's copy of k and e alike
                draft.k[slot, :, :, t] = kn[:, None]
                draft.decay[slot, :, :, t] = e[:, None]
                draft.delta[slot, :, t] = delta
            else:
                commit(p0 + t, S, kn, e, delta)
        if M == 1 and not verify:
            state[slot] = S.to(state.dtype)
    return out


def materialize_state(state: torch.Tensor, log: UpdateLog | None, slot: int, position: int) -> torch.Tensor:
    """Slot `slot`'s state S after token position - 1 as fp32 [Hv, Dk, Dv], rebuilt from a pool written back every
    log.period tokens (the pool's slot itself with no log): what the next token at `position` starts from."""
    if log is None or log.period == 1:
        return state[slot].float() if position > 0 else torch.zeros_like(state[slot], dtype=torch.float32)
    M = log.period
    r = (position + slot) % M
    n = min(r, position)
    S = state[slot].float() if position > r else torch.zeros_like(state[slot], dtype=torch.float32)
    for j in range(r - n, r):
        S = S * log.decay[slot, :, 0, j, None, None] + log.k[slot, :, 0, j, :, None] * log.delta[slot, :, j, None, :]
        if state.dtype != torch.float32:
            S = S.to(state.dtype).float()
    return S


# --------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _load_input(p, mask, stride_s, like_ptr, SPLIT: tl.constexpr, RNE: tl.constexpr):
    """An input value in fp32: loaded, or (SPLIT > 0) a GEMM's SPLIT unreduced split-K partials stride_s apart,
    added and rounded to like_ptr's dtype as its reduce would have (kernels/splitk.py)."""
    if SPLIT > 0:
        v = split_sum(p, stride_s, mask, SPLIT, like_ptr, RNE)
    else:
        v = tl.load(p, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _run(run_ptr, slots_ptr, n, T, RAGGED: tl.constexpr):
    """Run n's first row, its length and its slot: rows n * T .. n * T + T - 1, or (RAGGED) runs[n] .. runs[n + 1] - 1,
    where an empty run gets slot -1 (nothing to do)."""
    if RAGGED:
        r0 = tl.load(run_ptr + n).to(tl.int64)
        T = tl.load(run_ptr + n + 1) - tl.load(run_ptr + n)
        slot = tl.load(slots_ptr + r0, mask=T > 0, other=-1).to(tl.int64)
    else:
        r0 = n.to(tl.int64) * T
        slot = tl.load(slots_ptr + r0).to(tl.int64)
    return r0, T, slot


@triton.jit
def _before_run(ring, drow, s, n_keep, old_ok, cm, C, K: tl.constexpr, SPEC: tl.constexpr):
    """Input s < 0 of a run (the one -s places before its first row) in fp32: from the slot's ring or, with SPEC,
    from the kept rows of the slot's last verify run, which follow the ring's (module doc: speculative verify)."""
    hh = (K - 1) + n_keep + s                  # its index in ring ++ kept rows, oldest first
    v = tl.load(ring + hh, mask=old_ok & (s < 0) & (hh < K - 1), other=0.0).to(tl.float32)
    if SPEC:
        d = tl.load(drow + (hh - (K - 1)) * C, mask=cm & (s < 0) & (hh >= K - 1), other=0.0).to(tl.float32)
        v = tl.where(hh >= K - 1, d, v)
    return v


@triton.jit
def _conv_ring_kernel(x_ptr, ring_ptr, w_ptr, out_ptr, slots_ptr, pos_ptr, like_ptr, run_ptr, kept_ptr, verify_ptr,
                      dx_ptr, C, T, D, stride_xr, stride_or, stride_xs,
                      K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_POS: tl.constexpr, SPLIT: tl.constexpr = 0,
                      RNE: tl.constexpr = False, RAGGED: tl.constexpr = False, SPEC: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # One program: BLOCK_C channels of one run, one channel per lane (1-D: no cross-lane selects). Each tap
    # is loaded where it lives -- the run's x rows, the old ring or (SPEC) the kept verify rows -- and summed in tap
    # order, as the reference does. Every ring and draft-log read comes before the barrier, every write after it.
    n = tl.program_id(0)
    cb = tl.program_id(1)
    r0, T, slot = _run(run_ptr, slots_ptr, n, T, RAGGED)
    if slot >= 0:
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        ring = ring_ptr + slot * C * (K - 1) + c * (K - 1)
        old_ok = cm
        if HAS_POS:  # a run at position 0 starts a sequence: its old ring counts as zeros, whatever the pool holds
            old_ok = cm & ((tl.zeros([BLOCK_C], tl.int32) + tl.load(pos_ptr + r0)) != 0)
        n_keep = 0
        moved = T       # the rows the ring moves past: all of them, none in a verify run
        drow = dx_ptr
        verify = 0
        if SPEC:
            n_keep = tl.where(tl.load(pos_ptr + r0) != 0, tl.load(kept_ptr + r0), 0).to(tl.int32)
            verify = (tl.load(verify_ptr + r0) != 0).to(tl.int32)
            moved = T * (1 - verify)
            drow = dx_ptr + slot * D * C + c
        for t in range(0, T):
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(K):
                # tap j of token t is input s = t - (K-1) + j of the run: x when s >= 0, else before the run
                s = tl.zeros([BLOCK_C], tl.int32) + (t - (K - 1) + j)
                vx = _load_input(x_ptr + (r0 + s) * stride_xr + c, cm & (s >= 0), stride_xs, like_ptr, SPLIT, RNE)
                vr = _before_run(ring, drow, s, n_keep, old_ok, cm, C, K, SPEC)
                w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
                acc += tl.where(s >= 0, vx, vr) * w
            y = acc / (1.0 + tl.exp(-acc))  # SiLU
            tl.store(out_ptr + (r0 + t) * stride_or + c, y, mask=cm)
        tl.debug_barrier()
        # new ring = the last K-1 inputs of (old ring ++ kept rows ++ the run's moved inputs), oldest first; column j
        # reads old column j + moved + n_keep >= j, so ascending j never reads a column it has already overwritten
        for j in tl.static_range(K - 1):
            s = tl.zeros([BLOCK_C], tl.int32) + (moved - (K - 1) + j)
            vx = _load_input(x_ptr + (r0 + s) * stride_xr + c, cm & (s >= 0), stride_xs, like_ptr, SPLIT, RNE)
            vr = _before_run(ring, drow, s, n_keep, old_ok, cm, C, K, SPEC)
            tl.store(ring + j, tl.where(s >= 0, vx, vr).to(ring_ptr.dtype.element_ty), mask=cm)
        if SPEC:
            if verify != 0:     # a verify run's inputs wait in the draft log for the target's verdict
                for t in range(0, T):
                    vx = _load_input(x_ptr + (r0 + t) * stride_xr + c, cm, stride_xs, like_ptr, SPLIT, RNE)
                    tl.store(drow + t * C, vx.to(dx_ptr.dtype.element_ty), mask=cm)


def _check_run_args(R: int, seq_len: int, runs: torch.Tensor | None) -> int:
    """The number of programs over the rows: R / seq_len runs, or one per ragged run (offsets int32 [n + 1])."""
    if runs is None:
        assert seq_len >= 1 and R % seq_len == 0, f"{R} rows do not split into runs of {seq_len}"
        return R // seq_len
    assert seq_len == 1, "ragged runs replace seq_len"
    assert runs.dtype == torch.int32 and runs.dim() == 1 and runs.numel() >= 2 and runs.is_contiguous()
    return runs.numel() - 1


def conv_ring_update_triton(x: torch.Tensor | SplitSums, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                            slots: torch.Tensor, positions: torch.Tensor | None = None, seq_len: int = 1,
                            out: torch.Tensor | None = None, block_c: int = CONV_BLOCK_C,
                            runs: torch.Tensor | None = None, spec: SpecRows | None = None,
                            draft: DraftLog | None = None) -> torch.Tensor:
    """x may be a GEMM's unreduced split-K partials (kernels/splitk.py): summed where loaded, the same bits as
    reducing them first (the ring keeps the rounded inputs). runs: the ragged runs' int32 row offsets (module doc;
    not checked here: that would read them on the host). spec, draft: speculative verify (module doc); a verify run
    holds at most draft.rows rows (not checked here either)."""
    sums = x if isinstance(x, SplitSums) else None
    if sums is not None:
        x = sums.ws[0]
    R, C = x.shape
    K = conv_weight.shape[1]
    assert K >= 2, "conv kernel needs K >= 2"
    assert conv_state.shape[1:] == (C, K - 1) and conv_state.is_contiguous(), conv_state.shape
    assert conv_weight.shape == (C, K) and conv_weight.is_contiguous()
    assert x.stride(1) == 1 and slots.shape == (R,) and slots.is_contiguous()
    assert positions is None or (positions.shape == (R,) and positions.is_contiguous())
    n_runs = _check_run_args(R, seq_len, runs)
    if spec is not None:
        _check_spec(spec, R, positions)
        _check_draft_inputs(draft, conv_state)
        assert spec.kept.is_contiguous() and spec.verify.is_contiguous()
    if out is None:
        out = torch.empty(R, C, dtype=torch.float32, device=x.device)
    assert out.shape == (R, C) and out.stride(1) == 1
    if R == 0:
        return out
    BLOCK_C = min(block_c, _next_pow2(C))
    grid = (n_runs, triton.cdiv(C, BLOCK_C))
    s_split, split, rne = split_args(sums)
    kept, verify, dx = (spec.kept, spec.verify, draft.x) if spec is not None else (slots, slots, conv_state)
    _conv_ring_kernel[grid](x, conv_state, conv_weight, out, slots, positions if positions is not None else slots,
                            sums.out if sums is not None else x, runs if runs is not None else slots,
                            kept, verify, dx, C, seq_len, draft.rows if spec is not None else 1,
                            x.stride(0), out.stride(0), s_split,
                            K=K, BLOCK_C=BLOCK_C, HAS_POS=positions is not None, SPLIT=split, RNE=rne,
                            RAGGED=runs is not None, SPEC=spec is not None,
                            num_warps=max(1, min(8, BLOCK_C // 128)),
                            **pdl.triton_opts(x.device))
    return out


@triton.jit
def _run_start(pos_ptr, kept_ptr, verify_ptr, r0, slot, HAS_POS: tl.constexpr, SPEC: tl.constexpr):
    """A run's first position p0, the first position its slot's state does not hold yet (p0 less the kept verify rows
    it folds in first: SPEC), and whether its rows are drafts to verify (1, SPEC) or tokens (0). An empty run
    (slot -1) reads nothing."""
    p0 = r0 * 0
    if HAS_POS:
        p0 = tl.load(pos_ptr + r0, mask=slot >= 0, other=0).to(tl.int64)
    p_start = p0
    verify = (r0 * 0).to(tl.int32)
    if SPEC:
        kept = tl.load(kept_ptr + r0, mask=slot >= 0, other=0).to(tl.int64)
        p_start = p0 - tl.where(p0 != 0, kept, 0)          # position 0 starts afresh: nothing to fold in
        verify = (tl.load(verify_ptr + r0, mask=slot >= 0, other=0) != 0).to(tl.int32)
    return p0, p_start, verify


@triton.jit
def _load_state(s_ptr, p_start, slot, h, vb, HV, DK, DV, BK: tl.constexpr, BV: tl.constexpr,
                HAS_POS: tl.constexpr, WB: tl.constexpr = 1):
    """Slot `slot`'s [BK, BV] fp32 tile of head h's state, columns vb * BV on, as the pool holds it for a run whose
    state starts at p_start (_run_start); zeros at position 0 (a new sequence: the pool's old contents are not read)
    and for an empty run (slot -1). WB > 1 (written back every WB tokens): the base state, zeros before the
    sequence's first aligned token."""
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    z = tl.zeros([BK, BV], tl.int64)
    sm = (kk < DK)[:, None] & (vv < DV)[None, :] & ((z + slot) >= 0)
    if HAS_POS:
        p = z + p_start
        if WB > 1:
            sm = sm & (p > (p + slot) % WB)
        else:
            sm = sm & (p != 0)
    sp_ptrs = s_ptr + ((tl.maximum(slot, 0) * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
    return tl.load(sp_ptrs, mask=sm, other=0.0, eviction_policy="evict_first").to(tl.float32)   # read once


@triton.jit
def _rank1(S, k, delta, s_ptr, BK: tl.constexpr, BV: tl.constexpr):
    """S + k delta^T as one explicit fma per element (so a replayed update rounds exactly as the step did), then
    rounded to the pool's dtype (bf16 pools: every token)."""
    S = tl.fma(tl.broadcast_to(k[:, None], (BK, BV)), tl.broadcast_to(delta[None, :], (BK, BV)), S)
    return S.to(s_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _replay_log(S, s_ptr, lk_ptr, ld_ptr, le_ptr, p0, slot, h, vb, kk, km, vv, vm, HV, DK, DV,
                WB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr):
    """The base state brought to token p0 - 1: the logged tokens since the slot's last aligned one, in order (this
    program's own copies of k and e). A loop of r iterations, each one round trip for its entry's loads: unrolled over
    all entries with masked loads, or with every entry loaded up front, it was slower (the select or the extra sums
    cost registers and shared-memory trips; kernels/PROBES.md, kernels/gdn.py: _replay_log)."""
    r = ((p0 + slot) % WB).to(tl.int32)
    own = ((slot * HV + h) * NVB + vb) * (WB - 1)
    for j in range(r - tl.minimum(r, p0.to(tl.int32)), r):
        kj = tl.load(lk_ptr + (own + j) * DK + kk, mask=km, other=0.0)
        dj = tl.load(ld_ptr + ((slot * HV + h) * (WB - 1) + j) * DV + vv, mask=vm, other=0.0)
        S = _rank1(S * tl.load(le_ptr + own + j), kj, dj, s_ptr, BK, BV)
    return S


@triton.jit
def _write_back(S, sp_ptrs, sm, lk_ptr, ld_ptr, le_ptr, p, p_last, last_aligned, slot, h, vb, kk, km, vv, vm, k, e,
                delta, s_ptr, HV, DK, DV, WB: tl.constexpr, NVB: tl.constexpr):
    """Token p is in the state now (written back every WB > 1 tokens): the run's last aligned token writes the new
    base, a token after it its log entry; tokens past p_last (a verify run's rows) write nothing."""
    ph = (p + slot) % WB
    if ph == WB - 1:
        if p == last_aligned:
            tl.store(sp_ptrs, S.to(s_ptr.dtype.element_ty), mask=sm, cache_modifier=".cs")
    elif (p > last_aligned) & (p <= p_last):
        own = ((slot * HV + h) * NVB + vb) * (WB - 1) + ph
        tl.store(ld_ptr + ((slot * HV + h) * (WB - 1) + ph) * DV + vv, delta, mask=vm)
        tl.store(lk_ptr + own * DK + kk, k, mask=km)
        tl.store(le_ptr + own, e)


@triton.jit
def _gdn_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dt_ptr, s_ptr, o_ptr, slots_ptr, pos_ptr, run_ptr,
                     lk_ptr, ld_ptr, le_ptr, kept_ptr, verify_ptr, dk_ptr, dd_ptr, de_ptr,
                     T, D, stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                     stride_ar, stride_br, stride_or, stride_oh,
                     HV, DK: tl.constexpr, DV: tl.constexpr, scale, eps,
                     GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SP_THRESH: tl.constexpr,
                     HAS_POS: tl.constexpr, RAGGED: tl.constexpr = False, STATE_EARLY: tl.constexpr = False,
                     PDL: tl.constexpr = False, NVB: tl.constexpr = 1, WB: tl.constexpr = 1,
                     SPEC: tl.constexpr = False):
    pid = tl.program_id(0)      # column block fastest, then head, then run: a slot's state read as one stretch
    vb = pid % NVB
    h = (pid // NVB) % HV
    n = pid // (NVB * HV)
    # STATE_EARLY: the run, its slot and its slot's state are read before the PDL wait (STATE_BEFORE_WAIT_MAX_RUNS: why
    # that is safe; the kept and verify inputs are step inputs like the positions); the q / k / v / gate inputs, which
    # the kernel before writes, only after it
    if STATE_EARLY:
        r0, T, slot = _run(run_ptr, slots_ptr, n, T, RAGGED)
        p0, p_start, verify = _run_start(pos_ptr, kept_ptr, verify_ptr, r0, slot, HAS_POS, SPEC)
        S = _load_state(s_ptr, p_start, slot, h, vb, HV, DK, DV, BK, BV, HAS_POS, WB)
    pdl.enter(PDL)  # kernels/pdl.py
    if not STATE_EARLY:
        r0, T, slot = _run(run_ptr, slots_ptr, n, T, RAGGED)
        p0, p_start, verify = _run_start(pos_ptr, kept_ptr, verify_ptr, r0, slot, HAS_POS, SPEC)
    if slot >= 0:
        hk = h // GROUP
        kk = tl.arange(0, BK)
        vv = vb * BV + tl.arange(0, BV)
        km = kk < DK
        vm = vv < DV
        sm = km[:, None] & vm[None, :]
        A = tl.load(A_ptr + h).to(tl.float32)
        dt = tl.load(dt_ptr + h).to(tl.float32)
        sp_ptrs = s_ptr + ((slot * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
        if not STATE_EARLY:
            S = _load_state(s_ptr, p_start, slot, h, vb, HV, DK, DV, BK, BV, HAS_POS, WB)
        # the last token the state holds after this call: a verify run's rows are not among them
        p_last = p0 + T - 1 - verify * T
        if WB > 1:      # written back every WB tokens: the base plus the logged tokens since (module doc)
            S = _replay_log(S, s_ptr, lk_ptr, ld_ptr, le_ptr, p_start, slot, h, vb, kk, km, vv, vm, HV, DK, DV,
                            WB, BK, BV, NVB)
            last_aligned = p_last - (p_last + slot + 1) % WB
        if SPEC:        # the kept rows of the slot's last verify run, as the tokens p_start .. p0 - 1
            own_d = ((slot * HV + h) * NVB + vb) * D
            n_keep = (p0 - p_start).to(tl.int32)
            for i in range(0, n_keep):
                e = tl.load(de_ptr + own_d + i)
                kj = tl.load(dk_ptr + (own_d + i) * DK + kk, mask=km, other=0.0)
                dj = tl.load(dd_ptr + ((slot * HV + h) * D + i) * DV + vv, mask=vm, other=0.0)
                S = _rank1(S * e, kj, dj, s_ptr, BK, BV)
                if WB > 1:
                    _write_back(S, sp_ptrs, sm, lk_ptr, ld_ptr, le_ptr, p_start + i, p_last, last_aligned, slot, h,
                                vb, kk, km, vv, vm, kj, e, dj, s_ptr, HV, DK, DV, WB, NVB)
            if WB == 1:     # a verify run keeps its rows out of the state: the state is the kept tokens'
                keep = (tl.zeros([BK, BV], tl.int32) + verify * n_keep) > 0
                tl.store(sp_ptrs, S.to(s_ptr.dtype.element_ty), mask=sm & keep, cache_modifier=".cs")
            tl.debug_barrier()      # every draft-log read before this run's rows overwrite it
        for t in range(0, T):
            r = r0 + t
            q = tl.load(q_ptr + r * stride_qr + hk * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + r * stride_kr + hk * stride_kh + kk, mask=km, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
            v = tl.load(v_ptr + r * stride_vr + h * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
            x = tl.load(a_ptr + r * stride_ar + h).to(tl.float32) + dt
            sp = tl.where(x > SP_THRESH, x, tl.log(1.0 + tl.exp(tl.minimum(x, SP_THRESH))))
            g = A * sp
            beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + r * stride_br + h).to(tl.float32)))
            e = tl.exp(g)
            S = S * e
            recall = tl.sum(S * k[:, None], axis=0)                       # S^T k  [BV]
            delta = beta * (v - recall)
            S = _rank1(S, k, delta, s_ptr, BK, BV)                        # bf16 pools: rounded every token
            o = tl.sum(S * q[:, None], axis=0)                            # S^T q after the update
            tl.store(o_ptr + r * stride_or + h * stride_oh + vv, o.to(o_ptr.dtype.element_ty), mask=vm)
            if WB > 1:
                _write_back(S, sp_ptrs, sm, lk_ptr, ld_ptr, le_ptr, p0 + t, p_last, last_aligned, slot, h, vb, kk,
                            km, vv, vm, k, e, delta, s_ptr, HV, DK, DV, WB, NVB)
            if SPEC:
                if verify != 0:     # a verify run's row: its update waits in the draft log for the target's verdict
                    tl.store(dd_ptr + ((slot * HV + h) * D + t) * DV + vv, delta, mask=vm)
                    tl.store(dk_ptr + (own_d + t) * DK + kk, k, mask=km)
                    tl.store(de_ptr + own_d + t, e)
        if WB == 1:
            if SPEC:
                tl.store(sp_ptrs, S.to(s_ptr.dtype.element_ty), mask=sm & ((tl.zeros([BK, BV], tl.int32) + verify)
                                                                            == 0), cache_modifier=".cs")
            else:
                tl.store(sp_ptrs, S.to(s_ptr.dtype.element_ty), mask=sm, cache_modifier=".cs")   # written once


def gdn_step_triton(q, k, v, a, b, A, dt_bias, state: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor | None = None, seq_len: int = 1,
                    out: torch.Tensor | None = None, block_v: int | None = None, num_warps: int | None = None,
                    runs: torch.Tensor | None = None, state_early: bool | None = None,
                    log: UpdateLog | None = None, spec: SpecRows | None = None,
                    draft: DraftLog | None = None) -> torch.Tensor:
    """log: the pool's UpdateLog when it is written back every log.period > 1 tokens (module doc); needs positions.
    spec, draft: speculative verify (module doc); a verify run holds at most draft.rows rows (not checked here)."""
    R, hk, dk = q.shape
    _, hv, dv = v.shape
    assert k.shape == q.shape and hv % hk == 0
    assert state.shape[1:] == (hv, dk, dv) and state.is_contiguous(), state.shape
    wb = 1 if log is None else log.period
    assert a.shape == (R, hv) and b.shape == (R, hv) and A.shape == (hv,) and dt_bias.shape == (hv,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert slots.shape == (R,) and slots.is_contiguous()
    assert positions is None or (positions.shape == (R,) and positions.is_contiguous())
    n_runs = _check_run_args(R, seq_len, runs)
    if out is None:
        out = torch.empty(R, hv, dv, dtype=torch.float32, device=v.device)
    assert out.shape == (R, hv, dv) and out.stride(2) == 1
    if R == 0:
        return out
    BV, nvb = column_blocks(hv, dv, block_v)
    if state_early is None:     # inside a CUDA graph's capture, up to STATE_BEFORE_WAIT_MAX_RUNS runs
        state_early = (n_runs <= STATE_BEFORE_WAIT_MAX_RUNS and v.is_cuda and torch.cuda.is_current_stream_capturing())
    if wb > 1:
        _check_log(log, state, positions, copies=nvb)
    if spec is not None:
        _check_spec(spec, R, positions)
        _check_draft(draft, state, copies=nvb)
        assert spec.kept.is_contiguous() and spec.verify.is_contiguous()
    drafts = (spec.kept, spec.verify, *draft[:3]) if spec is not None else (slots, slots, state, state, state)
    _gdn_step_kernel[(n_runs * hv * nvb,)](q, k, v, a, b, A, dt_bias, state, out, slots,
                           positions if positions is not None else slots, runs if runs is not None else slots,
                           *(log if wb > 1 else (state, state, state)), *drafts, seq_len,
                           draft.rows if spec is not None else 1,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           a.stride(0), b.stride(0), out.stride(0), out.stride(1),
                           hv, dk, dv, float(dk ** -0.5), L2NORM_EPS,
                           GROUP=hv // hk, BK=_next_pow2(dk), BV=BV, SP_THRESH=SOFTPLUS_THRESHOLD,
                           HAS_POS=positions is not None, RAGGED=runs is not None, STATE_EARLY=bool(state_early),
                           NVB=nvb, WB=wb, SPEC=spec is not None, num_warps=num_warps or GDN_WARPS,
                           **_reg_cap(q.device, wb),
                           **pdl.triton_opts(q.device))
    return out


def _reg_cap(device: torch.device, wb: int) -> dict:
    """The written-back form's register cap as a launch option (GDN_MAXNREG; none at WB = 1 or on the interpreter)."""
    return {"maxnreg": GDN_MAXNREG} if GDN_MAXNREG and wb > 1 and device.type == "cuda" else {}


def column_blocks(hv: int, dv: int, block_v: int | None = None) -> tuple[int, int]:
    """The GDN step's state columns per program (block_v, else the default) and its programs per value head."""
    bv = min(block_v or default_block_v(hv, dv), _next_pow2(dv))
    return bv, -(-dv // bv)


def default_block_v(hv: int, dv: int) -> int:
    """State columns per program: 64, whatever the batch. The tile's shape sets how Triton lays out the
    sums over Dk, so a BV that followed the row count (an earlier rule gave 16 to small batches) changed a
    slot's last bits with B, and B streams left the single stream. Why 64, and not a whole value head per program
    (which a gated norm fused into the step would need): kernels/PROBES.md, kernels/gdn.py: BLOCK_V."""
    return min(BLOCK_V, _next_pow2(dv))


# --------------------------------------------------------------------------------------------------
# the GDN layer's output: gated RMSNorm (norm first, then the SiLU gate), as Qwen35Model.gated_delta_net

def gated_rms_norm_ref(o: torch.Tensor, z: torch.Tensor | SplitSums, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, out_cols: torch.Tensor | None = None,
                       image: XImage | None = None) -> torch.Tensor:
    """o [R, Hv, Dv] fp32 (the delta rule's output), z [R, Hv, Dv] (the attn_gate projection, any row
    stride; or its GEMM's unreduced split-K partials, [R, Hv * Dv]): rms_norm(o) * weight * silu(z) per head in
    fp32, rounded once to z's dtype. Returns [R, Hv * Dv] (into `out` when given). out_cols [Hv * Dv]: column j of
    the result goes to column out_cols[j] (a permutation: the input order of a packed ssm_out kept in the file's
    column order)."""
    from onepass.kernels.rmsnorm import rms_norm_ref

    if isinstance(z, SplitSums):
        z = z.reduce().unflatten(1, o.shape[1:])

    y = (rms_norm_ref(o.float(), weight, eps) * F.silu(z.float())).to(z.dtype).flatten(1)
    if out_cols is not None:
        y = torch.empty_like(y).index_copy_(1, out_cols.long(), y)
    if image is not None:
        image.write_ref(y)
    return y if out is None else out.copy_(y)


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, cols_ptr, DV, eps, s_o0, s_o1, s_z0, s_z1, s_y0, s_zs, img_ptr,
                       img_q, BLOCK: tl.constexpr, HAS_COLS: tl.constexpr = False, SPLIT: tl.constexpr = 0,
                       RNE: tl.constexpr = False, IMG_BT: tl.constexpr = 1, IMG_NB: tl.constexpr = 1,
                       HAS_IMG: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # HAS_COLS: column j of the row goes to column cols[j] of y; SPLIT > 0: z is its GEMM's unreduced partials
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < DV
    o = tl.load(o_ptr + r * s_o0 + h * s_o1 + offs, mask=m, other=0.0).to(tl.float32)
    z = _load_input(z_ptr + r * s_z0 + h * s_z1 + offs, m, s_zs, y_ptr, SPLIT, RNE)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
    y = ((o * rstd) * w) * (z / (1.0 + tl.exp(-z)))
    col = h * DV + offs
    if HAS_COLS:
        col = tl.load(cols_ptr + col, mask=m, other=0)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * s_y0 + col, y, mask=m)
    if HAS_IMG:     # the output projection's staged x too (kernels/x_image.py), at the same column
        tl.store(img_ptr + image_offsets(r, col, img_q, IMG_BT, IMG_NB), y, mask=m)


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor | SplitSums, weight: torch.Tensor, eps: float,
                          out: torch.Tensor | None = None, out_cols: torch.Tensor | None = None,
                          image: XImage | None = None) -> torch.Tensor:
    """gated_rms_norm_ref on the GPU; z's split-K partials ([R, Hv * Dv]) are summed where loaded, the same bits
    as reducing them first. image: the output also stored there (kernels/x_image.py: ssm_out's staged x)."""
    R, hv, dv = o.shape
    sums = z if isinstance(z, SplitSums) else None
    if sums is not None:
        assert tuple(sums.shape) == (R, hv * dv) and sums.ws.stride(2) == 1, (tuple(o.shape), tuple(sums.shape))
        if out is not None and out.dtype != sums.dtype:
            z, sums = sums.finish().unflatten(1, (hv, dv)), None    # rounded to another dtype than out's: reduce first
        else:
            z = sums.ws[0].unflatten(1, (hv, dv))
    assert z.shape == o.shape and o.stride(2) == 1 and z.stride(2) == 1, (tuple(o.shape), tuple(z.shape))
    assert weight.shape == (dv,) and weight.is_contiguous()
    if out is None:
        out = torch.empty(R, hv * dv, dtype=sums.dtype if sums is not None else z.dtype, device=z.device)
    assert out.shape == (R, hv * dv) and out.stride(1) == 1
    assert out_cols is None or (out_cols.shape == (hv * dv,) and out_cols.is_contiguous())
    if image is not None:
        check_image(image, R, hv * dv, out.dtype, "gated_rms_norm")
    if R == 0:
        return out
    BLOCK = _next_pow2(dv)
    s_split, split, rne = split_args(sums)
    img, img_q, img_bt, img_nb, has_img = image_args(image, out)
    _gated_norm_kernel[(R, hv)](o, z, weight, out, out_cols if out_cols is not None else out, dv, float(eps),
                                o.stride(0), o.stride(1), z.stride(0), z.stride(1), out.stride(0), s_split, img, img_q,
                                BLOCK=BLOCK, HAS_COLS=out_cols is not None, SPLIT=split, RNE=rne, IMG_BT=img_bt,
                                IMG_NB=img_nb, HAS_IMG=has_img,
                                num_warps=1 if BLOCK <= 128 else 2,
                                **pdl.triton_opts(o.device))
    return out
