"""onepass-serve (harness/server.py): a real uvicorn server on loopback over the torch/CPU engine of a tiny GGUF with
a byte-level tokenizer and a chat template. Answers equal the engine's own greedy output token for token, streamed or
whole, one client or twenty at once; a client that leaves gives its slot and blocks back; every refusal has OpenAI's
error shape; the command composes its config, serves, and stops on SIGTERM."""
import asyncio
import itertools
import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers.pre_tokenizers import ByteLevel

from onepass.engine.config import ModelConfig
from onepass.engine.engine import Engine
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler
from onepass.engine.serving_setup import ServingSetup
from onepass.harness.server import OpenAIServer, compose, start_server
from onepass.harness.server_text import TextStream

CTX, SLOTS, BLOCK = 96, 8, 4
MODEL = "tiny-chat"
STOP_PROMPT = [40, 41, 42, 43]   # its greedy output holds the token the fixture makes the end of a turn
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    cfg = ModelConfig(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                      vocab_size=260, rope_theta=500000.0, name=MODEL, eos_ids=(259,))
    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "<|end|>"]   # every byte, so any output decodes
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 259 + [3], "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
            "tokenizer.chat_template": TEMPLATE}
    path = tmp_path_factory.mktemp("serve") / "tiny-chat.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=1), weight_type="f32", tokenizer_meta=meta)
    return path


class Served:
    """The server under test and a second engine of the same file for the references (never shared with the
    server's thread)."""

    def __init__(self, path):
        self.ref = Engine.from_gguf(path, device="cpu", batch=1, ctx=CTX)
        # random weights rarely sample the file's end-of-turn token: make one the model does sample end a turn
        free = self.ref.generate([STOP_PROMPT], 40, stop=False)[0]
        k = next(i for i in range(4, len(free)) if free[i] not in free[:i])
        self.stop_id = free[k]
        self.ref.tokenizer.stop_ids = (self.stop_id,)
        self.engine = Engine.from_gguf(path, device="cpu", batch=SLOTS, ctx=CTX)
        self.engine.tokenizer.stop_ids = (self.stop_id,)
        self.tok = self.ref.tokenizer
        self.server = OpenAIServer(self.engine, ServingSetup(self.engine, block_size=BLOCK, prefix="auto"),
                                   SamplingParams(), MODEL, max_tokens=16)
        self.sched = self.server.runner.sched
        self.url = self.server.start()
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def greedy(self, ids: list[int], n: int, stop: bool = True) -> list[int]:
        return self.ref.generate([ids], n, stop=stop)[0]

    def text(self, out: list[int]) -> str:
        """What the API shows of an output: its stop token left out."""
        return self.tok.decode(out[:-1] if out and out[-1] == self.stop_id else out, skip_special=True)

    def finish(self, out: list[int], n: int) -> str:
        return "stop" if out[-1] == self.stop_id and len(out) <= n else "length"

    def metrics(self) -> dict[str, float]:
        text = self.client.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.sched.running or self.sched.waiting or self.server.loop.arrivals.queued:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def served(chat_gguf):
    s = Served(chat_gguf)
    yield s
    s.client.close()
    s.server.stop()


def events(lines) -> list[dict]:
    """The data of a server-sent event stream, which must end with [DONE]."""
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def stream(served, path: str, body: dict) -> list[dict]:
    with served.client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return events(list(r.iter_lines()))


# -- the text of an output --------------------------------------------------------------------------------------------

def decode_bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_across_tokens_comes_out_whole():
    ts = TextStream(decode_bytes)
    euro = list("€".encode())
    assert [ts.add([t]) for t in [ord("a"), *euro, ord("b")]] == ["a", "", "", "€", "b"]
    assert ts.add([], done=True) == "" and ts.finish == "length" and ts.tokens == 5
    cut = TextStream(decode_bytes)   # a character the output ends inside shows as the tokenizer has it
    assert cut.add(euro[:2]) == "" and cut.add([], done=True) == "\ufffd"
    many = TextStream(decode_bytes)   # several tokens at once (a handler that fell behind): the same text
    assert many.add([ord("a"), *euro[:2]]) == "a" and many.add([euro[2], ord("b"), ord("c")]) == "€bc"
    assert many.tokens == 6


