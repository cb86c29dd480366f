"""A serving job: a queue of requests through the scheduler, paged or contiguous KV, prefix caching,
on-device or host sampling; verified against the single-stream greedy output of each prompt."""
from __future__ import annotations

import math
import random

import torch

from onepass.engine.block_manager import BlockManager
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.runner import BUCKETS, bucket_for
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.engine.serve import ServingEngine
from onepass.engine.static_batch import run_static
from onepass.engine.verify import constant_reference_note
from onepass.harness.checks import pool_blocks
from onepass.harness.run import pdl_active
from onepass.kernels.backend import get_step_kernels


def make_requests(prompt: list[int], w) -> list[Request]:
    rng = random.Random(w.seed)
    lo = w.min_new_tokens or w.max_new_tokens
    return [Request(i, list(prompt), rng.randint(lo, w.max_new_tokens)) for i in range(w.num_requests)]


def fused_model(built, ctx: int):
    if built.backend != "torch":
        return built.model
    # CPU: the same fused step over the torch reference kernels
    if built.cfg.arch == "qwen35":
        from onepass.engine.fused_qwen35 import FusedQwen35Decoder

        return FusedQwen35Decoder(built.cfg, built.weights, get_step_kernels("torch"), ctx + 1)
    return FusedDecoder(built.cfg, built.weights, get_step_kernels("torch"), ctx + 1)


def prefix_burst(B: int, sc) -> int:
    """Rows a shared-prefix burst may add to a token-mode step: up to the largest CUDA-graph bucket."""
    return max(0, BUCKETS[-1] - B) if sc.prefix_burst else 0


def block_manager(blocks: int, kvc, hybrid: bool) -> BlockManager:
    """The job's paged-pool bookkeeping: a hybrid model shares a pinned prefix only whole (its state snapshot)."""
    return BlockManager(blocks, kvc.block_size, prefix_caching=kvc.prefix == "auto",
                        whole_pinned=hybrid and kvc.prefix == "pinned")


