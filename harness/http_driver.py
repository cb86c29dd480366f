"""A request trace replayed open loop against an OpenAI-compatible server: one asyncio task per request, started at
its arrival time whatever the others are doing, each streaming `/v1/completions` (the prompt as token ids, the job's
temperature, `ignore_eos` for the trace's exact output lengths, usage in the last chunk) and stamping every SSE chunk
as it arrives.

The client runs in a process of its own (`python -m onepass.harness.http_driver`): parsing thousands of streams in
the job's process would take the interpreter lock from a server running in it (harness/server.py on the job's engine)
and slow the very loop it measures. Its clock is the host's monotonic one, as the job's.

A chunk counts as many tokens as its `token_ids` list holds where the server sends one (onepass's server does when
asked, `return_token_ids`: a chunk holds every token a request had ready), else one token where it carries text (as
`vllm bench serve` counts) or no finish reason (its text not decodable yet: a character's first bytes, or a model
without a tokenizer); tokens of one chunk share its time stamp, and so do the chunks of one read from the socket. The
last chunk of a choice ends the request (its E2E), and is its first token too where no token chunk came before it.
The token count a request is judged by (TPOT, the lengths' check) is the server's `usage.completion_tokens` where it
sends usage.

Every request holds its own connection of one aiohttp session (HTTP/1.1 streams one response a connection), so the
client may open as many sockets as requests in flight: its soft limit on open files is raised towards the hard one
first. Each read from a socket is split into lines at once, so the client's cost is a wake-up per read, not per line:
it has to keep up with every stream of the server at once, from one process.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LEAD_S = 0.2   # the trace starts this long after the tasks are made, so none of them is late for its arrival


@dataclass
class Timing:
    """One request as a driver saw it (host perf_counter seconds)."""

    rid: int
    prompt_len: int
    output_len: int                  # tokens asked for
    arrival_s: float                 # when it was due
    token_s: list[float] = field(default_factory=list)   # each output token's arrival (tokens may share one)
    end_s: float = 0.0               # when its last token (or the end of its stream) arrived; 0: it never ended
    output_tokens: int = 0           # tokens the target says it made
    error: str = ""                  # why it did not complete
    output: list[int] | None = None  # its token ids, where the target returns them
    text: str = ""                   # its text, where the target streams text

    @property
    def completed(self) -> bool:
        return not self.error and self.end_s > 0

    @property
    def first_s(self) -> float:
        return self.token_s[0] if self.token_s else self.end_s


def completions_url(base: str) -> str:
    """The completions endpoint of a server's base URL (with or without its /v1)."""
    base = base.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


def raise_open_files(needed: int) -> None:
    """Lift the soft limit on open files towards `needed` sockets (the hard limit caps it)."""
    try:
        import resource
    except ImportError:   # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def replay_http(url: str, trace, model: str, temperature: float = 0.0, ignore_eos: bool = True,
                token_ids: bool = False) -> list[Timing]:
    """Every request of the trace (harness/traces.py) sent at its arrival time to `url`'s completions endpoint,
    asking for `model` at `temperature` (0: greedy), from a client process of its own; their timings, in trace
    order. token_ids: ask for each chunk's token ids too (`return_token_ids`, onepass's and vLLM's extension)."""
    body = {"model": model, "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}, **({"return_token_ids": True} if token_ids else {})}
    with tempfile.TemporaryDirectory(prefix="onepass-http-") as tmp:
        given, got = Path(tmp) / "trace.json", Path(tmp) / "timings.json"
        given.write_text(json.dumps({"endpoint": completions_url(url), "body": body,
                                     "requests": [[r.offset_s, r.prompt, r.output_len] for r in trace.requests]}))
        run = subprocess.run([sys.executable, "-m", "onepass.harness.http_driver", str(given), str(got)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"the HTTP client process failed (exit status {run.returncode}): "
                               f"{run.stderr.strip()[-2000:]}")
        return [Timing(**t) for t in json.loads(got.read_text())]


def main(argv: list[str] | None = None) -> None:
    """The client process: the trace and request body from a JSON file in, the timings as a JSON file out."""
    given, got = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(given).read_text())
    raise_open_files(2 * len(spec["requests"]) + 256)
    timings = asyncio.run(_replay(spec["endpoint"], spec["requests"], spec["body"]))
    Path(got).write_text(json.dumps([vars(t) for t in timings]))   # asdict would deep-copy every list


async def _replay(endpoint: str, requests: list, body: dict) -> list[Timing]:
    import aiohttp

    # no pool limit (a request waiting for a pooled connection would be late), no timeout (a long queue is what an
    # overloaded server is measured by), no proxies from the environment (the target may be on loopback)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        t0 = time.perf_counter() + LEAD_S
        tasks = [asyncio.create_task(_one(session, endpoint, i, prompt, n, t0 + offset, body))
                 for i, (offset, prompt, n) in enumerate(requests)]
        return list(await asyncio.gather(*tasks))


async def _one(session, endpoint: str, rid: int, prompt: list[int], n: int, due: float, body: dict) -> Timing:
    import aiohttp

    await asyncio.sleep(max(0.0, due - time.perf_counter()))
    t = Timing(rid, len(prompt), n, due)
    events = _Events(t)
    try:
        async with session.post(endpoint, json={**body, "prompt": prompt, "max_tokens": n}) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
                return t
            rest = b""
            # whatever bytes have come are parsed at once: one wake-up per read, not one per line (a client that
            # parses slower than the server streams stamps its tokens late, and measures itself)
            async for data in resp.content.iter_any():
                whole, _, rest = (rest + data).rpartition(b"\n")   # a line (and a character) cut by the read waits
                if not events.feed(whole, time.perf_counter()):
                    break
            else:
                events.feed(rest, time.perf_counter())
            if not events.ended and not t.error:
                t.error = "the stream ended without its [DONE] line"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:   # ValueError: a bad JSON line
        t.error = f"{type(e).__name__}: {e}"
    usage = events.usage
    t.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(t.token_s)
    t.output = events.ids if events.ids and len(events.ids) == len(t.token_s) else None
    t.text = "".join(events.text)
    return t


class _Events:
    """A stream's SSE lines as they come, counted into its Timing."""

    def __init__(self, t: Timing):
        self.t, self.ids, self.text, self.usage, self.ended = t, [], [], None, False

    def feed(self, raw: bytes, now: float) -> bool:
        """Take whole lines that arrived at `now`; False once the stream has ended ([DONE], or an error event)."""
        t = self.t
        for line in raw.decode().split("\n"):
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                self.ended = True
                return False
            chunk = json.loads(payload)
            if chunk.get("error"):
                t.error = f"the server reported an error: {str(chunk['error'])[:300]}"
                return False
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids")
                piece = choice.get("text") or ""
                # a chunk without a finish reason carries a token even where its text is not out yet (a character's
                # first bytes, a model without a tokenizer); the finish chunk alone carries none
                k = len(got) if got else 1 if piece or choice.get("finish_reason") is None else 0
                t.token_s += [now] * k
                t.end_s = now
                self.ids += got or []
                self.text.append(piece)
        return True


if __name__ == "__main__":
    main()
