"""job=gdn_step: the fused Gated DeltaNet decode step on one Qwen3.8-27B layer (16 key / 48 value heads,
128 x 128 fp32 state per value head), B rows at B distinct slots of the state pool, inside a CUDA graph.

Ours (kernels/gdn.py gdn_step_triton) does everything a decode step of the layer needs after the conv:
q/k l2norm, g = A softplus(alpha + dt_bias), beta = sigmoid(b), the delta rule in place in the pool (state
read once, written once) and o = S^T q. The peer, flash-linear-attention's fused_recurrent_gated_delta_rule
(PyPI fla-core, `fla.ops.gated_delta_rule`), runs in the same job when importable: q/k l2norm in the kernel,
g and beta handed in precomputed (its API takes them as inputs: the gate math is not timed for it), initial
state in, final state out as a new tensor (no pool indexing, no write-back: less work than ours). Both are
timed with triton.testing.do_bench_cudagraph (replays of a captured graph), each timing a repeat of the measure
group (measure.warmup untimed, then the timed ones: harness/spread.py); if FLA cannot be captured its time is taken
eagerly and the run is tagged so (fla_graph = 0).

L2 residency: one layer's state at B=1 is 6.3 MB, well inside the H200's 50 MB L2, so replaying one layer
would time the cache. A decode step walks 48 such layers, so the graph runs one step on each of L layer
pools (L = 48, or fewer while L pools exceed 1 GiB) and the time per layer is the replay time / L.

Metrics: our_us, fla_us (per layer), floor_us (state bytes read + written / the device-to-device copy
bandwidth measured in the same job), speedup (fla / ours), floor_frac (floor / ours), our_bf16_us (a bf16
state pool), max_err / fla_max_err (vs the torch reference gdn_step_ref, relative to max |o|), verify_ok
(ours within 1e-4 and every row alone bitwise equal to the row in the batch). Each timed figure (TIMED) is the
median of its repeats with _p10 / _p90 / _cv beside it; a run where one varies more than measure.max_cv is noisy.
"""
from __future__ import annotations

import math

import torch

from onepass.harness.spread import timed_us
from onepass.kernels.errors import ConfigError

TIMED = ("our_us", "our_bf16_us", "fla_us")   # the timed figures, each with its spread: what the noise guard watches


def _layers(state_bytes: int) -> int:
    return max(2, min(48, math.ceil(2**30 / max(state_bytes, 1))))


def _bench(fn, graph: bool = True) -> float:
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50) / 1e3
    return triton.testing.do_bench(fn, rep=50) / 1e3


def _fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "no peer in this run"
        print(f"[peer] flash-linear-attention not importable ({type(e).__name__}: {e}); gdn_step runs without it")
        return None
    return fused_recurrent_gated_delta_rule


def step_metrics(times: dict[str, float], B: int, state_bytes: int, bw: float) -> dict[str, float]:
    """The figures made from the timed ones (spread dicts of TIMED, fla_us where the peer ran): the floor of the
    state read and written once at copy bandwidth bw, how much of it ours reaches, tok/s, the ratio to FLA."""
    ours = times["our_us"] / 1e6
    floor = 2 * state_bytes / bw
    out = {**times, "floor_us": floor * 1e6, "floor_frac": floor / ours, "copy_bw_tbps": bw / 1e12,
           "state_mb": state_bytes / 2**20, "throughput_tok_s": B / ours}
    if "fla_us" in times:
        out["speedup"] = times["fla_us"] / times["our_us"]
    return out


