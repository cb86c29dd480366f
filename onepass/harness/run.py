"""One job: compose -> build -> run -> verify -> print -> record. The Hydra app calls `run_job`."""
from __future__ import annotations

import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from onepass.engine.config import ModelConfig, RopeScaling
from onepass.engine.errors import ConfigError
from onepass.engine.gguf_loader import load_gguf, read_config
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.state_pool import HybridCache, check_hybrid_serving
from onepass.engine.static_batch import ReferenceStepper, StaticBatchResult, check_fits, run_static
from onepass.engine.tokenizer import Tokenizer
from onepass.engine.verify import verify_greedy, verify_sampled
from onepass.harness import tracking
from onepass.harness.checks import check_decode, check_micro, check_pool
from onepass.harness.roofline import copy_bandwidth, decode_floor_bytes, hybrid_floor_bytes, weight_bytes_per_step
from onepass.harness.synth import resolve_gguf, synthetic_config
from onepass.harness.workload import prompt_ids, workload_digest
from onepass.kernels import pdl
from onepass.kernels.ops import get_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Built:
    """A loaded model ready to make steppers: the reference model or the fused GPU decoder."""

    cfg: ModelConfig
    weights: dict
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    backend: str
    gguf_path: Path
    load_s: float
    engine_cfg: object
    model: object = None
    state_dtype: torch.dtype = torch.float32  # hybrid models: the recurrent state pool's dtype
    state_writeback: int = 0  # hybrid models: kv_cache.state_writeback (0: the engine's default, read per cache)

    def writeback(self) -> int:
        """The write-back period of the next state pool: the reference model's is always 1."""
        from onepass.engine.state_pool import resolve_writeback

        period = resolve_writeback(self.state_writeback, self.state_dtype)
        if self.backend == "torch" and period != 1:
            if self.state_writeback:     # asked for explicitly: refused rather than silently ignored
                raise ConfigError(f"kv_cache.state_writeback={self.state_writeback} runs in the fused decoder "
                                  "(engine.backend=triton); the torch reference writes the state every token: use 1")
            return 1
        return period

    def cache(self, slots: int, ctx: int):
        """A fresh KV cache of `slots` slots (a HybridCache: KV + recurrent state, for hybrid models)."""
        if self.cfg.arch == "qwen35":
            return HybridCache.create(self.cfg, slots, ctx, self.dtype, self.device, self.state_dtype,
                                      writeback=self.writeback())
        return ContiguousKVCache(self.cfg, slots, ctx, self.dtype, self.device)

    def stepper(self, batch: int, sampling: SamplingParams, ctx: int, max_len: int | None = None):
        """A fresh KV cache and stepper for `batch` slots whose positions stay below max_len (<= ctx)."""
        if self.backend == "torch":
            kv = self.cache(batch, ctx)  # hybrid: KV for the attention layers plus each slot's recurrent state
            return ReferenceStepper(self.model, kv, sampling, batch), kv
        from onepass.engine.runner import GraphStepper
        from onepass.kernels.decode_attention import make_workspace

        kv = self.cache(batch + 1, ctx)  # + the scratch slot
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        ws = lambda rows, n: make_workspace(rows, self.cfg.n_heads, self.cfg.head_dim, n, sms, self.device,  # noqa: E731
                                            kv_heads=self.cfg.n_kv_heads)
        return GraphStepper(self.model, kv, batch, sampling, self.engine_cfg.cuda_graphs, ws, max_len), kv


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
    backend = ("triton" if dev.type == "cuda" else "torch") if e.backend == "auto" else e.backend
    if backend not in ("torch", "triton"):
        raise ConfigError(f"engine.backend={e.backend!r}; choose auto, torch or triton")
    if backend == "triton" and dev.type != "cuda":
        raise ConfigError("engine.backend=triton needs a CUDA device; use engine.backend=torch on the CPU")
    if e.gemm not in ("triton", "cublas"):
        raise ConfigError(f"engine.gemm={e.gemm!r}; choose triton or cublas")
    if e.weights not in ("dequant", "packed"):
        raise ConfigError(f"engine.weights={e.weights!r}; choose dequant or packed")
    from onepass.kernels.int4_dispatch import POLICIES

    if e.int4 not in POLICIES:   # refused with dense weights too: a misspelled policy must not pass unnoticed
        raise ConfigError(f"engine.int4={e.int4!r}; choose one of {POLICIES}")
    if e.weights == "packed" and backend != "triton":
        raise ConfigError("engine.weights=packed runs on the triton backend (the torch reference model reads dense "
                          "weights); use engine.weights=dequant with engine.backend=torch")
    if e.threads < 0:
        raise ConfigError(f"engine.threads={e.threads}; 0 leaves torch's default, or give a positive thread count")
    if e.threads > 0:
        torch.set_num_threads(e.threads)
    return dev, dtype, backend


