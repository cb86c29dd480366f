"""The engine: a model loaded once with its kernel policy, ready to generate a static batch or serve a queue.

    engine = Engine.from_gguf("model.gguf", batch=8)
    texts = engine.generate(["The capital of France is"] * 8, max_new_tokens=32)
    result = engine.serve([Request(i, ids, 64) for i in range(256)])

The spec says everything the engine is built for (device, dtype, backend, dense or packed weights, context, the
batch its kernels are picked for); it is checked before anything loads. The engine owns what a run needs beyond the
weights: the KV cache or paged pool, the recurrent-state pool of a hybrid model, the scheduler and the step that
runs on them, each made fresh for a call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from onepass.engine.config import ModelConfig
from onepass.engine.gguf_loader import load_gguf, read_config
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.memory import check_fits as check_memory_fits
from onepass.engine.memory import estimate
from onepass.engine.runner import ServeResult, StaticBatchResult, check_fits, run_static
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request
from onepass.engine.state_pool import HybridCache, resolve_writeback
from onepass.engine.tokenizer import Tokenizer
from onepass.kernels import pdl
from onepass.kernels.errors import ConfigError
from onepass.kernels.int4_dispatch import POLICIES, Int4Policy
from onepass.kernels.persistent_step import parse_form

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built for. `batch` is the number of sequences it decodes at once: the packed weights'
    kernel pick and PDL's early trigger follow it, and every batch up to it runs the same kernels."""

    device: str = "auto"            # auto | cpu | cuda
    dtype: str = "auto"             # auto (float32 on the CPU, bfloat16 on a GPU) | float32 | bfloat16 | float16
    backend: str = "auto"           # auto (triton on a GPU, torch on the CPU) | torch | triton
    gemm: str = "triton"            # dense projections on the triton backend: triton (batch-invariant) | cublas
    weights: str = "dequant"        # dequant (GGUF -> dtype at load) | packed (quantized matrices stay quantized)
    int4: str = "invariant"         # packed weights' kernel: invariant (measured pick at `batch`) | a variant's name
    batch: int = 8
    ctx: int = 512                  # positions per sequence
    cuda_graphs: bool = True
    pdl: bool = True                # programmatic dependent launch where the GPU has it (kernels/pdl.py)
    ready_scales: bool = True       # packed Q4_K at batches above 8: scale words made once per weight
    state_dtype: str = "float32"    # hybrid models' recurrent state: float32 | bfloat16
    state_writeback: int = 0        # hybrid models: tokens per write of the whole state (0: the engine's default)
    threads: int = 0                # CPU threads for torch (0: torch's default)
    step: str = "kernels"           # kernels (one kernel per op) | persistent (dense models, steps of <= 16 rows:
                                    # every layer in one persistent kernel, kernels/persistent_step.py) | auto (the
                                    # faster of the two, measured when graphs are first captured; for every row count)
    persistent_form: str = ""       # the persistent step's settings, e.g. "block_k=512,stages=3" ("": its defaults;
                                    # kernels/persistent_step.py FORM_SETTINGS)

    @classmethod
    def of(cls, **kw) -> EngineSpec:
        """A spec from keyword settings; an unknown one is refused with the list of known ones."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(kw) - known):
            raise ConfigError(f"unknown engine setting {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kw)

    def resolve(self) -> tuple[torch.device, torch.dtype, str]:
        """(device, dtype, backend) this spec runs on, after checking every setting against the machine."""
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"engine.device={self.device!r}; choose auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("engine.device=cuda but torch sees no CUDA device; use engine.device=auto or cpu")
        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        dev = torch.device("cuda" if cuda else "cpu")
        if self.dtype == "auto":
            dtype = torch.bfloat16 if cuda else torch.float32
        elif self.dtype in DTYPES:
            dtype = DTYPES[self.dtype]
        else:
            raise ConfigError(f"engine.dtype={self.dtype!r}; choose auto or one of {sorted(DTYPES)}")
        backend = ("triton" if cuda else "torch") if self.backend == "auto" else self.backend
        if backend not in ("torch", "triton"):
            raise ConfigError(f"engine.backend={self.backend!r}; choose auto, torch or triton")
        if backend == "triton" and not cuda:
            raise ConfigError("engine.backend=triton needs a CUDA device; use engine.backend=torch on the CPU")
        if self.gemm not in ("triton", "cublas"):
            raise ConfigError(f"engine.gemm={self.gemm!r}; choose triton or cublas")
        if self.weights not in ("dequant", "packed"):
            raise ConfigError(f"engine.weights={self.weights!r}; choose dequant or packed")
        if self.int4 in ("fastest", "dequant_cublas"):
            raise ConfigError(f"engine.int4={self.int4} was removed: it ran kernels whose rows depend on the batch. "
                              "engine.int4=invariant picks the fastest batch-invariant kernel at the engine's batch; "
                              "job=int4_gemm still times bf16 cuBLAS beside the int4 kernels")
        if self.int4 not in POLICIES:   # refused with dense weights too: a misspelled policy must not pass unnoticed
            raise ConfigError(f"engine.int4={self.int4!r}; choose one of {', '.join(POLICIES)}")
        if self.weights == "packed" and backend != "triton":
            raise ConfigError("engine.weights=packed runs on the triton backend (the torch reference model reads dense "
                              "weights); use engine.weights=dequant with engine.backend=torch")
        if self.batch < 1:
            raise ConfigError(f"batch.size={self.batch}; need at least one sequence")
        if self.ctx < 1:
            raise ConfigError(f"kv_cache.ctx={self.ctx}; need at least one position")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"kv_cache.state_dtype={self.state_dtype!r}; choose float32 or bfloat16")
        resolve_writeback(self.state_writeback)     # a negative period is refused here
        if self.threads < 0:
            raise ConfigError(f"engine.threads={self.threads}; 0 leaves torch's default, or give a positive count")
        if self.step not in ("kernels", "persistent", "auto"):
            raise ConfigError(f"engine.step={self.step!r}; choose kernels, persistent or auto")
        parse_form(self.persistent_form)   # an unknown setting is refused here, before anything loads
        if self.step == "persistent" and backend != "triton":
            raise ConfigError("engine.step=persistent is a GPU kernel (its grid barriers need every program resident "
                              "at once); use engine.step=kernels on the CPU")
        return dev, dtype, backend

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse, before a model's weights load, a setting its architecture cannot run."""
        if self.step == "persistent" and cfg.arch not in ("llama", "qwen3"):
            raise ConfigError(f"engine.step=persistent runs the dense llama and qwen3 steps, not {cfg.arch!r}; use "
                              "engine.step=kernels")


