"""A serving job: a queue of requests through the scheduler, paged or contiguous KV, prefix caching,
on-device or host sampling; verified against the single-stream greedy output of each prompt."""
from __future__ import annotations

import random

from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request
from onepass.engine.serving_setup import ServingSetup
from onepass.engine.verify import degenerate_reason
from onepass.harness.build import draft_source
from onepass.harness.logs import log
from onepass.harness.spread import repeat, spreads


def make_requests(prompt: list[int], w) -> list[Request]:
    rng = random.Random(w.seed)
    lo = w.min_new_tokens or w.max_new_tokens
    return [Request(i, list(prompt), rng.randint(lo, w.max_new_tokens)) for i in range(w.num_requests)]


def setup_of(cfg, engine, drafts=None, spec_k: int = 0) -> ServingSetup:
    """The job's scheduler and kv_cache groups as the engine's serving setup (with a draft source: speculation)."""
    kvc, sc = cfg.kv_cache, cfg.scheduler
    return ServingSetup(engine, mode=sc.mode, prefill=sc.prefill, layout=kvc.layout, block_size=kvc.block_size,
                        num_blocks=kvc.num_blocks, prefix=kvc.prefix, token_budget=sc.token_budget,
                        prefix_burst=sc.prefix_burst, pool_vs_peak=kvc.pool_vs_peak, drafts=drafts, spec_k=spec_k)