_IN_MEMORY: dict = {}  # the last in-memory synthetic model built, reused by the next job of a sweep


def _in_memory(cfg) -> bool:
    return cfg.model.synthetic is not None and not cfg.model.path and not cfg.model.package \
        and cfg.model.synthetic.materialize == "memory"


def build(cfg) -> Built:
    dev, dtype, backend = resolve_engine(cfg.engine)
    if cfg.kv_cache.state_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"kv_cache.state_dtype={cfg.kv_cache.state_dtype!r}; choose float32 or bfloat16")
    from onepass.engine.state_pool import resolve_writeback

    resolve_writeback(int(cfg.kv_cache.state_writeback))     # a negative period is refused before the model loads
    packed = cfg.engine.weights == "packed"
    if packed:
        from onepass.kernels.int4_dispatch import set_policy

        set_policy(cfg.engine.int4, max_batch=cfg.batch.size)   # the invariant pick for this engine's batch
    from onepass.kernels.int4_wgmma_ws import configure_ready

    configure_ready(bool(cfg.engine.ready_scales))   # read at each GEMM call, as the steppers made below warm up
    engine_key = {k: v for k, v in OmegaConf.to_container(cfg.engine).items()
                  if k not in ("pdl", "ready_scales")}  # same weights either way
    memo = (OmegaConf.to_yaml(cfg.model), str(engine_key), cfg.kv_cache.ctx, cfg.scheduler.mode)
    if _in_memory(cfg) and _IN_MEMORY.get("key") == memo:  # a sweep's next job: same weights, no regeneration
        b = _IN_MEMORY["built"]
        b.state_dtype = DTYPES[cfg.kv_cache.state_dtype]
        b.state_writeback = int(cfg.kv_cache.state_writeback)
        pdl.configure(bool(cfg.engine.pdl), cfg.batch.size, b.cfg.arch)   # as below: before any stepper is made
        return b
    _IN_MEMORY.clear()  # free the previous model before making another
    gguf_path = None if _in_memory(cfg) else resolve_gguf(cfg.model, progress=cfg.progress)
    # what the job may not do with this model, refused from its header before minutes of loading
    check_hybrid_serving(synthetic_config(cfg.model.name, cfg.model.synthetic) if gguf_path is None
                         else read_config(gguf_path), cfg.kv_cache.prefix)
    t0 = time.perf_counter()   # a synthetic file written on first use is not part of loading it
    if gguf_path is None:  # random weights made on the device under the loader's contract (harness/synth.py)
        from onepass.harness.synth import synthetic_in_memory

        mcfg, weights = synthetic_in_memory(cfg.model.name, cfg.model.synthetic, dtype, dev, packed)
        gguf_path, tokenizer = Path(f"{cfg.model.name}-in-memory"), None
    else:
        mcfg, weights, _ = load_gguf(gguf_path, dtype=dtype, device=dev, progress=cfg.progress, keep_quantized=packed)
        tokenizer = Tokenizer.from_gguf(gguf_path)
    if cfg.model.synthetic is not None and cfg.model.synthetic.rope_scaling and not cfg.model.path:
        mcfg = _with_scaling(mcfg)  # the file keeps only rope_freqs; the peer wants the parameters
    # PDL, its early trigger (per architecture) and the GEMMs' release, read at each launch / capture: this job's
    # steppers, all made after this, follow it
    pdl.configure(bool(cfg.engine.pdl), cfg.batch.size, mcfg.arch)
    b = Built(mcfg, weights, tokenizer, dev, dtype, backend, gguf_path, 0.0, cfg.engine,
              state_dtype=DTYPES[cfg.kv_cache.state_dtype], state_writeback=int(cfg.kv_cache.state_writeback))
    if mcfg.arch == "qwen35":
        b.writeback()   # a period the backend cannot run is refused before any run
    if backend == "torch":
        b.model = build_model(mcfg, weights, get_ops("torch"))
    elif mcfg.arch == "qwen35":
        from onepass.engine.fused_qwen35 import FusedQwen35Decoder
        from onepass.kernels.backend import get_step_kernels

        b.model = FusedQwen35Decoder(mcfg, weights, get_step_kernels("triton", cfg.engine.gemm), cfg.kv_cache.ctx + 1)
    else:
        from onepass.engine.fused_model import FusedDecoder
        from onepass.kernels.backend import get_step_kernels

        b.model = FusedDecoder(mcfg, weights, get_step_kernels("triton", cfg.engine.gemm), cfg.kv_cache.ctx + 1)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    b.load_s = time.perf_counter() - t0
    if _in_memory(cfg):
        _IN_MEMORY.update(key=memo, built=b)
    return b