def check_memory(spec: EngineSpec, cfg: ModelConfig, weights: int, what: str, rows: int | None = None,
                 spec_k: int = 0, mtp: bool = False) -> None:
    """Refuse, before anything is allocated, a spec whose weights (`weights` bytes still to allocate), batch + 1
    cache slots of spec.ctx positions and `rows` step rows (default: the batch) exceed the device's free memory;
    speculation (spec_k drafts a step, the MTP head's KV) counted in."""
    dev, dtype, backend = spec.resolve()
    state_dtype = DTYPES[spec.state_dtype]
    writeback = resolve_writeback(spec.state_writeback, state_dtype) if backend == "triton" else 1
    need = estimate(cfg, weights, spec.batch, spec.ctx, dtype, rows, state_dtype, writeback, spec_k, mtp)
    check_memory_fits(need, dev, what)


class Engine:
    """A model on a device with its step kernels, built from an EngineSpec."""

    def __init__(self, spec: EngineSpec, cfg: ModelConfig, weights: dict, tokenizer: Tokenizer | None = None,
                 source: Path | str = "in-memory", load_s: float = 0.0):
        self.spec = spec
        self.device, self.dtype, self.backend = spec.resolve()
        spec.check_model(cfg)
        if spec.threads > 0:
            torch.set_num_threads(spec.threads)
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.source = Path(source)
        self.state_dtype = DTYPES[spec.state_dtype]
        self.state_writeback = spec.state_writeback
        self.int4 = Int4Policy(spec.int4, spec.batch)
        self.launch = pdl.LaunchPolicy.for_engine(spec.pdl, spec.batch, cfg.arch, spec.ready_scales)
        t0 = time.perf_counter()
        if cfg.arch == "qwen35":
            self.writeback()   # a period the backend cannot run is refused before any run
        with pdl.applied(self.launch):
            self.model = self._fused(self.backend)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_s = load_s + time.perf_counter() - t0

    # --- building ---------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, spec: EngineSpec | None = None, progress: bool = False,
                  speculation: dict | None = None, **settings) -> Engine:
        """Load a GGUF file (its tokenizer too) onto the spec's device; `settings` are EngineSpec fields;
        `speculation` (spec_k, mtp) the memory speculation will take (check_memory)."""
        spec = replace(spec, **settings) if spec is not None else EngineSpec.of(**settings)
        dev, dtype, _ = spec.resolve()
        path = Path(path)
        header = read_config(path)
        # packed weights stay about the file's size; dequantized ones take every parameter at the dtype
        held = path.stat().st_size if spec.weights == "packed" else header.param_count() * dtype.itemsize
        check_memory(spec, header, held, f"{path.name} at batch {spec.batch}", **(speculation or {}))
        spec.check_model(header)
        t0 = time.perf_counter()
        cfg, weights, _ = load_gguf(Path(path), dtype=dtype, device=dev, progress=progress,
                                    keep_quantized=spec.weights == "packed")
        return cls(spec, cfg, weights, Tokenizer.from_gguf(Path(path)), Path(path), time.perf_counter() - t0)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict, spec: EngineSpec | None = None,
                     tokenizer: Tokenizer | None = None, name: str = "in-memory", **settings) -> Engine:
        """An engine over weights already on the device, named as the loader names them (engine/gguf_loader.py)."""
        spec = replace(spec, **settings) if spec is not None else EngineSpec.of(**settings)
        return cls(spec, cfg, weights, tokenizer, name)

    def _fused(self, backend: str):
        """The fused decoder over `backend`'s step kernels: the GPU's, or the torch references (on the CPU). The
        plain-torch models of engine/models are its oracle, not a second engine."""
        from onepass.kernels.backend import get_step_kernels

        kernels = get_step_kernels(backend, self.spec.gemm, int4=self.int4)
        if self.cfg.arch == "qwen35":
            from onepass.engine.fused_qwen35 import FusedQwen35Decoder

            return FusedQwen35Decoder(self.cfg, self.weights, kernels, self.spec.ctx + 1)
        from onepass.engine.fused_model import FusedDecoder

        return FusedDecoder(self.cfg, self.weights, kernels, self.spec.ctx + 1, step=self.spec.step,
                            persistent_form=self.spec.persistent_form)

    LOAD_FIELDS = ("device", "dtype", "backend", "gemm", "weights", "ctx")   # what the loaded model was built for

    def respec(self, spec: EngineSpec) -> Engine:
        """This engine, its weights and model kept, run from now on under `spec`, which may differ from its own
        only in run-time settings (batch, kernel policy, graphs, PDL, the step's form and the persistent step's
        settings, the recurrent state's dtype and period)."""
        if diff := [f for f in self.LOAD_FIELDS if getattr(spec, f) != getattr(self.spec, f)]:
            raise ConfigError(f"respec cannot change {', '.join(diff)}: the model was loaded for them; build a new "
                              "Engine")
        spec.resolve()
        spec.check_model(self.cfg)
        self.spec, self.state_dtype, self.state_writeback = spec, DTYPES[spec.state_dtype], spec.state_writeback
        if hasattr(self.model, "set_step"):
            self.model.set_step(spec.step, spec.persistent_form)
        self.int4.name, self.int4.max_batch = spec.int4, spec.batch   # the step kernels hold this policy object
        self.launch = pdl.LaunchPolicy.for_engine(spec.pdl, spec.batch, self.cfg.arch, spec.ready_scales)
        if self.cfg.arch == "qwen35":
            self.writeback()
        return self

    # --- caches ------------------------------------------------------------------------------------

    def writeback(self) -> int:
        """The write-back period of the next state pool: the reference model's is always 1."""
        period = resolve_writeback(self.state_writeback, self.state_dtype)
        if self.backend == "torch" and period != 1:
            if self.state_writeback:     # asked for explicitly: refused rather than silently ignored
                raise ConfigError(f"kv_cache.state_writeback={self.state_writeback} runs in the fused decoder "
                                  "(engine.backend=triton); the torch reference writes the state every token: use 1")
            return 1
        return period

    def cache(self, slots: int, ctx: int | None = None):
        """A fresh KV cache of `slots` slots (a HybridCache: KV + recurrent state, for hybrid models)."""
        ctx = ctx or self.spec.ctx
        if self.cfg.arch == "qwen35":
            return HybridCache.create(self.cfg, slots, ctx, self.dtype, self.device, self.state_dtype,
                                      writeback=self.writeback())
        return ContiguousKVCache(self.cfg, slots, ctx, self.dtype, self.device)

    def workspace(self):
        """rows, n -> the decode attention's split-K workspace for `rows` query rows over n positions (None where
        the attention needs none: the torch kernels)."""
        if self.backend != "triton":
            return None
        from onepass.kernels.decode_attention import make_workspace

        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        cfg = self.cfg
        return lambda rows, n: make_workspace(rows, cfg.n_heads, cfg.head_dim, n, sms, self.device,
                                              kv_heads=cfg.n_kv_heads)

    # --- running ---------------------------------------------------------------------------------------

    def pdl_mode(self) -> int:
        """How this engine's step kernels launch (kernels/pdl.mode): 0 plainly, 1 with PDL, 2 with early triggers
        too, 4 with the CUDA GEMMs' late release as well."""
        return self.launch.mode(self.device) if self.backend == "triton" else 0

    def stop_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_ids if self.tokenizer else tuple(self.cfg.eos_ids)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer: this engine's weights came without one; "
                                  "pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def run_static(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
                   stop_ids: tuple[int, ...] = (), prefill: str = "batched", progress: bool = False,
                   max_len: int | None | str = "fit", drafts=None, spec_k: int = 0) -> StaticBatchResult:
        """One static batch in a fresh cache: every prompt (of one length) decoded in lockstep, timed per step.
        Positions stay below max_len: "fit" (prompt + new tokens: the attention grid sized for them) or None (the
        context). drafts, spec_k: speculative decoding (engine/drafts.py)."""
        if max_len == "fit":
            max_len = len(prompts[0]) + max_new_tokens
        kv = self.cache(len(prompts) + 1)   # + the scratch slot
        return run_static(self.model, kv, prompts, max_new_tokens, sampling, stop_ids, prefill,
                          use_graphs=self.spec.cuda_graphs and self.device.type == "cuda", workspace=self.workspace(),
                          max_len=max_len, launch=self.launch, drafts=drafts, spec_k=spec_k, progress=progress)

    def teacher_forced_logits(self, ids: list[int], follow: list[int]) -> torch.Tensor:
        """fp32 logits [1 + len(follow), V]: the prompt's last position, then each token of `follow` fed in turn
        (one slot, eager)."""
        m, dev, P, ctx = self.model, self.device, len(ids), self.spec.ctx
        kv = self.cache(2, ctx)
        t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
        ws = self.workspace() or (lambda rows, n: None)
        runs = {"seq_len": P} if getattr(m, "hybrid", False) else {}   # the prompt as one run of slot 0
        with pdl.applied(self.launch):
            h = m.hidden(t(ids), t(list(range(P))), t([0] * P), kv, m.buffers(P), ws(P, ctx), **runs)
            rows = [m.logits(h[-1:].contiguous())]
            buf, ws1 = m.buffers(1), ws(1, ctx)
            for i, tok in enumerate(follow):
                rows.append(m.logits(m.hidden(t([tok]), t([P + i]), t([0]), kv, buf, ws1)).clone())
        return torch.cat(rows).float()

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop: bool = True) -> list[str] | list[list[int]]:
        """Decode every prompt: texts in, texts out (token ids in, ids out). Prompts of one length run as one
        static batch; others go through the continuous scheduler over a paged pool."""
        if not prompts:
            return []
        texts = isinstance(prompts[0], str)
        ids = [self.encode(p) for p in prompts]
        stops = self.stop_ids() if stop else ()
        if len({len(p) for p in ids}) == 1 and len(ids) <= self.spec.batch:
            check_fits(len(ids[0]), max_new_tokens, self.spec.ctx)
            outputs = self.run_static(ids, max_new_tokens, sampling, stops).outputs
        else:
            res = self.serve([Request(i, p, max_new_tokens) for i, p in enumerate(ids)], sampling=sampling,
                             stop_ids=stops)
            if res.rejected:
                raise ConfigError(res.rejected[0][1])
            outputs = [r.output for r in sorted(res.finished, key=lambda r: r.rid)]
        return [self.tokenizer.decode(o) for o in outputs] if texts else outputs

    def serve(self, requests: list[Request], *, mode: str = "continuous", prefill: str = "token",
              layout: str = "paged", block_size: int = 16, num_blocks: int = 0, prefix: str = "off",
              token_budget: int = 512, prefix_burst: bool = True, sampling: SamplingParams | None = None,
              sample_on_device: bool = True, stop_ids: tuple[int, ...] | None = None, pool_vs_peak: float = 0.0,
              drafts=None, spec_k: int = 0, progress: bool = False, arrivals=None) -> ServeResult:
        """Serve a queue of requests with `spec.batch` slots: `mode` continuous (a finished request's slot is
        refilled at once) or wave (a new wave when all have finished); KV contiguous or paged (a pool of
        `num_blocks`, 0: enough for every slot's ctx); `prefix` off, pinned (the first request's prompt shared
        by all) or auto (hash-chain prefix caching). `arrivals` (engine/arrivals.py): requests that join while the
        loop runs (open-loop serving); `requests` are then the ones queued at the start, and sizing a pool by its peak
        demand (pool_vs_peak) or pinning a prefix reads only those."""
        from onepass.engine.serving_setup import ServingSetup

        setup = ServingSetup(self, mode=mode, prefill=prefill, layout=layout, block_size=block_size,
                             num_blocks=num_blocks, prefix=prefix, token_budget=token_budget,
                             prefix_burst=prefix_burst, pool_vs_peak=pool_vs_peak, drafts=drafts, spec_k=spec_k)
        stops = self.stop_ids() if stop_ids is None else stop_ids
        serving, pinned = setup.build(requests, sampling or SamplingParams(), sample_on_device, stops)
        result = serving.run(requests, progress=progress, arrivals=arrivals)
        result.pinned_prefix = pinned
        return result

