"""A job's settings checked before anything loads or touches a device. Each refusal names the setting, the value
and what to give instead; without these the same mistakes surfaced after minutes of loading, as a division by zero
or a kernel's assertion, or not at all (a nonsense value running as a default)."""
from __future__ import annotations

from onepass.kernels.errors import ConfigError
from onepass.engine.runner import PREFIX_MODES, check_new_tokens
from onepass.engine.scheduler import check_token_budget
from onepass.engine.serving_setup import pool_blocks
from onepass.engine.step import BUCKETS


def check_decode(cfg, backend: str) -> None:
    """A decode job (static batching or serving): batch, scheduler, workload and KV cache; backend is the resolved
    kernel backend (harness/build.py resolve_engine)."""
    w, sc, B = cfg.workload, cfg.scheduler, cfg.batch.size
    if B < 1:
        raise ConfigError(f"batch.size={B}; need at least one slot")
    if sc.mode not in ("static", "wave", "continuous"):
        raise ConfigError(f"scheduler.mode={sc.mode!r}; choose static, wave or continuous")
    if sc.mode == "static" and cfg.kv_cache.layout != "contiguous":
        raise ConfigError("static batching uses the contiguous KV layout; paged KV serves "
                          "scheduler.mode=wave|continuous")
    if sc.prefill == "chunked" and sc.mode != "static" and sc.token_budget > BUCKETS[-1]:
        raise ConfigError(f"scheduler.token_budget={sc.token_budget}: a step runs at most {BUCKETS[-1]} rows "
                          f"(the largest CUDA-graph bucket); set it to {BUCKETS[-1]} or less")
    if sc.mode != "static":   # the checks the serving loop and the request would make, before the model is built
        check_token_budget(sc.prefill, sc.token_budget, B)
    check_new_tokens(w.max_new_tokens)
    if not 0 <= w.min_new_tokens <= w.max_new_tokens:
        raise ConfigError(f"workload.min_new_tokens={w.min_new_tokens} with max_new_tokens={w.max_new_tokens}: "
                          "a serving request's length is drawn from [min, max]; give 0 (every request max) or "
                          "1..max_new_tokens")
    if w.num_requests < 0:
        raise ConfigError(f"workload.num_requests={w.num_requests}; 0 (a static batch) or a positive request count")
    if w.synthetic_prompt_len < 1:   # read when the model has no tokenizer (synthetic weights)
        raise ConfigError(f"workload.synthetic_prompt_len={w.synthetic_prompt_len}; a prompt needs at least one "
                          "token")
    if sc.mode != "static" and w.num_requests < 1:
        raise ConfigError(f"scheduler.mode={sc.mode} serves a stream of requests, and workload.num_requests=0 gives "
                          "none: pick a serving workload (workload=serve_p_short) or set workload.num_requests=N")
    if cfg.kv_cache.layout == "paged" and cfg.kv_cache.pool_vs_peak > 0 and not w.ignore_eos:
        raise ConfigError("kv_cache.pool_vs_peak sizes the pool from a dry run with fixed output lengths; "
                          "set workload.ignore_eos=true or give kv_cache.num_blocks")
    check_kv_cache(cfg.kv_cache, backend)
    check_speculative(cfg)


def check_kv_cache(kvc, backend: str) -> None:
    """The KV-cache settings a job would otherwise trip over after the model has loaded (or divide by zero on)."""
    if kvc.layout not in ("contiguous", "paged"):
        raise ConfigError(f"kv_cache.layout={kvc.layout!r}; choose contiguous or paged")
    if kvc.block_size < 1:
        raise ConfigError(f"kv_cache.block_size={kvc.block_size}; a block holds at least one position")
    bs = kvc.block_size
    if kvc.layout == "paged" and backend == "triton" and (bs < 16 or bs & (bs - 1)):
        raise ConfigError(f"kv_cache.block_size={bs}: the Triton paged attention reads blocks of a power of two >= 16 "
                          "positions; use 16, 32, 64, ...")
    if kvc.num_blocks != 0 and kvc.num_blocks < 2:
        raise ConfigError(f"kv_cache.num_blocks={kvc.num_blocks}; 0 sizes the pool from the slots and ctx, else give "
                          "at least 2 (block 0 is the scratch block)")
    if kvc.prefix not in PREFIX_MODES:
        raise ConfigError(f"kv_cache.prefix={kvc.prefix!r}; choose one of {', '.join(PREFIX_MODES)}")
    if kvc.prefix != "off" and kvc.layout != "paged":
        raise ConfigError(f"kv_cache.prefix={kvc.prefix} shares prefixes as shared KV blocks: it needs "
                          "kv_cache.layout=paged (kv_cache=paged)")
    if kvc.pool_vs_peak < 0:
        raise ConfigError(f"kv_cache.pool_vs_peak={kvc.pool_vs_peak}; 0 (off) or a positive multiple of the peak "
                          "block demand")