def file_mb(path: Path) -> float:
    return path.stat().st_size / 2**20 if path.is_file() else 0.0  # in-memory synthetic models have no file


def weights_mb(weights: dict) -> float:
    """MiB the loaded weights hold on the device (packed projections: their packed bytes; a tensor under two names,
    a tied LM head, once)."""
    from onepass.engine.fused_model import tensor_bytes

    return sum(tensor_bytes(t) for t in {id(t): t for t in weights.values()}.values()) / 2**20


def _with_scaling(mcfg: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(mcfg, rope_scaling=RopeScaling())


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


def pdl_active(dev: torch.device, backend: str) -> int:
    """How this job's step kernels launch (pdl.mode): 0 plainly, 1 with PDL, 2 with the Triton kernels triggering
    their dependents early too, 4 with the CUDA GEMMs' late release as well (engine.pdl, the engine's batch, a GPU
    that has it; kernels/pdl.py)."""
    return pdl.mode(dev) if backend == "triton" else 0


def ready_scales_mb(dev: torch.device) -> float:
    """MiB the ready Q4_K scale words hold on dev (engine.ready_scales; made at each weight's first GEMM call), beside
    the weights' own bytes (weights_mb)."""
    from onepass.kernels.int4_wgmma_ws import ready_bytes

    return ready_bytes(dev) / 2**20 if dev.type == "cuda" else 0.0


def peak_mem_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: the process peak RSS


def percentile_ms(xs: list[float], q: float) -> float:
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q)) * 1e3 if xs else 0.0


def decode_rate(r: StaticBatchResult) -> float:
    return r.decode_tokens / r.decode_s if r.decode_s > 0 else 0.0


def sampling_params(cfg) -> SamplingParams:
    """The job's sampling group as SamplingParams (which refuses values out of range)."""
    s = cfg.sampling
    return SamplingParams(s.temperature, s.top_k, s.top_p, s.seed)


