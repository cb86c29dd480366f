"""The decode job: the engine from the config, the single-stream reference, the batched run or the served queue,
the verification, the printed lines and the run record."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from onepass.engine.engine import Engine
from onepass.engine.sampler import SamplingParams
from onepass.engine.runner import StaticBatchResult, check_fits
from onepass.engine.step import bucket_for
from onepass.engine.tokenizer import Tokenizer
from onepass.engine.verify import verify_greedy, verify_sampled
from onepass.harness.build import build, draft_source, resolve_engine, sampling_params
from onepass.harness.checks import check_decode, check_pool
from onepass.harness.job import RunRecord
from onepass.harness.logs import log
from onepass.harness.noise import CpuWindow, guard
from onepass.harness.spread import check_measure, repeat, spread, spreads
from onepass.harness.usage import Energy, JobUsage
from onepass.harness.roofline import copy_bandwidth, decode_floor_bytes, hybrid_floor_bytes, weight_bytes_per_step
from onepass.harness.serve_job import run_serving
from onepass.harness.workload import prompt_ids, workload_digest
from onepass.kernels.errors import ConfigError


def file_mb(path: Path) -> float:
    return path.stat().st_size / 2**20 if path.is_file() else 0.0  # in-memory synthetic models have no file


def weights_mb(weights: dict) -> float:
    """MiB the loaded weights hold on the device (packed projections: their packed bytes; a tensor under two names,
    a tied LM head, once)."""
    from onepass.engine.fused_model import tensor_bytes

    return sum(tensor_bytes(t) for t in {id(t): t for t in weights.values()}.values()) / 2**20


def ready_scales_mb(dev: torch.device) -> float:
    """MiB the ready Q4_K scale words hold on dev (engine.ready_scales; made at each weight's first GEMM call), beside
    the weights' own bytes (weights_mb)."""
    from onepass.kernels.int4_wgmma_ws import ready_bytes

    return ready_bytes(dev) / 2**20 if dev.type == "cuda" else 0.0


def percentile_ms(xs: list[float], q: float) -> float:
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q)) * 1e3 if xs else 0.0


def decode_rate(r: StaticBatchResult) -> float:
    return r.decode_tokens / r.decode_s if r.decode_s > 0 else 0.0


class DecodeJob:
    """A model decoding its workload: one static batch checked against the single stream (scheduler.mode=static),
    or a queue of requests served in waves or continuously, each checked against its prompt's single stream."""

    # the config sections a decode run reads: its params in the store
    sections = ("model", "batch", "kv_cache", "scheduler", "sampling", "workload", "engine", "speculative", "verify",
                "peer", "measure", "job", "table")

    def __init__(self, name: str = "decode"):
        self.name = name

    def check(self, cfg) -> None:
        """What the config alone can refuse, before any model loads (harness/preflight.py)."""
        dev, _, backend = resolve_engine(cfg.engine)
        check_decode(cfg, backend)
        check_measure(cfg.measure)
        sampling_params(cfg)
        if cfg.peer.enabled and cfg.scheduler.mode == "static" and dev.type != "cuda":
            raise ConfigError("peer.enabled=true compares against HF transformers on the GPU (its static cache is "
                              f"compiled for CUDA), and this job runs on {dev.type}; set peer.enabled=false")

    def run(self, cfg) -> Iterator[RunRecord]:
        with JobUsage(resolve_engine(cfg.engine)[0]) as usage:
            record = decode_run(cfg, usage)
        record.metrics.update(usage.metrics())
        yield record


