"""One job: compose -> build -> run -> verify -> print -> record. The Hydra app calls `run_job`."""
from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from engine.errors import ConfigError
from engine.gguf_loader import load_gguf
from engine.kv_cache import ContiguousKVCache
from engine.models import build_model
from engine.sampler import SamplingParams
from engine.static_batch import StaticBatchResult, check_fits, generate_static
from engine.tokenizer import Tokenizer
from engine.verify import verify_greedy, verify_sampled
from harness import tracking
from harness.synth import resolve_gguf
from harness.workload import prompt_ids, workload_digest
from kernels.ops import get_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_engine(e) -> tuple[torch.device, torch.dtype, str]:
    if e.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"engine.device={e.device!r}; choose auto, cpu or cuda")
    if e.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device=cuda but torch sees no CUDA device; use engine.device=auto or cpu")
    dev = torch.device("cuda" if e.device == "auto" and torch.cuda.is_available() else e.device.replace("auto", "cpu"))
    if e.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif e.dtype in DTYPES:
        dtype = DTYPES[e.dtype]
    else:
        raise ConfigError(f"engine.dtype={e.dtype!r}; choose auto or one of {sorted(DTYPES)}")
    backend = "torch" if e.backend == "auto" else e.backend
    if e.threads > 0:
        torch.set_num_threads(e.threads)
    return dev, dtype, backend


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def peak_mem_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: the process peak RSS


def percentile_ms(xs: list[float], q: float) -> float:
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q)) * 1e3 if xs else 0.0


def decode_rate(r: StaticBatchResult) -> float:
    return r.decode_tokens / r.decode_s if r.decode_s > 0 else 0.0