def run_job(cfg, out_dir: Path) -> float:
    if cfg.job != "decode":
        check_micro(cfg)
    if cfg.job == "int4_gemm":  # one job, one recorded run per (shape, format, B)
        from onepass.harness.int4_bench import run_int4_gemm

        return run_int4_gemm(cfg, out_dir)
    if cfg.job != "decode":
        from onepass.harness.micro import MICRO

        if cfg.job not in MICRO:
            raise ConfigError(f"job={cfg.job!r}; choose decode or one of {sorted(MICRO)}")
        return run_micro(cfg, out_dir)
    w, B = cfg.workload, cfg.batch.size
    check_decode(cfg, resolve_engine(cfg.engine)[2])
    sampling = sampling_params(cfg)
    built = build(cfg)
    mcfg, tok, dev, dtype = built.cfg, built.tokenizer, built.device, built.dtype
    ids = prompt_ids(w, tok, mcfg.vocab_size)
    check_pool(check_fits(len(ids), w.max_new_tokens, cfg.kv_cache.ctx), cfg.kv_cache, B)
    stop_ids = () if w.ignore_eos else (tok.stop_ids if tok else mcfg.eos_ids)
    ctx = cfg.kv_cache.ctx
    print(f"[model] {mcfg.name or cfg.model.name}: {mcfg.arch}, {mcfg.n_layers} layers, dim {mcfg.dim}, vocab "
          f"{mcfg.vocab_size}; {built.gguf_path.name} loaded in {built.load_s:.1f}s on {dev} ({str(dtype)[6:]}, "
          f"{built.backend} kernels{', CUDA graphs' if built.backend == 'triton' and cfg.engine.cuda_graphs else ''}"
          f"{', PDL' if pdl_active(dev, built.backend) else ''}; "
          f"weights {cfg.engine.weights}: {weights_mb(built.weights):,.0f} MiB on the device, file "
          f"{file_mb(built.gguf_path):,.0f} MiB)")
    print(f"[workload] {w.name}: prompt {len(ids)} tokens x {B} slots, {w.max_new_tokens} new tokens, "
          f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}, prefill={cfg.scheduler.prefill}")

    if cfg.scheduler.mode != "static":
        from onepass.harness.serve_job import run_serving

        metrics, artifacts, vline, perf = run_serving(cfg, built, ids, stop_ids, sampling)
        metrics.update(peak_mem_mb=peak_mem_mb(dev), prompt_len=len(ids), load_s=built.load_s,
                       ready_scales_mb=ready_scales_mb(dev))
        print(f"[verify] {vline}")
        print(perf)
        tags = {"workload_hash": workload_digest([ids], w), "model_file": built.gguf_path.name, "backend": built.backend,
                "dtype": str(dtype).removeprefix("torch."), "verify": vline}
        _record(cfg, f"{cfg.table} {cfg.model.name} B={B} {cfg.scheduler.mode}", dev, metrics, tags, artifacts, out_dir)
        return metrics["throughput_tok_s"]

    def run(batch: int, new_tokens: int, progress: bool = False) -> tuple[StaticBatchResult, object]:
        stepper, kv = built.stepper(batch, sampling, ctx, max_len=len(ids) + new_tokens)  # positions < P + new
        r = run_static(stepper, [ids] * batch, new_tokens, stop_ids, cfg.scheduler.prefill, ctx, progress)
        return r, kv

    for n in (1, B):  # warm both shapes so neither timed run pays first-call costs
        run(n, min(4, w.max_new_tokens))
    # The single-stream run: the greedy reference and the "x single stream" baseline, same process.
    single, _ = run(1, w.max_new_tokens)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    result, kv = run(B, w.max_new_tokens, cfg.progress)

    verdict = (verify_greedy(result.outputs, single.outputs[0]) if sampling.greedy
               else verify_sampled(result.outputs, sampling.temperature))
    tput, single_tput = decode_rate(result), decode_rate(single)
    metrics = {
        "throughput_tok_s": tput, "per_stream_tok_s": tput / B,
        "step_ms_p50": percentile_ms(result.step_s, 0.5), "step_ms_p90": percentile_ms(result.step_s, 0.9),
        "steps": len(result.step_s), "verify_ok": int(verdict.ok), "peak_mem_mb": peak_mem_mb(dev),
        "pdl": pdl_active(dev, built.backend),
        "single_stream_tok_s": single_tput, "speedup_vs_single": tput / single_tput if single_tput else 0.0,
        "prefill_ms": result.prefill_s * 1e3, "generated_tokens": result.generated_tokens,
        "e2e_tok_s": result.generated_tokens / (result.prefill_s + result.decode_s), "prompt_len": len(ids),
        "kv_cache_mb": kv.nbytes / 2**20, "load_s": built.load_s, "weights_mb": weights_mb(built.weights),
        "ready_scales_mb": ready_scales_mb(dev),
        "gguf_mb": file_mb(built.gguf_path),
    }
    metrics.update({k: float(v) for k, v in verdict.detail.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
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
    print(f"[verify] {verdict.line}")
    perf = (f"[perf] B={B}: {tput:,.1f} tok/s aggregate ({tput / B:,.1f} per stream, {metrics['speedup_vs_single']:.2f}x "
            f"single stream at {single_tput:,.1f} tok/s); step p50 {metrics['step_ms_p50']:.3f} ms, "
            f"p90 {metrics['step_ms_p90']:.3f} ms over {metrics['steps']} steps; prefill {metrics['prefill_ms']:.1f} ms; "
            f"peak mem {metrics['peak_mem_mb']:.0f} MB"
            + (f" (ready Q4_K scale words {metrics['ready_scales_mb']:,.0f} MB of it)" if metrics["ready_scales_mb"] else ""))
    if "floor_frac" in metrics:
        perf += f"; floor {metrics['step_floor_ms']:.3f} ms/step ({metrics['floor_frac']:.0%} reached)"
    print(perf)
    if cfg.peer.enabled and (not cfg.peer.batches or B in cfg.peer.batches):
        metrics.update(_peer(built, ids, B, w.max_new_tokens, tput))

    artifacts = {
        "samples.txt": _samples(tok, ids, single.outputs[0], result.outputs, cfg.verify.sample_streams),
        "step_times.json": {"decode_step_ms": [s * 1e3 for s in result.step_s], "prefill_ms": result.prefill_s * 1e3},
    }
    tags = {"workload_hash": workload_digest([ids], w), "model_file": built.gguf_path.name, "backend": built.backend,
            "dtype": str(dtype).removeprefix("torch."), "verify": verdict.line}
    _record(cfg, f"{cfg.table} {cfg.model.name} B={B}", dev, metrics, tags, artifacts, out_dir)
    return tput


def _hybrid_metrics(built: Built, kv, B: int, ids: list[int], single: StaticBatchResult, new_tokens: int, ctx: int,
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
        stepper, _ = built.stepper(1, SamplingParams(), ctx, max_len=len(ids) + new_tokens)
        ref = run_static(stepper, [ids], new_tokens, (), prefill, ctx).outputs[0]
        del stepper
        got = single.outputs[0]
        agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        out["bf16_state_greedy_agree"] = agree / max(len(ref), 1)
        logits = {}
        for dt in (torch.float32, bf16_state):
            built.state_dtype = dt
            logits[dt] = _teacher_forced_logits(built, ids, ref[:16], ctx)
    finally:
        built.state_dtype = bf16_state
    hi, lo = logits[torch.float32], logits[bf16_state]
    out["bf16_state_logit_err"] = ((lo - hi).abs().max() / hi.abs().max().clamp(min=1e-6)).item()
    out["bf16_state_top1_agree"] = (lo.argmax(-1) == hi.argmax(-1)).float().mean().item()
    return out


def _teacher_forced_logits(built: Built, ids: list[int], follow: list[int], ctx: int) -> torch.Tensor:
    """fp32 logits [1 + len(follow), V]: the prompt's last position, then each token of `follow` fed in turn
    (one slot, eager, either backend)."""
    m, dev, P = built.model, built.device, len(ids)
    kv = built.cache(2, ctx)
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    rows = []
    if built.backend == "torch":
        rows.append(m.forward(t([ids]), t([list(range(P))]), t([0]), kv))
        for i, tok in enumerate(follow):
            rows.append(m.forward(t([[tok]]), t([[P + i]]), t([0]), kv))
        return torch.cat(rows).float()
    from onepass.kernels.decode_attention import make_workspace

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws = lambda r: make_workspace(r, built.cfg.n_heads, built.cfg.head_dim, ctx, sms, dev,  # noqa: E731
                                  kv_heads=built.cfg.n_kv_heads)
    h = m.hidden(t(ids), t(list(range(P))), t([0] * P), kv, m.buffers(P), ws(P), seq_len=P)
    rows.append(m.logits(h[-1:].contiguous()))
    buf, ws1 = m.buffers(1), ws(1)
    for i, tok in enumerate(follow):
        rows.append(m.logits(m.hidden(t([tok]), t([P + i]), t([0]), kv, buf, ws1)).clone())
    return torch.cat(rows).float()


def run_micro(cfg, out_dir: Path) -> float:
    from onepass.harness.micro import MICRO

    dev, dtype, _ = resolve_engine(cfg.engine)
    metrics, line = MICRO[cfg.job](cfg.micro, cfg.batch.size, dev, dtype)
    print(f"[verify] {cfg.job}: {bool(metrics['verify_ok'])}".lower())
    print(f"[perf] {line}")
    _record(cfg, f"{cfg.table} B={cfg.batch.size}", dev, metrics, {"dtype": str(dtype).removeprefix("torch.")}, {}, out_dir)
    return metrics["throughput_tok_s"]


def _experiment_file() -> str | None:
    """The conf/experiment file this job was composed from (several files may feed one table)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("experiment")


def _record(cfg, name: str, dev: torch.device, metrics: dict, tags: dict, artifacts: dict, out_dir: Path) -> None:
    tags = {"table": cfg.table, "device": device_name(dev), "torch_version": torch.__version__,
            "triton_version": _triton_version(), **tags, **tracking.git_state()}
    if os.environ.get(tracking.SWEEP_ENV):
        tags["sweep_id"] = os.environ[tracking.SWEEP_ENV]
    if exp_file := _experiment_file():
        tags["experiment_file"] = exp_file
    record = tracking.new_record(name, cfg.tracking.experiment, tracking.flatten(OmegaConf.to_container(cfg, resolve=True)), tags)
    record["metrics"] = metrics
    record["artifacts"] = {"config.yaml": OmegaConf.to_yaml(cfg, resolve=True), **artifacts}
    record["status"] = "FINISHED"
    tracking.finish(record, cfg.tracking, out_dir)


def _peer(built: Built, ids: list[int], batch: int, new_tokens: int, ours: float) -> dict[str, float]:
    from onepass.harness.peers import hf_model, hf_static_generate_rate

    if built.device.type != "cuda":
        raise ConfigError("peer.enabled=true compares on the GPU (transformers' static cache is compiled for CUDA)")
    model = hf_model(built.cfg, built.weights, built.device, built.dtype)
    r = hf_static_generate_rate(model, ids, batch, new_tokens)
    del model
    torch.cuda.empty_cache()
    print(f"[peer] HF transformers generate(static cache, compiled) B={batch}: {r['peer_tok_s']:,.1f} tok/s "
          f"({r['peer_step_ms']:.2f} ms/step); onepass is {ours / r['peer_tok_s']:.2f}x")
    return {"peer_tok_s": r["peer_tok_s"], "peer_step_ms": r["peer_step_ms"], "peer_warmup_s": r["peer_warmup_s"],
            "speedup_vs_peer": ours / r["peer_tok_s"]}


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
