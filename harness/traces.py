"""Request traces: when each request of a serving benchmark arrives, its prompt, and how many tokens it asks for, made
from the workload group (conf/workload/trace_*.yaml) and the same on every machine.

Arrivals follow `vllm bench serve`: all at once (rate inf); Poisson at `rate` requests/s; gamma with shape
`burstiness` and mean interval 1/rate (burstiness 1 is Poisson, below 1 burstier, above 1 more regular); or the times
of a recorded trace file. The first request arrives at 0 and request i at the sum of the first i intervals, each
drawn as a standard gamma variate over rate x burstiness, so the trace at rate 2r is the trace at r played twice as
fast: a rate sweep replays the same requests. Lengths come from a distribution (fixed, uniform, or log-normal by its
median and the sigma of its log, clipped to [low, high]) or from the file. Prompts are token ids drawn uniformly
past the special tokens (as vllm's random dataset draws them), the first `shared_prefix` part of each taken from one
prefix every request shares (a system prompt: what a prefix cache finds); or the file's prompts, tokenized.

Every draw comes from numpy's Generator over PCG64, seeded from workload.seed through SeedSequence with one stream
each for arrivals, lengths and tokens (a new rate changes no prompt); nothing reads a hash seed, a dict's order or
the clock. `Trace.digest` hashes what was drawn (every offset to the microsecond, every prompt id and length), logged
as the run's `trace_hash`: equal hashes, equal traces. numpy keeps a Generator's streams stable across machines, not
promised across its releases; a changed hash says when that happened.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onepass.harness.workload import FIRST_ID
from onepass.kernels.errors import ConfigError

ARRIVALS = ("all", "poisson", "gamma", "file")
LENGTHS = ("fixed", "uniform", "lognormal")
FILE_KEYS = ("t", "prompt", "prompt_ids", "prompt_len", "output_len")


@dataclass(frozen=True)
class TraceRequest:
    offset_s: float      # arrival, seconds after the trace starts
    prompt: list[int]
    output_len: int      # tokens asked for


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    digest: str

    @property
    def span_s(self) -> float:
        """The last arrival's offset: how long the requests take to arrive."""
        return max((r.offset_s for r in self.requests), default=0.0)

    @property
    def requests_digest(self) -> str:
        """A hash of the prompts and lengths alone: equal for the traces of one seed at any rate."""
        return digest([TraceRequest(0.0, r.prompt, r.output_len) for r in self.requests])

    def distinct(self, n: int) -> list[int]:
        """Indices of the first n requests whose prompts differ (a verification sample)."""
        seen, out = set(), []
        for i, r in enumerate(self.requests):
            if len(out) == n:
                break
            if tuple(r.prompt) not in seen:
                seen.add(tuple(r.prompt))
                out.append(i)
        return out


def check_length(key: str, d) -> tuple[int, int]:
    """A length distribution's settings; returns the shortest and longest length it can draw."""
    if d.dist not in LENGTHS:
        raise ConfigError(f"{key}.dist={d.dist!r}; choose one of {', '.join(LENGTHS)}")
    if d.dist == "fixed":
        if d.median < 1:
            raise ConfigError(f"{key}.median={d.median}: a fixed length of at least 1 token")
        return d.median, d.median
    if not 1 <= d.low <= d.high:
        raise ConfigError(f"{key}: low={d.low}, high={d.high}; a {d.dist} length needs 1 <= low <= high (the lengths "
                          "it may draw, high bounding the context a request needs)")
    if d.dist == "lognormal" and not (d.low <= d.median <= d.high and d.sigma > 0):
        raise ConfigError(f"{key}: median={d.median}, sigma={d.sigma}, low={d.low}, high={d.high}; a lognormal "
                          "length needs low <= median <= high and sigma > 0 (the spread of its log)")
    return d.low, d.high


def check_trace(w, ctx: int) -> None:
    """A trace workload's settings, before any model loads: the arrival process, its rate, the lengths against the
    context, the file. ConfigError naming the setting and what to give."""
    if w.arrival not in ARRIVALS:
        raise ConfigError(f"workload.arrival={w.arrival!r}; choose one of {', '.join(ARRIVALS)}")
    if math.isnan(w.rate) or w.rate <= 0:
        raise ConfigError(f"workload.rate={w.rate}: requests a second, above 0 (inf: all at once)")
    if w.arrival == "all" and not math.isinf(w.rate):
        raise ConfigError(f"workload.arrival=all sends every request at once, and workload.rate={w.rate} asks for a "
                          "rate: set workload.arrival=poisson (or gamma) for a rate, or leave workload.rate=inf")
    if not (w.burstiness > 0 and math.isfinite(w.burstiness)):
        raise ConfigError(f"workload.burstiness={w.burstiness}: the gamma shape, above 0 (1 is Poisson)")
    if not 0.0 <= w.shared_prefix < 1.0:
        raise ConfigError(f"workload.shared_prefix={w.shared_prefix}: the part of each prompt every request shares, "
                          "in [0, 1)")
    if w.num_requests < 0:
        raise ConfigError(f"workload.num_requests={w.num_requests}: 0 (every line of the file) or a request count")
    if w.arrival == "file" and not w.trace_file:
        raise ConfigError("workload.arrival=file takes each request's time from workload.trace_file; give the file "
                          "(JSON lines with a t field)")
    if w.trace_file:
        path = Path(w.trace_file)
        if path.suffix not in (".jsonl", ".txt"):
            raise ConfigError(f"workload.trace_file={w.trace_file}: a .jsonl of requests or a .txt of prompts")
        if not path.is_file():
            raise ConfigError(f"workload.trace_file={w.trace_file} does not exist (relative paths are read from "
                              f"{Path.cwd()}); give the file's path")
    elif w.num_requests < 1:
        raise ConfigError(f"workload.num_requests={w.num_requests}: a trace needs at least one request (0 takes "
                          "every line of workload.trace_file, and none is given)")
    lo_p, hi_p = check_length("workload.prompt_len", w.prompt_len)
    lo_o, hi_o = check_length("workload.output_len", w.output_len)
    if hi_p + hi_o - 1 > ctx:   # the last token sampled is never fed back
        raise ConfigError(f"a request of the trace may have {hi_p} prompt and {hi_o} output tokens, {hi_p + hi_o - 1} "
                          f"KV positions, beyond kv_cache.ctx={ctx}: raise kv_cache.ctx to {hi_p + hi_o - 1} or lower "
                          "the lengths' high bounds")