def run_job(cfg, out_dir: Path) -> float:
    dev, dtype, backend = resolve_engine(cfg.engine)
    ops = get_ops(backend)
    t0 = time.perf_counter()
    gguf_path = resolve_gguf(cfg.model, progress=cfg.progress)
    mcfg, weights, _ = load_gguf(gguf_path, dtype=dtype, device=dev, progress=cfg.progress)
    tok = Tokenizer.from_gguf(gguf_path)
    model = build_model(mcfg, weights, ops)
    load_s = time.perf_counter() - t0

    w, B = cfg.workload, cfg.batch.size
    if B < 1:
        raise ConfigError(f"batch.size={B}; need at least one slot")
    if cfg.scheduler.mode != "static":
        raise ConfigError(f"scheduler.mode={cfg.scheduler.mode!r}: this build runs static batching only")
    if cfg.kv_cache.layout != "contiguous":
        raise ConfigError(f"kv_cache.layout={cfg.kv_cache.layout!r}: this build has the contiguous per-slot layout only")
    ids = prompt_ids(w, tok, mcfg.vocab_size)
    check_fits(len(ids), w.max_new_tokens, cfg.kv_cache.ctx)
    stop_ids = () if w.ignore_eos else (tok.stop_ids if tok else mcfg.eos_ids)
    sampling = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p, cfg.sampling.seed)
    run = dict(max_new_tokens=w.max_new_tokens, sampling=sampling, stop_ids=stop_ids, prefill=cfg.scheduler.prefill)
    print(f"[model] {mcfg.name or cfg.model.name}: {mcfg.arch}, {mcfg.n_layers} layers, dim {mcfg.dim}, vocab "
          f"{mcfg.vocab_size}; {gguf_path.name} loaded in {load_s:.1f}s on {dev} ({dtype}, {backend} kernels)")
    print(f"[workload] {w.name}: prompt {len(ids)} tokens x {B} slots, {w.max_new_tokens} new tokens, "
          f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}, prefill={cfg.scheduler.prefill}")

    # Warm both shapes first so neither timed run pays for first-call setup (allocator, kernel choice).
    for n in (1, B):
        generate_static(model, ContiguousKVCache(mcfg, n, cfg.kv_cache.ctx, dtype, dev), [ids] * n,
                        **{**run, "max_new_tokens": min(4, w.max_new_tokens)})
    # The single-stream run: the greedy reference and the "x single stream" baseline, same process.
    single = generate_static(model, ContiguousKVCache(mcfg, 1, cfg.kv_cache.ctx, dtype, dev), [ids], **run)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    kv = ContiguousKVCache(mcfg, B, cfg.kv_cache.ctx, dtype, dev)
    result = generate_static(model, kv, [ids] * B, progress=cfg.progress, **run)

    verdict = (verify_greedy(result.outputs, single.outputs[0]) if sampling.greedy
               else verify_sampled(result.outputs, sampling.temperature))
    tput, single_tput = decode_rate(result), decode_rate(single)
    metrics = {
        "throughput_tok_s": tput, "per_stream_tok_s": tput / B,
        "step_ms_p50": percentile_ms(result.step_s, 0.5), "step_ms_p90": percentile_ms(result.step_s, 0.9),
        "steps": len(result.step_s), "verify_ok": int(verdict.ok), "peak_mem_mb": peak_mem_mb(dev),
        "single_stream_tok_s": single_tput, "speedup_vs_single": tput / single_tput if single_tput else 0.0,
        "prefill_ms": result.prefill_s * 1e3, "generated_tokens": result.generated_tokens,
        "e2e_tok_s": result.generated_tokens / (result.prefill_s + result.decode_s), "prompt_len": len(ids),
        "kv_cache_mb": kv.nbytes / 2**20, "load_s": load_s,
    }
    metrics.update({k: float(v) for k, v in verdict.detail.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    print(f"[verify] {verdict.line}")
    print(f"[perf] B={B}: {tput:,.1f} tok/s aggregate ({tput / B:,.1f} per stream, {metrics['speedup_vs_single']:.2f}x "
          f"single stream at {single_tput:,.1f} tok/s); step p50 {metrics['step_ms_p50']:.2f} ms, "
          f"p90 {metrics['step_ms_p90']:.2f} ms over {metrics['steps']} steps; prefill {metrics['prefill_ms']:.1f} ms; "
          f"peak mem {metrics['peak_mem_mb']:.0f} MB")

    resolved = OmegaConf.to_container(cfg, resolve=True)
    tags = {"table": cfg.table, "device": device_name(dev), "torch_version": torch.__version__,
            "triton_version": _triton_version(), "workload_hash": workload_digest([ids] * B, w),
            "model_file": gguf_path.name, "backend": backend, "dtype": str(dtype).removeprefix("torch."),
            "verify": verdict.line, **tracking.git_state()}
    sweep_id = os.environ.get(tracking.SWEEP_ENV)
    if sweep_id:
        tags["sweep_id"] = sweep_id
    record = tracking.new_record(f"{cfg.table} {cfg.model.name} B={B}", cfg.tracking.experiment,
                                 tracking.flatten(resolved), tags)
    record["metrics"] = metrics
    record["artifacts"] = {
        "config.yaml": OmegaConf.to_yaml(cfg, resolve=True),
        "samples.txt": _samples(tok, ids, single.outputs[0], result.outputs, cfg.verify.sample_streams),
        "step_times.json": {"decode_step_ms": [s * 1e3 for s in result.step_s], "prefill_ms": result.prefill_s * 1e3},
    }
    record["status"] = "FINISHED"
    tracking.finish(record, cfg.tracking, out_dir)
    return tput


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def _samples(tok: Tokenizer | None, prompt: list[int], reference: list[int], outputs: list[list[int]], n: int) -> str:
    show = (lambda ids: tok.decode(ids)) if tok else (lambda ids: " ".join(map(str, ids)))
    lines = [f"prompt: {show(prompt)!r}", f"single-stream reference: {show(reference)!r}"]
    lines += [f"slot {b}: {show(o)!r}" for b, o in enumerate(outputs[:n])]
    return "\n".join(lines) + "\n"
