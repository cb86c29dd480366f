"""The job's engine from its config: the model source resolved (a path, a package's file, a synthetic file or
in-memory weights) and loaded under the EngineSpec its engine, batch and kv_cache groups make."""
from __future__ import annotations

import time
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from onepass.engine.config import ModelConfig, RopeScaling
from onepass.engine.engine import Engine, EngineSpec, check_memory
from onepass.engine.fused_model import tensor_bytes
from onepass.engine.gguf_loader import read_config
from onepass.engine.sampler import SamplingParams
from onepass.engine.state_pool import check_hybrid_serving
from onepass.harness.logs import log
from onepass.harness.record import device_name
from onepass.harness.synth import resolve_gguf, synthetic_config


def spec_of(cfg) -> EngineSpec:
    """The job's engine, batch and kv_cache groups as the engine's spec."""
    e, kvc = cfg.engine, cfg.kv_cache
    return EngineSpec(device=e.device, dtype=e.dtype, backend=e.backend, gemm=e.gemm, weights=e.weights, int4=e.int4,
                      batch=cfg.batch.size, ctx=kvc.ctx, cuda_graphs=e.cuda_graphs, pdl=e.pdl,
                      ready_scales=e.ready_scales, state_dtype=kvc.state_dtype,
                      state_writeback=int(kvc.state_writeback), threads=e.threads, step=e.step,
                      persistent_form=e.persistent_form)


def resolve_engine(e) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, backend) of an engine group, every setting checked."""
    return EngineSpec(device=e.device, dtype=e.dtype, backend=e.backend, gemm=e.gemm, weights=e.weights,
                      int4=e.int4, threads=e.threads, step=e.step, persistent_form=e.persistent_form).resolve()


_LOADED: dict = {}  # the last model built (its config and load settings, its engine), reused by a sweep's next job


def speculation_need(cfg) -> dict:
    """The check_memory arguments of the job's speculation: the most drafts a step it runs, and whether the MTP head
    keeps its own KV."""
    s = cfg.speculative
    if s.method == "off":
        return {}
    k = max(s.ks) if cfg.job.name == "spec_decode" else s.k
    return {"spec_k": int(k), "mtp": s.method in ("mtp", "mtp_scripted")}


def _in_memory(cfg) -> bool:
    return cfg.model.synthetic is not None and not cfg.model.path and not cfg.model.package \
        and cfg.model.synthetic.materialize == "memory"


def build(cfg) -> Engine:
    """The job's engine: its model file (or in-memory synthetic weights) loaded under the job's spec."""
    spec = spec_of(cfg)
    dev, dtype, _ = spec.resolve()
    # the model is reused by the next job of a sweep when only run-time settings changed (a B sweep loads it once)
    memo = (OmegaConf.to_yaml(cfg.model), tuple(getattr(spec, f) for f in Engine.LOAD_FIELDS))
    if _LOADED.get("key") == memo:
        engine = _LOADED["engine"]
        # its weights are in place
        check_memory(spec, engine.cfg, 0, f"{cfg.model.name} at batch {spec.batch}", **speculation_need(cfg))
        return engine.respec(spec)
    _LOADED.clear()  # free the previous model before making another
    gguf_path = None if _in_memory(cfg) else resolve_gguf(cfg.model, progress=cfg.progress)
    # what the job may not do with this model, refused from its header before minutes of loading
    check_hybrid_serving(synthetic_config(cfg.model.name, cfg.model.synthetic) if gguf_path is None
                         else read_config(gguf_path), cfg.kv_cache.prefix)
    if gguf_path is not None:
        engine = Engine.from_gguf(gguf_path, spec, progress=cfg.progress, speculation=speculation_need(cfg))
        _LOADED.update(key=memo, engine=engine)
    else:   # random weights made on the device under the loader's contract (harness/synth.py)
        from onepass.harness.synth import synthetic_in_memory

        t0 = time.perf_counter()
        mcfg, weights = synthetic_in_memory(cfg.model.name, cfg.model.synthetic, dtype, dev, spec.weights == "packed")
        held = sum(tensor_bytes(t) for t in weights.values())   # meta stand-ins: nothing made yet
        check_memory(spec, mcfg, held, f"{cfg.model.name} (in memory) at batch {spec.batch}", **speculation_need(cfg))
        engine = Engine.from_weights(mcfg, weights, spec, name=f"{cfg.model.name}-in-memory")
        engine.load_s += time.perf_counter() - t0
        _LOADED.update(key=memo, engine=engine)
    if cfg.model.synthetic is not None and cfg.model.synthetic.rope_scaling and not cfg.model.path:
        engine.cfg = _with_scaling(engine.cfg)  # the file keeps only rope_freqs; the peer wants the parameters
    return engine


def _with_scaling(mcfg: ModelConfig) -> ModelConfig:
    return replace(mcfg, rope_scaling=RopeScaling())


def draft_source(cfg, vocab_size: int, futures: dict[int, list[int]] | None = None,
                 acceptance: float | None = None):
    """(draft source, k) of the job's speculative group: (None, 0) when off. Scripted drafts take the target's own
    future tokens per request id, from the run without speculation, right at `acceptance` (default: the group's).
    A source keeps state per request: each run gets a new one."""
    from onepass.engine.drafts import PromptLookup, ScriptedDrafts

    s = cfg.speculative
    if s.method == "off":
        return None, 0
    k = s.k
    if s.k_pick == "measured":
        from onepass.harness.spec_pick import measured_k

        k, why = measured_k(cfg.model.name, s.method, cfg.batch.size, device_name(resolve_engine(cfg.engine)[0]))
        log.info(f"[speculative] speculative.k_pick=measured: {why}")
        if k == 0:
            return None, 0
    if s.method == "ngram":
        return PromptLookup(s.ngram_max), k
    if s.method == "mtp":   # the model's own MTP head, bound to the model by the run (engine/mtp_drafts.py)
        from onepass.engine.mtp_drafts import MTPDrafts

        return MTPDrafts(), k
    acc = s.acceptance if acceptance is None else acceptance
    script = ScriptedDrafts(futures or {}, acc, vocab_size, seed=cfg.workload.seed)
    if s.method == "mtp_scripted":
        from onepass.engine.mtp_drafts import ScriptedMTPDrafts

        return ScriptedMTPDrafts(script), k
    return script, k


def sampling_params(cfg) -> SamplingParams:
    """The job's sampling group as SamplingParams (which refuses values out of range)."""
    s = cfg.sampling
    return SamplingParams(s.temperature, s.top_k, s.top_p, s.seed)