def _lengths(d, n: int, rng: np.random.Generator) -> np.ndarray:
    if d.dist == "fixed":
        return np.full(n, d.median, dtype=np.int64)
    if d.dist == "uniform":
        return rng.integers(d.low, d.high + 1, n)
    # clipping is monotone, so the clipped draw keeps its median
    return np.clip(np.rint(rng.lognormal(math.log(d.median), d.sigma, n)), d.low, d.high).astype(np.int64)


def _offsets(w, n: int, rng: np.random.Generator) -> np.ndarray:
    if w.arrival == "all" or math.isinf(w.rate):
        return np.zeros(n)
    shape = 1.0 if w.arrival == "poisson" else w.burstiness
    gaps = rng.standard_gamma(shape, n) / (w.rate * shape)   # mean 1/rate, shape 1: exponential (Poisson)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def read_trace_file(path: str) -> list[dict]:
    """The file's requests as dicts of FILE_KEYS: a .txt gives a prompt a line; a .jsonl, an object a line."""
    p = Path(path)
    rows = []
    for num, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".txt":
            rows.append({"prompt": line})
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} line {num} is not JSON ({e.msg}); give one request object a line") from None
        if not isinstance(row, dict) or (unknown := sorted(set(row) - set(FILE_KEYS))):
            what = f"has the keys {unknown}" if isinstance(row, dict) else "is not an object"
            raise ConfigError(f"{path} line {num} {what}; a request line holds {', '.join(FILE_KEYS)}")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no requests; give one a line")
    return rows


def make_trace(w, vocab_size: int, tokenizer=None, ctx: int | None = None) -> Trace:
    """The workload's trace: workload.num_requests requests (0: every line of its file), each prompt of ids in
    [FIRST_ID, vocab_size) unless its file line gives one (text needs the model's tokenizer)."""
    check_trace(w, ctx if ctx is not None else 1 << 62)
    rows = read_trace_file(w.trace_file) if w.trace_file else []
    n = w.num_requests or len(rows)
    if rows and n > len(rows):
        raise ConfigError(f"workload.num_requests={n} but {w.trace_file} holds {len(rows)} requests; give at most "
                          f"{len(rows)}, or 0 for all of them")
    rows = rows[:n] or [{}] * n
    streams = np.random.SeedSequence(w.seed).spawn(3)
    arrivals, lengths, tokens = (np.random.Generator(np.random.PCG64(s)) for s in streams)
    if w.arrival == "file":
        if any("t" not in r for r in rows):
            raise ConfigError(f"workload.arrival=file needs a t (arrival seconds) on every line of {w.trace_file}")
        offsets = np.asarray([float(r["t"]) for r in rows])
        if not np.all(np.isfinite(offsets)) or offsets.min() < 0:
            raise ConfigError(f"{w.trace_file}: arrival times t must be finite and >= 0")
    else:
        offsets = _offsets(w, n, arrivals)
    prompt_lens, output_lens = _lengths(w.prompt_len, n, lengths), _lengths(w.output_len, n, lengths)
    if vocab_size <= FIRST_ID:
        raise ConfigError(f"a trace draws prompt ids {FIRST_ID}..vocab_size-1, and the model's vocab_size is "
                          f"{vocab_size}: give a model of more than {FIRST_ID} tokens")
    shared = tokens.integers(FIRST_ID, vocab_size, int(prompt_lens.max()))
    requests = []
    for i, row in enumerate(rows):
        if "prompt_ids" in row:
            prompt = [int(t) for t in row["prompt_ids"]]
        elif "prompt" in row:
            if tokenizer is None:
                raise ConfigError(f"{w.trace_file} gives prompts as text, and the model has no tokenizer (synthetic "
                                  "weights): give prompt_ids or prompt_len, or a GGUF with its tokenizer")
            prompt = (tokenizer.encode_chat(row["prompt"]) if w.chat and tokenizer.chat_template
                      else tokenizer.encode(row["prompt"]))
        else:
            length = int(row.get("prompt_len", prompt_lens[i]))
            k = int(w.shared_prefix * length)
            own = tokens.integers(FIRST_ID, vocab_size, length - k)
            prompt = [int(t) for t in shared[:k]] + [int(t) for t in own]
        out = int(row.get("output_len", output_lens[i]))
        if not prompt or out < 1 or (ctx is not None and len(prompt) + out - 1 > ctx):
            raise ConfigError(f"trace request {i}: a prompt of {len(prompt)} tokens and {out} output tokens; each "
                              f"needs a prompt, an output of at least 1 and at most kv_cache.ctx={ctx} positions "
                              "together")
        requests.append(TraceRequest(float(offsets[i]), prompt, out))
    return Trace(requests, digest(requests))


def digest(requests: list[TraceRequest]) -> str:
    """A hash of a trace: offsets to the microsecond (what a replay can hold to), every prompt id, every length."""
    h = hashlib.sha256()
    h.update(json.dumps([[round(r.offset_s * 1e6), r.prompt, r.output_len] for r in requests]).encode())
    return h.hexdigest()[:16]