def test_a_stop_string_is_never_shown_in_part():
    ts = TextStream(decode_bytes, stops=["XYZ", "q"])
    deltas = [ts.add([t]) for t in b"abXYcXYZde"]
    assert "".join(deltas) == "abXYc" and ts.finish == "stop" and ts.tokens == 8
    assert all("Z" not in d for d in deltas) and deltas[-2:] == ["", ""]   # nothing after the stop is taken
    ends = TextStream(decode_bytes, stop_ids=[0])
    assert ends.add([ord("h"), 0, ord("i")]) == "h" and ends.finish == "stop" and ends.tokens == 2
    at_once = TextStream(decode_bytes, stops=["XYZ", "q"])   # the tokens counted end at the stop string's last
    assert at_once.add(list(b"abXYcXYZde")) == "abXYc" and at_once.finish == "stop" and at_once.tokens == 8


def test_a_text_chunk_is_written_as_the_chunk_object_encodes():
    from onepass.harness.server_api import Shape

    for chat, with_usage, ids in itertools.product((False, True), repeat=3):
        shape = Shape(chat, "cmpl-7", 'm "@text@"', with_usage, ids)
        for text in ("", 'a "quoted" \\ é\n€', "@text@"):
            event = shape.delta_event(text, [3, 4])
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            want = shape.chunk(text, None)
            if ids:
                want["choices"][0]["token_ids"] = [3, 4]
            assert json.loads(event[6:]) == want, (chat, with_usage, ids, text)


def test_ignore_eos_runs_a_request_past_the_stop_tokens():
    sched = Scheduler(2, "continuous", "token", 16, None, 32, stop_ids=(9,))
    plain, eager = Request(0, [4], 3), Request(1, [5], 3, ignore_eos=True)
    for r in (plain, eager):
        sched.add(r)
    while not sched.done:
        plan = sched.schedule()
        sched.finish_step(plan, [9] * sum(s.samples for s in plan.items))
    assert plain.output == [9] and eager.output == [9, 9, 9]


# -- answers ----------------------------------------------------------------------------------------------------------

def test_streamed_completion_is_the_greedy_output(served):
    n = 30
    out = served.greedy(STOP_PROMPT, n)
    assert out[-1] == served.stop_id and len(out) < n   # the output ends at the end of a turn
    evs = stream(served, "/v1/completions", {"prompt": STOP_PROMPT, "max_tokens": n,
                                             "stream_options": {"include_usage": True}})
    assert all(e["id"] == evs[0]["id"] and e["object"] == "text_completion" and e["model"] == MODEL for e in evs)
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == served.text(out)
    assert [e["choices"][0]["finish_reason"] for e in evs[:-1]] == [None] * (len(evs) - 2) + ["stop"]
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == {
        "prompt_tokens": len(STOP_PROMPT), "completion_tokens": len(out), "total_tokens": len(STOP_PROMPT) + len(out)}
    # ignore_eos: exactly max_tokens tokens, the end of turn among them; whole, as the same text
    free = served.greedy(STOP_PROMPT, n, stop=False)
    r = served.client.post("/v1/completions", json={"prompt": STOP_PROMPT, "max_tokens": n, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["completion_tokens"] == n
    assert body["choices"][0] == {"index": 0, "text": served.tok.decode(free, skip_special=True), "logprobs": None,
                                  "finish_reason": "length"}


def test_twenty_concurrent_clients_get_their_own_greedy_outputs(served):
    rng = random.Random(3)
    bodies = []
    for i in range(20):
        prompt = ("the cat " * rng.randrange(1, 4)).strip() if i % 4 == 3 else \
            [rng.randrange(0, 259) for _ in range(rng.randrange(2, 14))]
        bodies.append({"prompt": prompt, "max_tokens": rng.randrange(4, 24), "stream": i % 2 == 0})
    refs = [served.greedy(served.ref.encode(b["prompt"]), b["max_tokens"]) for b in bodies]

    async def one(client, body):
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            choice = r.json()["choices"][0]
            return choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]
        async with client.stream("POST", "/v1/completions",
                                 json={**body, "stream_options": {"include_usage": True}}) as r:
            evs = events([line async for line in r.aiter_lines()])
        return ("".join(e["choices"][0]["text"] for e in evs[:-1]), evs[-2]["choices"][0]["finish_reason"],
                evs[-1]["usage"]["completion_tokens"])

    async def all_at_once():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))

    answers = asyncio.run(all_at_once())
    for body, ref, (text, finish, tokens) in zip(bodies, refs, answers):
        assert (text, finish, tokens) == (served.text(ref), served.finish(ref, body["max_tokens"]), len(ref)), body
    served.idle()