def peak_blocks(requests: list[Request], B: int, sc, kvc, pin: list[int] | None, hybrid: bool) -> int:
    """Peak block demand of this schedule, from a host-only dry run of the scheduler over an ample pool.
    Sampled tokens are stand-ins (0), so this is exact for fixed-length outputs (ignore_eos)."""
    bm = block_manager(B * (kvc.ctx // kvc.block_size + 1) + 2, kvc, hybrid)
    if pin:
        bm.pin_prefix(pin)
    mode = {"wave": "static", "continuous": "continuous"}[sc.mode]
    sched = Scheduler(B, mode, sc.prefill, sc.token_budget, bm, kvc.ctx, (), prefix_burst(B, sc))
    for r in requests:
        sched.add(Request(r.rid, list(r.prompt), r.max_new_tokens))
    while not sched.done:
        plan = sched.schedule()
        sched.finish_step(plan, [0] * sum(s.samples for s in plan.items))
    return bm.peak_used


def run_serving(cfg, built, ids: list[int], stop_ids: tuple[int, ...], sampling: SamplingParams) -> tuple[dict, dict, str, str]:
    kvc, sc, w, B = cfg.kv_cache, cfg.scheduler, cfg.workload, cfg.batch.size
    # the settings were checked before the model was built (harness/checks.py)
    model = fused_model(built, kvc.ctx)
    dev, dt = built.device, built.dtype
    requests = make_requests(ids, w)
    bm, hybrid = None, built.cfg.arch == "qwen35"
    if kvc.layout == "paged":
        blocks = pool_blocks(kvc, B)
        if kvc.pool_vs_peak > 0:
            peak = peak_blocks(requests, B, sc, kvc, ids if kvc.prefix == "pinned" else None, hybrid)
            blocks = math.ceil(kvc.pool_vs_peak * peak) + 1  # + the scratch block
        bm = block_manager(blocks, kvc, hybrid)
        kv = PagedKVCache(built.cfg, blocks, kvc.block_size, B, kvc.ctx, dt, dev)
    else:   # contiguous (harness/checks.py refused any other layout before the model loaded)
        kv = ContiguousKVCache(built.cfg, B + 1, kvc.ctx, dt, dev)
    if hybrid:  # + each slot's recurrent state; a slot restarting at position 0 starts from zero
        from onepass.engine.state_pool import HybridCache, StatePool, drop_recurrent_kv, snapshot_slots

        M, slots = built.writeback(), kv.num_slots
        if kvc.prefix == "pinned":   # + spare slots for the pinned prefix's state snapshots (one per phase class)
            slots = max(snapshot_slots(kv.num_slots, M, B)) + 1
        kv = HybridCache(drop_recurrent_kv(kv, built.cfg),
                         StatePool(built.cfg, slots, dev, built.state_dtype, conv_dtype=dt, writeback=M))
    mode = {"wave": "static", "continuous": "continuous"}[sc.mode]
    sched = Scheduler(B, mode, sc.prefill, sc.token_budget, bm, kvc.ctx, stop_ids, prefix_burst(B, sc))
    # every position stays below the longest request's length: the attention grid is sized for it
    max_len = min(kv.ctx, len(ids) + max((r.max_new_tokens for r in requests), default=1))
    ws = None
    if dev.type == "cuda" and built.backend == "triton":
        from onepass.kernels.decode_attention import make_workspace

        rows = sched.max_rows
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        ws = make_workspace(bucket_for(rows), built.cfg.n_heads, built.cfg.head_dim, max_len, sms, dev,
                            kv_heads=built.cfg.n_kv_heads)
    engine = ServingEngine(model, kv, sched, sampling, cfg.sampling.on_device,
                           use_graphs=cfg.engine.cuda_graphs and dev.type == "cuda", attn_workspace=ws,
                           max_len=max_len, time_steps=dev.type == "cuda")
    pinned = engine.pin_prefix(ids) if kvc.prefix == "pinned" else 0
    res = engine.run(requests, progress=cfg.progress)

    # verify: greedy outputs equal the single-stream greedy output of the prompt, truncated to each length
    longest = max(r.max_new_tokens for r in requests)
    stepper, _ = built.stepper(1, sampling, kvc.ctx)
    ref = run_static(stepper, [ids], longest, stop_ids, "token", kvc.ctx).outputs[0]
    if sampling.greedy:
        bad = [r.rid for r in res.finished if r.output != ref[:len(r.output)]]
        ok = not bad and not res.rejected and len(res.finished) == len(requests)
        line = (f"{len(res.finished)} requests completed, all equal to the single-stream greedy reference "
                f"(mutually prefix-consistent): {str(ok).lower()}")
        if bad:
            line += f" ({len(bad)} differ, first request {bad[0]})"
        line += constant_reference_note(ref)
    else:
        ok = len(res.finished) == len(requests) and not res.rejected
        line = f"{len(res.finished)}/{len(requests)} sampled requests completed: {str(ok).lower()}"
    for _, why in res.rejected:
        print(f"[serve] {why}")

    peer = {}
    if cfg.peer.enabled:
        from onepass.harness.peers import hf_model, hf_serving_rate

        hf = hf_model(built.cfg, built.weights, dev, dt)
        peer = hf_serving_rate(hf, [(r.prompt, r.max_new_tokens) for r in requests])
        mine = {r.rid: r.output for r in res.finished}
        agree = sum(mine.get(i) == o for i, o in enumerate(peer.pop("peer_outputs"))) / len(requests)
        peer.update(peer_agreement=agree)
        print(f"[peer] HF transformers continuous batching: {peer['peer_tok_s']:,.1f} gen tok/s, "
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
        "d2h_bytes_per_step": res.d2h_bytes / steps, "kv_pool_mb": kv.nbytes / 2**20, "rejected": len(res.rejected),
        "preemptions": sum(r.preemptions for r in res.finished), "pinned_prefix_tokens": pinned,
        "pdl": pdl_active(dev, built.backend),
    }
    metrics["per_stream_tok_s"] = metrics["throughput_tok_s"] / B
    if res.gpu_ms:  # device time per step from CUDA events; the rest of the wall time the GPU sat idle
        gpu = sum(res.gpu_ms) / len(res.gpu_ms)
        metrics.update(gpu_step_ms=gpu, host_over_gpu=metrics["host_ms_mean"] / gpu,
                       gpu_busy_frac=sum(res.gpu_ms) / 1e3 / res.wall_s)
    if peer:
        metrics.update(peer, speedup_vs_peer=metrics["throughput_tok_s"] / peer["peer_tok_s"])
    if bm is not None:
        metrics.update(kv_blocks=bm.num_blocks, peak_blocks=bm.peak_used, peak_block_frac=bm.peak_used / (bm.num_blocks - 1))
    perf = (f"[perf] {sc.mode} B={B}, {len(requests)} requests, {kvc.layout} KV"
            f"{f' ({bm.num_blocks - 1} blocks, peak {bm.peak_used})' if bm else ''}, prefix {kvc.prefix}: "
            f"{res.steps} steps, {metrics['throughput_tok_s']:,.1f} gen tok/s, {metrics['requests_s']:.1f} req/s, "
            f"slot util {metrics['slot_util']:.1%}, prefill tokens {res.prefill_rows}, host {metrics['host_ms_p50']:.2f} "
            f"ms/step (p50), D2H {metrics['d2h_bytes_per_step']:,.0f} B/step")
    if res.gpu_ms:
        perf += (f", GPU {metrics['gpu_step_ms']:.2f} ms/step, host/GPU {metrics['host_over_gpu']:.0%}, "
                 f"GPU busy {metrics['gpu_busy_frac']:.0%}")
    samples = "\n".join(f"request {r.rid} ({len(r.output)} tokens): {r.output}" for r in res.finished[:4]) + "\n"
    return metrics, {"samples.txt": samples}, line, perf  # metrics, artifacts, [verify] line, [perf] line