def check_speculative(cfg) -> None:
    """The speculative group, before the model loads: a known method, k drafts that fit the context, an MTP head where
    the drafts come from one (a synthetic model's shapes tell; a file's header is checked when the engine binds it)."""
    from onepass.engine.drafts import METHODS

    s, ctx = cfg.speculative, cfg.kv_cache.ctx
    if s.method not in METHODS:
        raise ConfigError(f"speculative.method={s.method!r}; choose one of {', '.join(METHODS)}")
    if s.method == "off":
        return
    if s.k_pick not in ("fixed", "measured"):
        raise ConfigError(f"speculative.k_pick={s.k_pick!r}; choose fixed (speculative.k as set) or measured (the k "
                          "the recorded spec_decode table picks at this batch size)")
    if s.k_pick == "measured" and cfg.job.name == "spec_decode":
        raise ConfigError("job=spec_decode measures every k of speculative.ks: speculative.k_pick=measured is for "
                          "the jobs that use one k (job=decode)")
    ks = list(s.ks) if cfg.job.name == "spec_decode" else [s.k]
    for k in ks:
        if not 1 <= k < ctx:
            raise ConfigError(f"speculative.k={k}: draft tokens a step, between 1 and kv_cache.ctx - 1 ({ctx - 1})")
    synth = cfg.model.synthetic
    if s.method in ("mtp", "mtp_scripted") and synth is not None and not cfg.model.path and not cfg.model.package and (
            synth.arch != "qwen35" or getattr(synth, "mtp_layers", 0) < 1):
        raise ConfigError(f"speculative={s.method} drafts with the model's own MTP head, and model={cfg.model.name} "
                          f"({synth.arch}, synthetic) has none: give model.path a qwen35 GGUF that keeps its MTP "
                          "block, set model.synthetic.mtp_layers=1 on qwen35 shapes, or use speculative=ngram")
    if s.method in ("scripted", "mtp_scripted") and cfg.scheduler.mode != "static" and cfg.sampling.temperature > 0:
        raise ConfigError("speculative=scripted in a served queue takes its futures from the greedy single stream; "
                          "use sampling=greedy, or speculative=ngram")
    if not 0.0 <= s.acceptance <= 1.0 or any(not 0.0 <= a <= 1.0 for a in s.acceptances):
        raise ConfigError(f"speculative.acceptance={s.acceptance}, acceptances={list(s.acceptances)}: probabilities "
                          "in [0, 1]")


def check_micro(cfg) -> None:
    """A micro-benchmark's sizes, before any device is touched (a zero or negative size would fail inside a kernel,
    or time nothing)."""
    m = cfg.micro
    if cfg.job.name == "int4_gemm":
        if not m.batches or any(int(b) < 1 for b in m.batches):
            raise ConfigError(f"micro.batches={list(m.batches)}; give one or more batch sizes >= 1")
        return
    if cfg.batch.size < 1:
        raise ConfigError(f"batch.size={cfg.batch.size}; need at least one row")
    dims = {"n": m.n, "k": m.k, "n_heads": m.n_heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "ctx": m.ctx,
            "gdn_k_heads": m.gdn_k_heads, "gdn_v_heads": m.gdn_v_heads, "gdn_dim": m.gdn_dim}
    bad = {k: v for k, v in dims.items() if v < 1}
    if bad:
        raise ConfigError(f"micro.{', micro.'.join(f'{k}={v}' for k, v in bad.items())}: sizes must be >= 1")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"micro.n_heads={m.n_heads} is not a multiple of micro.kv_heads={m.kv_heads} (grouped-query "
                          "attention shares each KV head among a whole number of query heads)")
    if m.gdn_v_heads % m.gdn_k_heads:
        raise ConfigError(f"micro.gdn_v_heads={m.gdn_v_heads} is not a multiple of micro.gdn_k_heads={m.gdn_k_heads}")


def check_pool(need: int, kvc, B: int) -> None:
    """A paged pool given by hand must hold the job's longest request (need KV positions), or every request that
    long is rejected and the job serves nothing: refused here with the size that would. A pool sized from the peak
    (kv_cache.pool_vs_peak) holds it by construction."""
    if kvc.layout != "paged" or kvc.pool_vs_peak > 0:
        return
    blocks, have = -(-need // kvc.block_size), pool_blocks(kvc.num_blocks, kvc.block_size, B, kvc.ctx) - 1
    if blocks > have:
        raise ConfigError(f"kv_cache.num_blocks={kvc.num_blocks} leaves {have} blocks of {kvc.block_size} positions "
                          "(block 0 is the scratch block), but a request of the prompt + workload.max_new_tokens "
                          f"needs {need} KV positions, {blocks} blocks; set kv_cache.num_blocks >= {blocks + 1}, or 0 "
                          "to size the pool from batch.size and kv_cache.ctx")