def test_chat_applies_the_template_and_cuts_at_a_stop_string(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    ids = served.tok.encode_messages(messages)
    assert served.tok.decode(ids) == "<system>be brief<user>the cat<assistant>"
    n = 24
    ref = served.greedy(ids, n)
    r = served.client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": n})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": served.text(ref)}
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(ref)
    # parts of text are one content; a stop string two characters into the answer ends it there, streamed
    text = served.text(ref)
    at = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    evs = stream(served, "/v1/chat/completions", {"messages": parts, "max_tokens": n, "stop": [stop, "\x00\x00"]})
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in evs[1:]]
    assert "".join(deltas) == text[:text.find(stop)]
    assert evs[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    served.idle()


# -- the hand-off from the engine thread --------------------------------------------------------------------------

def test_a_turn_wakes_the_server_loop_once_and_a_late_handler_takes_every_ready_token_in_one_chunk(monkeypatch):
    """8 streams over a stand-in engine loop (harness/server_bench.py: a token to every running request each 2 ms
    turn). The engine thread wakes the server's event loop at most once a turn, however many streams the turn feeds
    (not once per stream or token), and not again while a wake-up is still queued there; when the server's loop is
    held up for many turns, a stream's next chunk holds every token made meanwhile (text and token ids), and still
    every stream is the engine's output token for token."""
    from onepass.harness.server_bench import LETTERS, FakeRunner, FakeSetup, byte_tokenizer, fake_engine

    tok = byte_tokenizer()
    vocab = [tok.encode(c)[0] for c in LETTERS]
    server = OpenAIServer(fake_engine(tok, 257), FakeSetup(lambda: FakeRunner(8, 0.002, 0, vocab, 4096)),
                          SamplingParams(), MODEL)
    wakes = []   # cross-thread wake-ups the engine thread sent
    call_soon_threadsafe = asyncio.BaseEventLoop.call_soon_threadsafe

    def counted(loop, *args, **kwargs):
        if threading.current_thread() is server.loop.thread:
            wakes.append(time.perf_counter())
        return call_soon_threadsafe(loop, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", counted)
    stats, n, held = server.runner.stats, 150, []

    def hold_up():   # on the server's loop: 40 ms in which it runs nothing
        turns, sent = stats.turns, len(wakes)
        time.sleep(0.04)
        held.append((stats.turns - turns, len(wakes) - sent))

    async def one(client, first: bool):
        body = {"prompt": [1, 2, 3], "max_tokens": n, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            chunks = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if first and len(chunks) == 3:
                        server.loop.arrivals.open_streams()[0].loop.call_soon_threadsafe(hold_up)
        return chunks

    async def all_at_once():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(*(one(client, i == 0) for i in range(8)))

    url = server.start()
    try:
        answers = asyncio.run(all_at_once())
    finally:
        server.stop()
    assert stats.turns >= n and 0 < len(wakes) <= stats.turns, (len(wakes), stats.turns)
    (turns, sent), = held
    assert turns >= 5 and sent <= 1, held   # many turns, one wake-up (queued before the loop could run it)
    for chunks in answers:
        rid = int(chunks[0]["id"].removeprefix("cmpl-"))
        deltas = [c["choices"][0] for c in chunks[:-1]]
        ids = [t for d in deltas for t in d["token_ids"]]
        assert ids == [vocab[(rid + i) % len(vocab)] for i in range(n)]
        assert "".join(d["text"] for d in deltas) == tok.decode(ids) and chunks[-1]["choices"][0]["finish_reason"]
    longest = max(len(d["choices"][0]["token_ids"]) for d in answers[0][:-1])
    assert longest >= 5, longest   # the tokens of the turns it was held up for, in one chunk


# -- clients that leave -----------------------------------------------------------------------------------------------

def test_a_client_gone_mid_stream_or_mid_answer_gives_back_its_slot_and_blocks(served):
    n = CTX - 4
    cancelled = served.metrics()["onepass_requests_cancelled_total"]
    with served.client.stream("POST", "/v1/completions", json={"prompt": [7, 8, 9, 10], "max_tokens": n,
                                                               "ignore_eos": True, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:   # tokens are flowing: leave
                break
    # a whole answer's client: a raw connection closed while the request decodes
    body = json.dumps({"prompt": [11, 12, 13], "max_tokens": n, "ignore_eos": True}).encode()
    with socket.create_connection(served.server.sock.getsockname()[:2]) as sock:
        served.idle()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 20
        while not any(len(q.output) >= 2 for q in list(served.sched.running.values())):
            assert time.monotonic() < deadline
            time.sleep(0.002)
    served.idle()
    gone = [q for q in served.sched.finished if q.cancelled]
    assert [q.prompt for q in gone[-2:]] == [[7, 8, 9, 10], [11, 12, 13]]
    assert all(len(q.output) < n for q in gone[-2:])   # stopped early, not run to max_tokens
    assert not served.sched.running and len(served.sched.free_slots) == SLOTS
    bm = served.sched.bm
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks - 1
    assert served.metrics()["onepass_requests_cancelled_total"] == cancelled + 2


# -- refusals ---------------------------------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
BAD = [   # (path, body, status, param, words the message holds)
    ("completions", b'{"prompt": [1, 2', 400, None, "not valid JSON"),
    ("completions", [1, 2], 400, None, "send an object"),
    ("completions", {"max_tokens": 4}, 400, "prompt", "prompt is required"),
    ("completions", {"prompt": [1, 2], "model": "gpt-4"}, 404, "model", "`gpt-4` does not exist"),
    ("completions", {"prompt": [1] * (CTX + 1)}, 400, "prompt", f"{CTX + 1} tokens, more than this server's context "
                                                                f"of {CTX}"),
    ("completions", {"prompt": [1] * 60, "max_tokens": 60}, 400, "max_tokens", "need 119 positions"),
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "at least one token"),
    ("completions", {"prompt": [1, 2], "max_tokens": -5}, 400, "max_tokens", "max_tokens=-5"),
    ("completions", {"prompt": [1, 2], "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": [1, 2], "n": 2}, 400, "n", "n=2 is not supported"),
    ("completions", {"prompt": [1, 2], "logprobs": 1}, 400, "logprobs", "log probabilities"),
    ("completions", {"prompt": [1, 2], "echo": True}, 400, "echo", "not supported"),
    ("completions", {"prompt": [1, 2], "bogus": 1}, 400, "bogus", "Unrecognized request argument supplied: bogus"),
    ("completions", {"prompt": [1, 300]}, 400, "prompt", "token 300 is not in the vocabulary"),
    ("completions", {"prompt": [[1], [2]]}, 400, "prompt", "2 prompts"),
    ("completions", {"prompt": []}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": [1, 2], "temperature": 0.8}, 400, "temperature", "sampling.temperature=0.8"),
    ("completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs", "log probabilities"),
    ("chat/completions", {"messages": CHAT, "seed": 3}, 400, "seed", "sampling.seed"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", ""),
]


def test_each_bad_request_gets_its_status_and_openai_error(served):
    for path, body, status, param, words in BAD:
        r = (served.client.post(f"/v1/{path}", content=body) if isinstance(body, bytes)
             else served.client.post(f"/v1/{path}", json=body))
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (status, param), (body, err)
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert words in err["message"], (body, err)
    # the defaults of those fields, and sampling settings a greedy server makes no use of, are taken
    ok = {"prompt": [1, 2], "max_tokens": 2, "n": 1, "logprobs": None, "echo": False, "temperature": 0, "top_p": 0.5,
          "top_k": -1, "model": MODEL, "stop": None, "user": "me"}
    assert served.client.post("/v1/completions", json=ok).status_code == 200
    assert served.client.get("/v1/nowhere").json()["error"]["message"] == "Not Found"


def test_metrics_models_and_health(served):
    assert served.client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 3}).status_code == 200
    models = served.client.get("/v1/models").json()
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", CTX)]
    assert served.client.get("/health").json() == {"status": "ok"}
    served.idle()
    m = served.metrics()
    bm = served.sched.bm
    assert m["onepass_requests_waiting"] == m["onepass_requests_running"] == m["onepass_kv_blocks_used"] == 0
    assert m["onepass_kv_blocks_total"] == bm.num_blocks - 1
    assert m["onepass_generated_tokens_total"] >= 3 and m["onepass_generated_tokens_per_second"] > 0
    assert m["onepass_requests_finished_total"] >= 1 and m["onepass_requests_rejected_total"] == 0
    assert "onepass_requests_cancelled_total" in m


# -- starting and stopping -----------------------------------------------------------------------------------------

def test_start_server_in_process_serves_and_stops_after_its_open_requests(chat_gguf):
    engine = Engine.from_gguf(chat_gguf, device="cpu", batch=2, ctx=48)
    url, stop = start_server(engine, ServingSetup(engine, layout="contiguous"), SamplingParams(), "m")
    assert int(url.rsplit(":", 1)[1]) > 0
    client = httpx.Client(base_url=url, timeout=30)
    try:
        assert client.post("/v1/completions", json={"prompt": "the", "max_tokens": 2}).status_code == 200
        assert "onepass_kv_blocks_total" not in client.get("/metrics").text   # a contiguous cache has no blocks
        with client.stream("POST", "/v1/completions", json={"prompt": [5, 6], "max_tokens": 40, "ignore_eos": True,
                                                            "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            stop()   # graceful: the open stream is answered to its end first
            evs = events([line for line in lines])
        assert evs[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.ConnectError):
            client.get("/health")
    finally:
        client.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the engine thread's crash
def test_an_engine_that_stops_answers_its_waiting_clients_and_health(chat_gguf):
    engine = Engine.from_gguf(chat_gguf, device="cpu", batch=1, ctx=16)
    server = OpenAIServer(engine, ServingSetup(engine, layout="contiguous"), SamplingParams(), "m")

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    server.runner.step.launch = broken
    client = httpx.Client(base_url=server.start(), timeout=30)
    try:
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert "RuntimeError: device lost" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 503   # no request is taken
    finally:
        client.close()
        server.stop()


def test_compose_takes_a_serve_section_and_serving_defaults():
    cfg = compose(["model=tiny-llama", "serve.port=0", "serve.model_name=x"])
    assert (cfg.serve.port, cfg.serve.model_name, cfg.serve.max_tokens) == (0, "x", 256)
    assert (cfg.scheduler.mode, cfg.kv_cache.layout) == ("continuous", "paged")
    assert compose(["scheduler=wave", "kv_cache=contiguous"]).scheduler.mode == "wave"
    with pytest.raises(Exception, match="prot"):
        compose(["serve.prot=1"])


def test_the_command_serves_a_job_config_and_stops_on_sigterm(tmp_path):
    cmd = [sys.executable, "-m", "onepass.harness.server", "model=tiny-llama", "engine=cpu", "engine.threads=1",
           "batch.size=2", "kv_cache.ctx=32", "serve.port=0", "serve.model_name=tiny"]
    err = tmp_path / "stderr"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err.open("w"), text=True)
    try:
        lines = []
        while not lines or not (lines[-1].startswith("[serve]") or lines[-1] == ""):
            lines.append(proc.stdout.readline())   # "" once it has exited
        url = re.search(r"at (http://\S+)/v1$", lines[-1].strip())
        assert url, "".join(lines) + err.read_text()
        client = httpx.Client(base_url=url.group(1), timeout=30)
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 4
        r = client.post("/v1/completions", json={"prompt": "text"})   # a synthetic model has no tokenizer
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
