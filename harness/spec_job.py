"""The speculative-decoding benchmark: one model, one batch size, the batch without drafts and then with drafts for
every k (and, for scripted drafts, every acceptance) of the speculative group, each recorded as its own run beside
the run without drafts in the same job."""
from __future__ import annotations

from typing import Iterator

from omegaconf import OmegaConf

from onepass.engine.verify import verify_greedy
from onepass.harness.build import build, draft_source, resolve_engine, sampling_params
from onepass.harness.checks import check_decode
from onepass.harness.decode_job import decode_rate, percentile_ms, speculation_metrics
from onepass.harness.job import RunRecord
from onepass.harness.spread import repeat, spread
from onepass.harness.workload import prompt_ids, workload_digest
from onepass.kernels.errors import ConfigError


class SpecDecodeJob:
    """Rows of table spec_decode: (k, acceptance) against no drafts, at the job's batch.size."""

    def __init__(self, name: str = "spec_decode"):
        self.name = name

    def run(self, cfg) -> Iterator[RunRecord]:
        s, w, B = cfg.speculative, cfg.workload, cfg.batch.size
        if s.method == "off":
            raise ConfigError("job=spec_decode measures drafts against none: choose speculative=ngram, "
                              "speculative=scripted, speculative=mtp or speculative=mtp_scripted")
        if cfg.scheduler.mode != "static":
            raise ConfigError("job=spec_decode times static batches; use scheduler=static (a served queue takes "
                              "speculative=... in job=decode)")
        check_decode(cfg, resolve_engine(cfg.engine)[2])
        sampling = sampling_params(cfg)
        built = build(cfg)
        mcfg, tok = built.cfg, built.tokenizer
        ids = prompt_ids(w, tok, mcfg.vocab_size)
        stop_ids = () if w.ignore_eos else built.stop_ids()
        prefill, n = cfg.scheduler.prefill, w.max_new_tokens

        def run(batch: int, drafts=None, k: int = 0):
            return built.run_static([ids] * batch, n, sampling, stop_ids, prefill, drafts=drafts, spec_k=k)

        built.run_static([ids] * B, 4, sampling, stop_ids, prefill)   # compile outside the timing
        single = run(1)
        # each batch (without drafts, and with them at each (k, acceptance)): measure.warmup untimed runs, then
        # measure.repeats timed ones; rates are their median with the spread beside, the first timed run is verified
        plains = repeat(lambda: run(B), cfg.measure)
        plain, base = plains[0], spread("nonspec_tok_s", [decode_rate(r) for r in plains])
        futures = dict(enumerate(plain.outputs))
        print(f"[perf] spec_decode B={B} without drafts: {base['nonspec_tok_s']:,.1f} tok/s "
              f"(p10-p90 {base['nonspec_tok_s_p10']:,.1f}-{base['nonspec_tok_s_p90']:,.1f}), step p50 "
              f"{percentile_ms(plain.step_s, 0.5):.3f} ms")
        scripted = s.method in ("scripted", "mtp_scripted")
        grid = [(k, a) for k in s.ks for a in (s.acceptances if scripted else [None])]
        for k, acc in grid:
            # a draft source keeps state per request, so each run gets its own; the untimed warm-ups compile the
            # kernels met only with drafts (the MTP head's, eager, at each row count it meets)
            specs = repeat(lambda: run(B, draft_source(cfg, mcfg.vocab_size, futures, acc)[0], k), cfg.measure)
            spec = specs[0]
            same = spec.outputs == plain.outputs
            verdict = verify_greedy(spec.outputs, single.outputs[0], single.logits_finite) if sampling.greedy else None
            greedy = verdict.ok if verdict else True
            reason = "; ".join(r for r in (verdict.reason if verdict else "",
                                           "" if same else "speculation changed the tokens") if r)
            m = speculation_metrics(spec, plain, B, k)
            m.update(spread("throughput_tok_s", [decode_rate(r) for r in specs]), **base, repeats=float(len(specs)))
            m.update(speedup_vs_nonspec=m["throughput_tok_s"] / m["nonspec_tok_s"],
                     per_stream_tok_s=m["throughput_tok_s"] / B,
                     step_ms_p50=percentile_ms(spec.step_s, 0.5), steps=float(len(spec.step_s)),
                     verify_ok=int(same and greedy), spec_same_tokens=int(same),
                     single_stream_tok_s=decode_rate(single))
            if acc is not None:
                m["acceptance_set"] = float(acc)
            label = f"k={k}" + (f", acceptance {acc}" if acc is not None else f", {s.method}")
            print(f"[verify] spec_decode B={B} {label}: token for token the batch without drafts: "
                  f"{str(same).lower()}; equal to the single stream: {str(greedy).lower()}")
            print(f"[perf] spec_decode B={B} {label}: {m['throughput_tok_s']:,.1f} tok/s, "
                  f"{m['speedup_vs_nonspec']:.2f}x without drafts; {m['tokens_per_step']:.2f} tokens a slot a step, "
                  f"{m['acceptance_rate']:.0%} of drafts kept; step p50 {m['step_ms_p50']:.3f} ms")
            c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
            c.speculative.k = int(k)
            if acc is not None:
                c.speculative.acceptance = float(acc)
            tags = {"workload_hash": workload_digest([ids], w), "model_file": built.source.name,
                    "backend": built.backend, "dtype": str(built.dtype).removeprefix("torch."),
                    "speculative": s.method, **({"verify_reason": reason} if reason else {})}
            yield RunRecord(f"spec_decode {cfg.model.name} B={B} {label}", built.device, m, tags, {}, cfg=c)