def gdn_step(m, batch: int, device: torch.device, dtype: torch.dtype, measure) -> tuple[dict, str]:
    import torch.nn.functional as F

    from onepass.harness.roofline import copy_bandwidth
    from onepass.kernels.gdn import gdn_step_ref, gdn_step_triton

    if device.type != "cuda":
        raise ConfigError("gdn_step times GPU kernels; it needs a CUDA device")
    B, hk, hv, D = batch, m.gdn_k_heads, m.gdn_v_heads, m.gdn_dim
    g = torch.Generator(device=device).manual_seed(0)
    rn = lambda *s, dt=torch.float32: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
    # post-conv activations as the decoder holds them: q|k|v in one fp32 row (views), alpha|beta in bf16
    conv = rn(B, 2 * hk * D + hv * D)
    q, k = conv[:, :hk * D].view(B, hk, D), conv[:, hk * D:2 * hk * D].view(B, hk, D)
    v = conv[:, 2 * hk * D:].view(B, hv, D)
    ab = rn(B, 2 * hv, dt=dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    A, dt = -torch.exp(rn(hv) * 0.5), rn(hv) * 0.5
    slots = torch.arange(B, device=device)
    positions = torch.full((B,), 7, device=device)  # continuing sequences (position 0 would skip the state read)
    state_bytes = B * hv * D * D * 4
    L = _layers(state_bytes)
    pools = [rn(B, hv, D, D) * 0.1 for _ in range(L)]
    out = torch.empty(B, hv, D, device=device)

    # correctness first (on copies), then timing
    ref_state = pools[0].clone()
    ref = gdn_step_ref(q, k, v, a, b, A, dt, ref_state, slots, positions)
    st = pools[0].clone()
    gdn_step_triton(q, k, v, a, b, A, dt, st, slots, positions, out=out)
    scale = ref.abs().max().clamp(min=1e-6)
    err = ((out - ref).abs().max() / scale).item()
    state_err = ((st - ref_state).abs().max() / ref_state.abs().max().clamp(min=1e-6)).item()
    invariant = True
    for r in sorted({0, B // 2, B - 1}):
        st1 = pools[0].clone()
        o1 = gdn_step_triton(q[r:r + 1], k[r:r + 1], v[r:r + 1], a[r:r + 1], b[r:r + 1], A, dt, st1,
                             slots[r:r + 1].clone(), positions[r:r + 1].clone())
        invariant &= torch.equal(o1[0], out[r]) and torch.equal(st1[r], st[r])
    del st, st1, ref_state

    def ours():
        for p in pools:
            gdn_step_triton(q, k, v, a, b, A, dt, p, slots, positions, out=out)

    times = timed_us("our_us", lambda: _bench(ours) / L, measure)
    pools16 = [p.to(torch.bfloat16) for p in pools[: max(2, L // 2)]]

    def ours16():
        for p in pools16:
            gdn_step_triton(q, k, v, a, b, A, dt, p, slots, positions, out=out)

    times.update(timed_us("our_bf16_us", lambda: _bench(ours16) / len(pools16), measure))
    metrics = {"max_err": err, "state_err": state_err, "layers_in_graph": L, "batch_invariant": int(invariant)}
    ok = err <= 1e-4 and state_err <= 1e-4 and invariant

    fla = _fla()
    if fla is not None:
        q4, k4 = q.to(dtype).unsqueeze(1), k.to(dtype).unsqueeze(1)  # [B, 1, H, D]: FLA takes bf16 activations
        v4 = v.to(dtype).unsqueeze(1)
        gg = (A * F.softplus(a.float() + dt)).unsqueeze(1)            # [B, 1, Hv] log decay
        bb = torch.sigmoid(b.float()).to(dtype).unsqueeze(1)
        try:
            o_fla, s_fla = fla(q4, k4, v4, g=gg, beta=bb, scale=D ** -0.5, initial_state=pools[0].clone(),
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            fla_ref = gdn_step_ref(q4[:, 0], k4[:, 0], v4[:, 0], a, b, A, dt, pools[0].clone(), slots, positions)
            metrics["fla_max_err"] = ((o_fla[:, 0].float() - fla_ref).abs().max()
                                      / fla_ref.abs().max().clamp(min=1e-6)).item()

            def peer():
                for p in pools:
                    fla(q4, k4, v4, g=gg, beta=bb, scale=D ** -0.5, initial_state=p, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)

            try:
                fla_t, graphed = timed_us("fla_us", lambda: _bench(peer) / L, measure), 1
            except Exception as e:  # noqa: BLE001 - FLA's wrapper may not be capturable; time it eagerly then
                print(f"[peer] FLA under a CUDA graph failed ({type(e).__name__}: {e}); timing it eagerly")
                torch.cuda.synchronize()
                fla_t, graphed = timed_us("fla_us", lambda: _bench(peer, graph=False) / L, measure), 0
            times.update(fla_t)
            metrics["fla_graph"] = graphed
        except Exception as e:  # noqa: BLE001 - a peer failure must not lose our numbers
            print(f"[peer] FLA fused_recurrent_gated_delta_rule failed: {type(e).__name__}: {e}")
    metrics.update(step_metrics(times, B, state_bytes, copy_bandwidth(device)), verify_ok=int(ok))
    line = (f"GDN step {hk}/{hv} heads x {D}x{D} fp32 state, B={B}: ours {metrics['our_us']:.1f} us/layer "
            f"±{metrics['our_us_cv']:.1%} over its repeats (bf16 state {metrics['our_bf16_us']:.1f}), floor "
            f"{metrics['floor_us']:.1f} us ({metrics['floor_frac']:.0%} reached)")
    if "fla_us" in metrics:
        line += (f"; FLA {metrics['fla_us']:.1f} us{'' if metrics['fla_graph'] else ' (eager)'}: "
                 f"{metrics['speedup']:.2f}x")
    line += f"; |err| {err:.1e} vs reference, batch invariant: {str(invariant).lower()}"
    return metrics, line