def run_serving(cfg, built, ids: list[int], stop_ids: tuple[int, ...],
                sampling: SamplingParams) -> tuple[dict, dict, str, str]:
    kvc, sc, w, B = cfg.kv_cache, cfg.scheduler, cfg.workload, cfg.batch.size
    # the settings were checked before the model was built (harness/checks.py)
    dev, dt = built.device, built.dtype
    requests = make_requests(ids, w)
    longest = max(r.max_new_tokens for r in requests)
    single = built.run_static([ids], longest, sampling, stop_ids, "token", max_len=None)
    ref = single.outputs[0]

    def serve() -> tuple:
        """The whole queue once, on a setup of its own (requests carry their outputs, a pool its blocks)."""
        reqs = make_requests(ids, w)
        # scripted drafts: each request's future is the greedy single stream's (checks.py refuses them when sampling)
        drafts, k = draft_source(cfg, built.cfg.vocab_size, {r.rid: ref for r in reqs})
        engine, pinned = setup_of(cfg, built, drafts, k).build(reqs, sampling, cfg.sampling.on_device, stop_ids)
        res = engine.run(reqs, progress=cfg.progress)
        # the engine (its KV pool) is dropped here: only one pool is held at a time
        return reqs, pinned, k, res, engine.kv.nbytes, engine.sched.bm

    # measure.warmup untimed servings, then measure.repeats timed ones; the first timed one is verified and reported,
    # the rates of all of them give the spread
    served = []

    def timed() -> dict[str, float]:
        out = serve()
        served.append(out if not served else None)
        res = out[3]
        return {"throughput_tok_s": res.generated / res.wall_s, "requests_s": len(res.finished) / res.wall_s}

    rates = repeat(timed, cfg.measure, warm=serve)
    requests, pinned, k, res, kv_bytes, bm = served[0]

    # verify: greedy outputs equal the single-stream greedy output of the prompt, truncated to each length
    reasons = []
    if res.rejected or len(res.finished) != len(requests):
        reasons.append(f"{len(res.finished)} of {len(requests)} requests completed ({len(res.rejected)} rejected)")
    if sampling.greedy:
        bad = [r.rid for r in res.finished if r.output != ref[:len(r.output)]]
        if bad:
            reasons.append(f"{len(bad)} requests differ from the reference, first request {bad[0]}")
        degenerate = degenerate_reason(ref, single.logits_finite)
        reasons += [degenerate] if degenerate else []
        ok = not reasons
        line = (f"{len(res.finished)} requests completed, all equal to the single-stream greedy reference "
                f"(mutually prefix-consistent): {str(ok).lower()}")
        line += f" ({len(bad)} differ, first request {bad[0]})" if bad else ""
        line += f" (degenerate reference: {degenerate})" if degenerate else ""
    else:
        ok = not reasons
        line = f"{len(res.finished)}/{len(requests)} sampled requests completed: {str(ok).lower()}"
    for _, why in res.rejected:
        log.info(f"[serve] {why}")

    peer = {}
    if cfg.peer.enabled:
        from onepass.harness.peers import hf_model, hf_serving_rate

        hf = hf_model(built.cfg, built.weights, dev, dt)
        peer = hf_serving_rate(hf, [(r.prompt, r.max_new_tokens) for r in requests])
        mine = {r.rid: r.output for r in res.finished}
        agree = sum(mine.get(i) == o for i, o in enumerate(peer.pop("peer_outputs"))) / len(requests)
        peer.update(peer_agreement=agree)
        log.info(f"[peer] HF transformers continuous batching: {peer['peer_tok_s']:,.1f} gen tok/s, "
                 f"{peer['peer_requests_s']:.1f} req/s; same tokens on {agree:.0%} of requests")
        del hf

    steps = max(res.steps, 1)
    host_ms = sorted(h * 1e3 for h in res.host_s)
    metrics = {
        "throughput_tok_s": res.generated / res.wall_s, "requests_s": len(res.finished) / res.wall_s,
        "steps": res.steps, "verify_ok": int(ok), "reference_distinct_tokens": len(set(ref)),
        "slot_util": res.active_slot_steps / (steps * B),
        "prefill_tokens": res.prefill_rows, "generated_tokens": res.generated, "wall_s": res.wall_s,
        "step_ms_mean": res.wall_s / steps * 1e3, "host_ms_p50": host_ms[len(host_ms) // 2] if host_ms else 0.0,
        "host_ms_mean": sum(host_ms) / max(len(host_ms), 1),
        "d2h_bytes_per_step": res.d2h_bytes / steps, "kv_pool_mb": kv_bytes / 2**20, "rejected": len(res.rejected),
        "preemptions": sum(r.preemptions for r in res.finished), "pinned_prefix_tokens": pinned,
        "pdl": built.pdl_mode(),
    }
    metrics.update(spreads(rates), repeats=len(rates))   # the rates as the median of the timed servings
    metrics["per_stream_tok_s"] = metrics["throughput_tok_s"] / B
    if res.gpu_ms:  # device time per step from CUDA events; the rest of the wall time the GPU sat idle
        gpu = sum(res.gpu_ms) / len(res.gpu_ms)
        metrics.update(gpu_step_ms=gpu, host_over_gpu=metrics["host_ms_mean"] / gpu,
                       gpu_busy_frac=sum(res.gpu_ms) / 1e3 / res.wall_s)
    if peer:
        metrics.update(peer, speedup_vs_peer=metrics["throughput_tok_s"] / peer["peer_tok_s"])
    if k:
        metrics.update(spec_k=float(k), drafted=float(res.drafted), accepted=float(res.accepted),
                       acceptance_rate=res.accepted / res.drafted if res.drafted else 0.0)
    if bm is not None:
        metrics.update(kv_blocks=bm.num_blocks, peak_blocks=bm.peak_used,
                       peak_block_frac=bm.peak_used / (bm.num_blocks - 1))
    perf = (f"[perf] {sc.mode} B={B}, {len(requests)} requests, {kvc.layout} KV"
            f"{f' ({bm.num_blocks - 1} blocks, peak {bm.peak_used})' if bm else ''}, prefix {kvc.prefix}: "
            f"{res.steps} steps, {metrics['throughput_tok_s']:,.1f} gen tok/s, {metrics['requests_s']:.1f} req/s, "
            f"slot util {metrics['slot_util']:.1%}, prefill tokens {res.prefill_rows}, "
            f"host {metrics['host_ms_p50']:.2f} ms/step (p50), D2H {metrics['d2h_bytes_per_step']:,.0f} B/step")
    if k:
        perf += f", drafts k={k}: {metrics['acceptance_rate']:.0%} kept"
    if res.gpu_ms:
        perf += (f", GPU {metrics['gpu_step_ms']:.2f} ms/step, host/GPU {metrics['host_over_gpu']:.0%}, "
                 f"GPU busy {metrics['gpu_busy_frac']:.0%}")
    samples = "\n".join(f"request {r.rid} ({len(r.output)} tokens): {r.output}" for r in res.finished[:4]) + "\n"
    # metrics, artifacts, the [verify] line, the [perf] line, why the verdict failed ("" when it held)
    return metrics, {"samples.txt": samples}, line, perf, "; ".join(reasons)