def decode_run(cfg, usage: JobUsage) -> RunRecord:
    w, B = cfg.workload, cfg.batch.size
    DecodeJob().check(cfg)
    sampling = sampling_params(cfg)
    built = build(cfg)
    mcfg, tok, dev, dtype = built.cfg, built.tokenizer, built.device, built.dtype
    ids = prompt_ids(w, tok, mcfg.vocab_size)
    check_pool(check_fits(len(ids), w.max_new_tokens, cfg.kv_cache.ctx), cfg.kv_cache, B)
    stop_ids = () if w.ignore_eos else (tok.stop_ids if tok else mcfg.eos_ids)
    ctx = cfg.kv_cache.ctx
    log.info(f"[model] {mcfg.name or cfg.model.name}: {mcfg.arch}, {mcfg.n_layers} layers, dim {mcfg.dim}, vocab "
             f"{mcfg.vocab_size}; {built.source.name} loaded in {built.load_s:.1f}s on {dev} ({str(dtype)[6:]}, "
             f"{built.backend} kernels{', CUDA graphs' if built.backend == 'triton' and cfg.engine.cuda_graphs else ''}"
             f"{', PDL' if built.pdl_mode() else ''}; "
             f"weights {cfg.engine.weights}: {weights_mb(built.weights):,.0f} MiB on the device, file "
             f"{file_mb(built.source):,.0f} MiB)")
    log.info(f"[workload] {w.name}: prompt {len(ids)} tokens x {B} slots, {w.max_new_tokens} new tokens, "
             f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}, "
             f"prefill={cfg.scheduler.prefill}")

    if cfg.scheduler.mode != "static":
        with CpuWindow() as window:
            metrics, artifacts, vline, perf, reason = run_serving(cfg, built, ids, stop_ids, sampling)
        metrics.update(usage.metrics(), prompt_len=len(ids), load_s=built.load_s, ready_scales_mb=ready_scales_mb(dev))
        log.info(f"[verify] {vline}")
        log.info(perf)
        tags = {"workload_hash": workload_digest([ids], w), "model_file": built.source.name, "backend": built.backend,
                "dtype": str(dtype).removeprefix("torch."), "verify": vline, **_reason_tag(reason),
                **_noise(metrics, window, usage, cfg.measure)}
        return RunRecord(f"B={B} {cfg.model.name} {cfg.scheduler.mode}", dev, metrics, tags, artifacts)

    def run(batch: int, new_tokens: int, progress: bool = False, drafts=None, k: int = 0
            ) -> tuple[StaticBatchResult, object]:
        r = built.run_static([ids] * batch, new_tokens, sampling, stop_ids, cfg.scheduler.prefill, progress,
                             drafts=drafts, spec_k=k)
        return r, r.cache

    # The single stream (the greedy reference and the "x single stream" baseline, same process), then the batch: each
    # warmed on its shape (no timed run pays first-call costs), then timed measure.repeats times; the first run of
    # each is the one verified. CPU contention and the card's energy are read over the timed runs.
    warm = min(4, w.max_new_tokens)
    with CpuWindow() as window:
        singles = repeat(lambda: run(1, w.max_new_tokens)[0], cfg.measure, warm=lambda: run(1, warm))
        with Energy(usage.gpu) as energy:
            batches = repeat(lambda: run(B, w.max_new_tokens, cfg.progress)[0], cfg.measure, warm=lambda: run(B, warm))
    single, result = singles[0], batches[0]
    kv = result.cache
    spec_metrics, spec_line = {}, ""
    drafts, k = (draft_source(cfg, mcfg.vocab_size, dict(enumerate(result.outputs)))
                 if cfg.speculative.method != "off" else (None, 0))
    if drafts is not None:   # the same batch again with drafts: token for token the same output
        plain = result
        result, kv = run(B, w.max_new_tokens, cfg.progress, drafts, k)
        spec_metrics = speculation_metrics(result, plain, B, k)
        same = result.outputs == plain.outputs
        spec_metrics["spec_same_tokens"] = int(same)
        spec_line = (f"; with {cfg.speculative.method} drafts (k={k}) token for token the run without: "
                     f"{str(same).lower()}")

    step_metrics = _step_baseline(built, cfg.measure, lambda: run(B, w.max_new_tokens)[0], lambda: run(B, warm),
                                  result, metrics_of=lambda rs: spreads([timed(r, B) for r in rs]), prompt=len(ids))
    verdict = (verify_greedy(result.outputs, single.outputs[0], single.logits_finite) if sampling.greedy
               else verify_sampled(result.outputs, sampling.temperature))
    if spec_line:
        same = bool(spec_metrics["spec_same_tokens"])
        verdict = replace(verdict, ok=verdict.ok and same, line=verdict.line + spec_line,
                          reason="; ".join(r for r in (verdict.reason, "" if same else "speculation changed the tokens")
                                           if r))
    # every timed figure as the median of its repeats with the spread beside it (a speculative batch: its one run)
    metrics = {**spreads([timed(r, B) for r in (batches if not spec_metrics else [result])]),
               **spread("single_stream_tok_s", [decode_rate(r) for r in singles])}
    tput, single_tput = metrics["throughput_tok_s"], metrics["single_stream_tok_s"]
    metrics.update({
        "steps": len(result.step_s), "verify_ok": int(verdict.ok), "repeats": len(batches), **usage.metrics(),
        "pdl": built.pdl_mode(), "speedup_vs_single": tput / single_tput if single_tput else 0.0,
        "generated_tokens": result.generated_tokens, "prompt_len": len(ids),
        "kv_cache_mb": kv.nbytes / 2**20, "load_s": built.load_s, "weights_mb": weights_mb(built.weights),
        "ready_scales_mb": ready_scales_mb(dev),
        "gguf_mb": file_mb(built.source),
    })
    if energy.joules is not None:   # the card's energy over the timed batches, per token they made
        metrics["joules_per_token"] = energy.joules / sum(r.generated_tokens for r in batches)
    metrics.update({k: float(v) for k, v in verdict.detail.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    metrics.update(spec_metrics)
    metrics.update(step_metrics)
    if step_metrics:
        metrics["speedup_vs_kernels"] = step_metrics["kernels_step_ms_p50"] / metrics["step_ms_p50"]
    if mcfg.arch == "qwen35":
        metrics.update(_hybrid_metrics(built, kv, B, ids, single, w.max_new_tokens, ctx, cfg.scheduler.prefill))
    if dev.type == "cuda":
        bw = copy_bandwidth(dev)
        floor_bytes = decode_floor_bytes(mcfg, dtype.itemsize, B, len(ids), len(result.step_s))
        if mcfg.arch == "qwen35":  # weights as held + recurrent state + attention-layer KV
            floor_bytes = hybrid_floor_bytes(mcfg, built.model.weight_bytes(), kv, B, len(ids), len(result.step_s))
        elif cfg.engine.weights == "packed" and hasattr(built.model, "weight_bytes"):  # the bytes the step reads
            floor_bytes += built.model.weight_bytes() - weight_bytes_per_step(mcfg, dtype.itemsize)
        metrics.update(copy_bw_tbps=bw / 1e12, step_floor_ms=floor_bytes / bw * 1e3,
                       floor_frac=floor_bytes / bw / (metrics["step_ms_p50"] / 1e3))
    log.info(f"[verify] {verdict.line}")
    perf = (f"[perf] B={B}: {tput:,.1f} tok/s aggregate (p10-p90 {metrics['throughput_tok_s_p10']:,.1f}-"
            f"{metrics['throughput_tok_s_p90']:,.1f} over {len(batches)} runs; {tput / B:,.1f} per stream, "
            f"{metrics['speedup_vs_single']:.2f}x single stream at {single_tput:,.1f} tok/s); "
            f"step p50 {metrics['step_ms_p50']:.3f} ms, p90 {metrics['step_ms_p90']:.3f} ms "
            f"over {metrics['steps']} steps; "
            f"prefill {metrics['prefill_ms']:.1f} ms; peak mem {metrics['peak_mem_mb']:.0f} MB"
            + (f" (ready Q4_K scale words {metrics['ready_scales_mb']:,.0f} MB of it)"
               if metrics["ready_scales_mb"] else ""))
    if "joules_per_token" in metrics:
        perf += f"; {metrics['joules_per_token']:.3f} J/token"
    if "floor_frac" in metrics:
        perf += f"; floor {metrics['step_floor_ms']:.3f} ms/step ({metrics['floor_frac']:.0%} reached)"
    if step_metrics:
        m = step_metrics
        perf += (f"; the kernel-per-op step in this job: {m['kernels_step_ms_p50']:.3f} ms/step, "
                 f"{metrics['speedup_vs_kernels']:.2f}x to the {cfg.engine.step} step; tokens agree for "
                 f"{m['kernels_agree']:.0%} of the streams' length")
        if "step_picked_persistent" in m:
            picked = "persistent" if m["step_picked_persistent"] else "kernel-per-op"
            perf += f"; auto picked the {picked} step for B={B}"
            if getattr(built.model, "pick_why", None):
                perf += f" ({built.model.pick_why})"
            elif "pick_kernels_us" in m:
                perf += (f" (layers {m['pick_kernels_us']:.1f} us kernel-per-op, {m['pick_persistent_us']:.1f} us "
                         "persistent, as measured at capture; decided over rows "
                         f"{','.join(map(str, built.model.pick_rows))}, one form for every row count)")
            else:
                perf += " (not measured: auto's fallback)"
    if spec_metrics:
        m = spec_metrics
        perf += (f"; drafts k={m['spec_k']:.0f}: {m['tokens_per_step']:.2f} tokens a slot a step, "
                 f"{m['acceptance_rate']:.0%} of drafts kept, {m['speedup_vs_nonspec']:.2f}x the batch without "
                 f"drafts ({m['nonspec_tok_s']:,.1f} tok/s)")
    log.info(perf)
    if cfg.peer.enabled and (not cfg.peer.batches or B in cfg.peer.batches):
        metrics.update(_peer(built, ids, B, w.max_new_tokens, tput))

    artifacts = {
        "samples.txt": _samples(tok, ids, single.outputs[0], result.outputs, cfg.verify.sample_streams),
        "step_times.json": {"decode_step_ms": [s * 1e3 for s in result.step_s], "prefill_ms": result.prefill_s * 1e3,
                            "repeats_step_ms": [[s * 1e3 for s in r.step_s] for r in batches]},
    }
    tags = {"workload_hash": workload_digest([ids], w), "model_file": built.source.name, "backend": built.backend,
            "dtype": str(dtype).removeprefix("torch."), "verify": verdict.line, **_reason_tag(verdict.reason),
            **_noise(metrics, window, usage, cfg.measure)}
    return RunRecord(f"B={B} {cfg.model.name} static", dev, metrics, tags, artifacts)


def _step_baseline(built: Engine, measure, run, warm, result: StaticBatchResult, metrics_of, prompt: int
                   ) -> dict[str, float]:
    """With engine.step=persistent or auto: the same batch through the kernel-per-op step (same engine, same
    process), timed as the batch was; its step time, the speed-up over it, and how far the two steps' greedy tokens
    agree (their roundings differ: norms and attention sum in other orders). With auto, also the form picked for the
    batch's rows (`step_picked_persistent`) and the two forms' layer times that decided it."""
    if built.spec.step not in ("persistent", "auto"):
        return {}
    model = built.model
    pick = {}
    if built.spec.step == "auto" and getattr(model, "auto", False):
        rows = bucket_for(len(result.outputs))
        pick["step_picked_persistent"] = float(model.takes_persistent(rows))
        if rows in model.pick_us:
            pick["pick_kernels_us"], pick["pick_persistent_us"] = model.pick_us[rows]
    persistent = built.spec
    built.respec(replace(persistent, step="kernels"))
    try:
        runs = repeat(run, measure, warm=warm)
    finally:
        built.respec(persistent)
    m = metrics_of(runs)
    agree = []
    for a, b in zip(result.outputs, runs[0].outputs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n / max(len(a), 1))
    out = {"kernels_step_ms_p50": m["step_ms_p50"], "kernels_tok_s": m["throughput_tok_s"],
           "kernels_agree": sum(agree) / max(len(agree), 1), **pick}
    took_persistent = built.spec.step == "persistent" or pick.get("step_picked_persistent") == 1.0
    if built.device.type == "cuda" and took_persistent:   # each phase's time in one more launch, against its floor
        from onepass.kernels.persistent_step import phase_profile

        bw = copy_bandwidth(built.device)
        for phase, (us, sync, nbytes) in phase_profile(built.model, result.cache, len(result.outputs), prompt).items():
            out[f"phase_{phase}_us"], out[f"phase_{phase}_floor_us"] = us, nbytes / bw * 1e6
            out[f"phase_{phase}_sync_us"] = sync
    return out


def timed(r: StaticBatchResult, B: int) -> dict[str, float]:
    """One timed static batch's figures (the repeats' spread is taken of these)."""
    tput = decode_rate(r)
    return {"throughput_tok_s": tput, "per_stream_tok_s": tput / B, "step_ms_p50": percentile_ms(r.step_s, 0.5),
            "step_ms_p90": percentile_ms(r.step_s, 0.9), "prefill_ms": r.prefill_s * 1e3,
            "e2e_tok_s": r.generated_tokens / (r.prefill_s + r.decode_s)}


def _noise(metrics: dict, window: CpuWindow, usage: JobUsage, m) -> dict[str, str]:
    """The noise guard's tags for a decode run: the throughputs' spread, CPU contention, what NVML saw."""
    return guard(metrics, window.result, sorted(usage.gpu_events), m)


def _reason_tag(reason: str) -> dict[str, str]:
    """The verdict's reason as the run's `verify_reason` tag, when it failed."""
    return {"verify_reason": reason} if reason else {}


def speculation_metrics(spec: StaticBatchResult, plain: StaticBatchResult, B: int, k: int) -> dict[str, float]:
    """A speculative batch against the same batch without drafts: rates, and what a step made."""
    rate, base = decode_rate(spec), decode_rate(plain)
    steps = max(len(spec.step_s), 1)
    return {"spec_k": float(k), "nonspec_tok_s": base, "speedup_vs_nonspec": rate / base if base else 0.0,
            "drafted": float(spec.drafted), "accepted": float(spec.accepted),
            "acceptance_rate": spec.accepted / spec.drafted if spec.drafted else 0.0,
            "tokens_per_step": spec.decode_tokens / (B * steps),
            "nonspec_step_ms_p50": percentile_ms(plain.step_s, 0.5)}


def _hybrid_metrics(built: Engine, kv, B: int, ids: list[int], single: StaticBatchResult, new_tokens: int, ctx: int,
                    prefill: str) -> dict[str, float]:
    """State size per slot, and with a bf16 state pool what it costs against fp32 state: the greedy single
    stream rerun with fp32 state (leading tokens that agree), and teacher-forced logits of the prompt's last
    position plus 16 decode steps (tokens from the fp32 run) through both pools: max |logit error| relative
    to the logit scale and the fraction of positions whose argmax agrees."""
    st = kv.state
    out = {"state_mb_per_slot": st.nbytes / st.num_slots / 2**20, "state_writeback": float(st.writeback)}
    if built.state_dtype == torch.float32:
        return out
    bf16_state = built.state_dtype
    built.state_dtype = torch.float32
    try:
        ref = built.run_static([ids], new_tokens, SamplingParams(), (), prefill).outputs[0]
        got = single.outputs[0]
        agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        out["bf16_state_greedy_agree"] = agree / max(len(ref), 1)
        logits = {}
        for dt in (torch.float32, bf16_state):
            built.state_dtype = dt
            logits[dt] = built.teacher_forced_logits(ids, ref[:16])
    finally:
        built.state_dtype = bf16_state
    hi, lo = logits[torch.float32], logits[bf16_state]
    out["bf16_state_logit_err"] = ((lo - hi).abs().max() / hi.abs().max().clamp(min=1e-6)).item()
    out["bf16_state_top1_agree"] = (lo.argmax(-1) == hi.argmax(-1)).float().mean().item()
    return out


def _peer(built: Engine, ids: list[int], batch: int, new_tokens: int, ours: float) -> dict[str, float]:
    from onepass.harness.peers import hf_model, hf_static_generate_rate

    if built.device.type != "cuda":
        raise ConfigError("peer.enabled=true compares on the GPU (transformers' static cache is compiled for CUDA)")
    model = hf_model(built.cfg, built.weights, built.device, built.dtype)
    r = hf_static_generate_rate(model, ids, batch, new_tokens)
    del model
    torch.cuda.empty_cache()
    log.info(f"[peer] HF transformers generate(static cache, compiled) B={batch}: {r['peer_tok_s']:,.1f} tok/s "
             f"({r['peer_step_ms']:.2f} ms/step); onepass is {ours / r['peer_tok_s']:.2f}x")
    return {"peer_tok_s": r["peer_tok_s"], "peer_step_ms": r["peer_step_ms"], "peer_warmup_s": r["peer_warmup_s"],
            "speedup_vs_peer": ours / r["peer_tok_s"]}


def _samples(tok: Tokenizer | None, prompt: list[int], reference: list[int], outputs: list[list[int]], n: int) -> str:
    show = (lambda ids: tok.decode(ids)) if tok else (lambda ids: " ".join(map(str, ids)))
    lines = [f"prompt: {show(prompt)!r}", f"single-stream reference: {show(reference)!r}"]
    lines += [f"slot {b}: {show(o)!r}" for b, o in enumerate(outputs[:n])]
    return "\n".join(lines) + "\n"
